"""Every kind of user-supplied input that can be wrong, beyond config values (see test_config and test_cli):
recipe targets, corpus and data paths. One line naming the input, exit code 2, no run directory left."""

from __future__ import annotations

import sys

import pytest

from ampctl.cli import main


def refused(tmp_path, capsys, *args: str) -> str:
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *args, "train.steps=2", f"hydra.run.dir={run_dir}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert not run_dir.exists()
    return err


def test_a_recipe_target_that_does_not_import(tmp_path, capsys, restore_argv):
    err = refused(tmp_path, capsys, "recipe=mlp", "recipe._target_=no_such_module.Recipe")
    assert "recipe._target_='no_such_module.Recipe' could not be instantiated" in err


def test_a_recipe_target_that_does_not_follow_the_protocol(tmp_path, capsys, restore_argv):
    err = refused(tmp_path, capsys, "recipe=mlp", "recipe._target_=argparse.Namespace")
    assert "returned a Namespace without samples_per_batch, tokens_per_batch, build_model, batches, loss" in err


def test_an_optimizer_target_that_does_not_import(tmp_path, capsys, restore_argv):
    err = refused(tmp_path, capsys, "recipe=mlp", "optimizer._target_=torch.optim.NoSuchOptimizer")
    assert "optimizer._target_='torch.optim.NoSuchOptimizer' could not be instantiated" in err


def empty_file(folder):
    (folder / "empty.txt").write_text("")
    return folder / "empty.txt"


def empty_dir(folder):
    (folder / "empty_dir").mkdir()
    return folder / "empty_dir"


@pytest.mark.parametrize("make,message", [
    (lambda folder: folder / "missing.txt", "does not exist"),
    (empty_file, "holds 0 bytes"),
    (empty_dir, "holds 0 bytes"),
])
def test_bad_corpus_paths(tmp_path, capsys, restore_argv, make, message):
    corpus = make(tmp_path)
    err = refused(tmp_path, capsys, "recipe=gpt", f"recipe.corpus={corpus}")
    assert f"recipe.corpus='{corpus}'" in err and message in err


def test_missing_cifar10_without_download(tmp_path, capsys, restore_argv):
    err = refused(tmp_path, capsys, "recipe=resnet", f"recipe.data_root={tmp_path / 'nothing'}")
    assert "holds no CIFAR-10" in err and "recipe.download=true" in err


def test_an_unknown_resnet_arch(tmp_path, capsys, restore_argv):
    err = refused(tmp_path, capsys, "recipe=resnet", "recipe.data=synthetic", "recipe.arch=resnet9000")
    assert "recipe.arch='resnet9000' is not allowed" in err


@pytest.mark.parametrize("args,message", [
    (["precision.options.margin=2"],
     "precision.options.margin=2: precision.options.margin is an option of precision=fp8_emulated only; "
     "choose it on the same command line (precision=fp8_emulated precision.options.margin=2)"),
    (["precision=bf16", "precision.options.recipe_name=rowwise"],
     "precision.options.recipe_name=rowwise: precision.options.recipe_name is an option of precision=fp8 only"),
    # the nodes before precision.options (precision.fp8 was the emulation's, precision.float8 torchao's)
    (["precision=fp8_emulated", "precision.fp8.margin=2"],
     "precision.fp8: renamed; set precision.options.* (the options of precision=fp8_emulated)"),
    (["precision.float8.compile=false"],
     "precision.float8: renamed; set precision.options.* (the options of precision=fp8)"),
    (["precision=mxfp4", "precision.mx.scale_mode=rceil"],
     "precision.mx: renamed; set precision.options.* (the options of precision=mxfp8, mxfp4 or nvfp4)"),
])
def test_a_mode_option_under_a_mode_without_it(tmp_path, capsys, restore_argv, args, message):
    """OmegaConf asserts on a key under a null node; the user sees which mode owns the option."""
    assert message in refused(tmp_path, capsys, "recipe=mlp", *args)


@pytest.mark.parametrize("args,message", [
    (["recipe=mlp", "train.profile=0"],
     "train.profile=0 is not allowed: expected a number of steps >= 1, or null for no profile"),
    (["recipe=resnet", "recipe.data=synthetic", "recipe.num_workers=-1"],
     "recipe.num_workers=-1 is not allowed: expected an integer >= 0"),
])
def test_bad_speed_settings(tmp_path, capsys, restore_argv, args, message):
    assert message in refused(tmp_path, capsys, *args)


@pytest.mark.parametrize("args,message", [
    (["logger=[csv,tensorbord]"], "logger=tensorbord: no such logger (did you mean tensorboard?); choose one of csv, "
                                  "mlflow, tensorboard, wandb"),
    (["logger=tensorboard", "logger.csv.file=x"], "logger.csv.file=x: logger.csv.* are the options of logger=csv, "
                                                  "which is not chosen; choose it on the same command line"),
    (["logger=wandb", "logger.wandb.mode=sometimes"], "logger.wandb.mode='sometimes' is not allowed: expected one of "
                                                      "online, offline, disabled"),
])
def test_bad_logger_settings(tmp_path, capsys, restore_argv, args, message):
    assert message in refused(tmp_path, capsys, "device=cpu", "recipe=mlp", *args)


@pytest.mark.parametrize("package,recipe,extra", [("timm", "timm", "timm"),
                                                  ("transformers", "hf_causal_lm", "transformers")])
def test_a_model_library_not_installed(tmp_path, capsys, restore_argv, monkeypatch, package, recipe, extra):
    monkeypatch.setitem(sys.modules, package, None)  # `import timm` raises ImportError, as where it is absent
    err = refused(tmp_path, capsys, f"recipe={recipe}")
    assert f"recipe={recipe}: the {package} package is not installed; pip install 'ampctl[{extra}]'" in err


@pytest.mark.parametrize("args,message", [
    (["recipe=timm", "recipe.model=resnet_18"], "recipe.model='resnet_18': no such timm model (did you mean "),
    (["recipe=hf_causal_lm", "recipe.model_type=gpt3"], "recipe.model_type='gpt3': no causal language model"),
    (["recipe=hf_causal_lm", "+recipe.config.n_embd=64"], "recipe.config.n_embd: LlamaConfig has no such field"),
    (["recipe=hf_causal_lm", "recipe.config.hidden_size=64"],
     "recipe.config.hidden_size: no such key; to add a key recipe.config does not have, write "
     "+recipe.config.hidden_size=..."),
])
def test_model_library_names_and_fields(tmp_path, capsys, restore_argv, args, message):
    pytest.importorskip("timm" if "recipe=timm" in args else "transformers")
    assert message in refused(tmp_path, capsys, *args)


def test_an_image_folder_without_images(tmp_path, capsys, restore_argv):
    pytest.importorskip("timm")
    (tmp_path / "images" / "cat").mkdir(parents=True)
    err = refused(tmp_path, capsys, "recipe=timm", "recipe.data=imagefolder", f"recipe.data_root={tmp_path / 'images'}")
    assert f"recipe.data_root='{tmp_path / 'images'}' holds no images: Found no valid file for the classes cat" in err


def test_a_tilde_the_shell_left_in_a_path_says_what_to_write(tmp_path, capsys, restore_argv):
    """`recipe.data_root=~/data`: a shell expands ~ only in a variable's assignment, so Hydra gets it, and its grammar
    refuses it (docs/models.md showed such lines once)."""
    err = refused(tmp_path, capsys, "recipe=resnet", "recipe.data_root=~/data/pets")
    assert ("recipe.data_root=~/data/pets: the shell leaves ~ as it is after a config key's =, and Hydra's grammar "
            "refuses it: write $HOME/data/pets (or the path in full)") in err


@pytest.mark.parametrize("overrides,said", [
    (["precision=nvfp4", "precision.options.kernels=torchao"], "precision.options.kernels='torchao' is not allowed"),
    (["precision=mxfp8", "precision.options.kernels=torchao", "telemetry.blocks_every=2"],
     "telemetry.blocks_every=2 with precision.options.kernels=torchao: it observes ampctl's emulated layers"),
    (["precision=mxfp8", "precision.options.rht=true"], "precision.options.rht=True is not allowed"),
    (["precision=bf16", "telemetry.blocks_every=2"], "no layer computes in a block-scaled format"),
    (["precision=nvfp4_recipe", "precision.rules=[{match: 'blocks.-9.*', run_in: bf16}]", "recipe=gpt",
      "recipe.n_layers=2", "recipe.d_model=32", "recipe.n_heads=2", "recipe.max_corpus_bytes=100000"], "blocks.-9.*"),
])
def test_what_nvfp4s_recipe_and_torchaos_layers_cannot_do(tmp_path, capsys, restore_argv, overrides, said):
    """A recipe option on a mode without it, torchao's layers where they cannot compute, block scales without blocks
    or with torchao's layers, a block counted from the end beyond the blocks: one line, exit 2, nothing written."""
    err = refused(tmp_path, capsys, "recipe=mlp", "device=cpu", *overrides)
    assert said in err, err


@pytest.mark.parametrize("schedule,extra,said", [
    ("[{step: 2, precision: bf16}]", [], "at or past the run's end (train.steps=2)"),
    ("[{at: 0.5, precision: bf16}, {at: 0.25, precision: fp32}]", ["train.steps=8"],
     "is not after the one before it"),
    ("[{at: 0.5, precision: bf17}]", [], "precision.schedule: 'bf17' is not a precision mode (did you mean bf16?)"),
    ("[{at: 0.5, precision: O2}]", [], "changes how the weights are held (cast_model False -> True"),
    ("[{at: 0.5, step: 1, precision: bf16}]", [], "precision.schedule[].at=0.5"),
    ("[{at: 1.5, precision: bf16}]", [], "a fraction of train.steps in (0, 1)"),
    ("[{at: 0.5}]", [], "a change needs one"),
    ("[{at: 0.5, precision: bf16}]", ["guard.on_trip=escalate"], "guard.on_trip=escalate with precision.schedule"),
    ("[{at: 0.5, precision: fp8}]", [], "precision=fp8 needs FP8 tensor cores"),
])
def test_a_schedule_that_cannot_run(tmp_path, capsys, restore_argv, schedule, extra, said):
    """Past the end, out of order, not a mode, a change of how weights are held, a point given twice or outside the
    run, a change of nothing, with escalation, a mode the device lacks: one line, exit 2, nothing written."""
    err = refused(tmp_path, capsys, "recipe=mlp", "device=cpu", "precision=nvfp4", f"precision.schedule={schedule}",
                  *extra)
    assert said in err, err


@pytest.mark.parametrize("overrides,said", [
    (["recipe.top_k=9"], "recipe.top_k=9 is not allowed: expected an integer in [1, recipe.experts=8]"),
    (["recipe.d_model=40", "recipe.n_heads=4"], "recipe.d_model=40 is not allowed: expected a positive multiple of 16"),
    (["recipe.score=relu"], "recipe.score='relu' is not allowed: expected softmax | sigmoid"),
    (["precision=bf16", "precision.rules=[{type: Router, run_in: fp32}]", "recipe=gpt"],
     "matches no layer of this model"),
    (["precision=fp8_emulated", "precision.options.scaling=delayed"], "scaling=delayed with the grouped experts"),
    (["recipe.bias_update_speed=-0.001"], "recipe.bias_update_speed=-0.001 is not allowed: expected a number >= 0"),
    (["recipe.capacity_factor=0"], "recipe.capacity_factor=0 is not allowed: expected a number > 0, or null"),
])
def test_a_mixture_of_experts_that_cannot_run(tmp_path, capsys, restore_argv, overrides, said):
    """More experts chosen than there are, a width the grouped GEMM cannot align, a score it does not know, a rule on
    routers where the model has none, FP8's delayed scaling on grouped experts, a negative bias speed, no capacity:
    one line, exit 2, nothing written."""
    err = refused(tmp_path, capsys, "recipe=moe", "device=cpu", "recipe.max_corpus_bytes=100000", "recipe.n_layers=1",
                  *overrides)
    assert said in err, err
