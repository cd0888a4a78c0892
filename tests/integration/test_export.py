"""`ampctl export`: each export loaded back the way its format is read (safetensors' load_model, torch.load,
transformers' from_pretrained) and evaluated on the run's held-out batches. float32 gives back the run's own
evaluation exactly; bfloat16 and float16 hold each weight rounded once from its full-precision value (O2's fp32
masters, the fp32 average), so their metrics are the checkpoint's within that rounding."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from safetensors.torch import load_file, load_model

from ampctl.engine.evaluation import Evaluator
from ampctl.recipes.mlp import MLPRecipe
from tests.support.in_process import run_ampctl

RUN = ["train", "device=cpu", "recipe=mlp", "recipe.hidden=32", "recipe.batch_size=16", "train.console=quiet",
       "telemetry.profile_cpu_memory=false", "train.steps=12", "train.eval.every=12", "train.eval.batches=2"]


def evaluate(model: torch.nn.Module, recipe=None) -> dict[str, float]:
    recipe = recipe or MLPRecipe(hidden=32, batch_size=16)
    return Evaluator(recipe, torch.device("cpu"), 2).evaluate(model, contextlib.nullcontext())


def last_eval(run_dir) -> dict:
    return json.loads((run_dir / "evals.jsonl").read_text().splitlines()[-1])


def exported(run_dir, *args: str) -> str:
    result = run_ampctl("export", str(run_dir), *args)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1].rsplit(" to ", 1)[1]


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("export") / "run"
    result = run_ampctl(*RUN, "train.ema.decay=0.7", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr
    return run_dir


@pytest.mark.parametrize("weights", ["model", "ema"])
def test_a_float32_export_evaluates_exactly_as_the_run_did(fp32_run, weights):
    out = exported(fp32_run, f"export.weights={weights}")
    assert out.endswith(f"exports/step_00000012-{weights}-float32")
    model = MLPRecipe(hidden=32, batch_size=16).build_model()
    missing, unexpected = load_model(model, f"{out}/model.safetensors")
    assert not missing and not unexpected
    metrics = evaluate(model)
    prefix = "eval/ema_" if weights == "ema" else "eval/"
    assert metrics["loss"] == last_eval(fp32_run)[f"{prefix}loss"]
    assert metrics["accuracy"] == last_eval(fp32_run)[f"{prefix}accuracy"]
    record = json.loads((fp32_run / "exports" / out.rsplit("/", 1)[1] / "export.json").read_text())
    assert (record["step"], record["weights"], record["dtype"], record["format"]) == (12, weights, "float32",
                                                                                      "safetensors")
    assert record["source"] == str(fp32_run / "checkpoints" / "step_00000012.pt")
    assert record["source_sha256"] == (fp32_run / "checkpoints" / "step_00000012.pt.sha256").read_text().split()[0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_export_is_each_weight_rounded_once_and_evaluates_within_that_rounding(fp32_run, dtype):
    out = exported(fp32_run, f"export.dtype={dtype}", "export.weights=ema", "export.format=pt")
    saved = torch.load(f"{out}/model.pt", weights_only=True)
    average = torch.load(fp32_run / "checkpoints" / "step_00000012.pt", weights_only=True)["ema"]
    for name, tensor in saved.items():
        assert tensor.dtype == getattr(torch, dtype)
        if name in average:
            assert torch.equal(tensor, average[name].to(tensor.dtype)), name
    model = MLPRecipe(hidden=32, batch_size=16).build_model().to(getattr(torch, dtype))
    model.load_state_dict(saved)
    model.register_forward_pre_hook(lambda _module, args: (args[0].to(getattr(torch, dtype)),))  # served in dtype
    metrics = evaluate(model)
    assert metrics["loss"] == pytest.approx(last_eval(fp32_run)["eval/ema_loss"], rel=2e-2)
    assert metrics["loss"] != last_eval(fp32_run)["eval/ema_loss"]  # rounded: not the fp32 figure


def test_o2_exports_its_fp32_masters_not_their_half_copies(tmp_path):
    run_dir = tmp_path / "run"
    assert run_ampctl(*RUN, "precision=O2", f"hydra.run.dir={run_dir}").returncode == 0
    out = exported(run_dir)
    payload = torch.load(run_dir / "checkpoints" / "step_00000012.pt", weights_only=True)
    weights = load_file(f"{out}/model.safetensors")
    half = [name for name, t in payload["model"].items() if t.dtype == torch.float16 and name.endswith("weight")]
    assert half and all(weights[n].dtype == torch.float32 for n in weights)
    masters = iter(payload["weights"]["masters"])
    for name, tensor in payload["model"].items():
        if tensor.dtype == torch.float16:
            master = next(masters)
            assert torch.equal(weights[name], master) and not torch.equal(weights[name], tensor.float()), name
    # float16 from the masters is the model's own half weights: each rounded once, as the run rounded them
    out16 = exported(run_dir, "export.dtype=float16", f"export.dir={tmp_path / 'fp16'}")
    assert all(torch.equal(load_file(f"{out16}/model.safetensors")[n], payload["model"][n].half())
               for n in payload["model"])


@pytest.mark.slow
def test_an_hf_export_is_a_directory_transformers_loads_and_evaluates_as_the_run_did(tmp_path):
    transformers = pytest.importorskip("transformers")
    from ampctl.recipes.hf_causal_lm import HFCausalLMRecipe

    run_dir = tmp_path / "run"
    hf = ["recipe=hf_causal_lm", "recipe.model_type=llama", "+recipe.config.hidden_size=64",
          "+recipe.config.num_hidden_layers=2", "recipe.block_size=32", "recipe.batch_size=4",
          "recipe.max_corpus_bytes=200000"]
    result = run_ampctl(*RUN[:2], *hf, *RUN[5:], "train.ema.decay=0.5", "train.console=quiet",
                        f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr
    recipe = HFCausalLMRecipe(model_type="llama", config={"hidden_size": 64, "num_hidden_layers": 2}, block_size=32,
                              batch_size=4, max_corpus_bytes=200000)
    for dtype, weights in (("float32", "model"), ("bfloat16", "ema")):
        out = exported(run_dir, "export.format=hf", f"export.dtype={dtype}", f"export.weights={weights}")
        assert out.endswith(f"step_00000012-{weights}-{dtype}-hf")
        model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
        assert model.dtype == getattr(torch, dtype)
        metrics = Evaluator(recipe, torch.device("cpu"), 2).evaluate(model, contextlib.nullcontext())
        recorded = last_eval(run_dir)["eval/loss" if weights == "model" else "eval/ema_loss"]
        if dtype == "float32":
            assert metrics["loss"] == pytest.approx(recorded, rel=1e-6)
        else:
            assert metrics["loss"] == pytest.approx(recorded, rel=2e-2)


@pytest.mark.parametrize("pruned", [1, 3])
def test_a_checkpoint_its_running_run_prunes_while_it_is_read_is_taken_again_or_said_in_one_line(
        tmp_path, monkeypatch, pruned):
    """A run training with train.checkpoint.every=1 removes the checkpoint an export chose (train.checkpoint.keep):
    the export takes the newest again; pruned every time it tries, one line and nothing written (it was a
    FileNotFoundError traceback). The prune is made as the export's load opens the file, as the run's would."""
    from ampctl.runner.checkpointing import checkpoint, export

    run_dir = tmp_path / "run"
    assert run_ampctl(*RUN, "train.checkpoint.every=4", "train.checkpoint.keep=4",
                      f"hydra.run.dir={run_dir}").returncode == 0
    load, removed = checkpoint.load, []

    def pruned_first(path, mmap=False):
        if len(removed) < pruned:  # the run's prune lands between the export's choice and its read
            removed.append(path.name)
            path.unlink()
        return load(path, mmap=mmap)

    monkeypatch.setattr(checkpoint, "load", pruned_first)
    result = run_ampctl("export", str(run_dir))
    if pruned < export.PRUNED_TRIES:
        assert result.returncode == 0, result.stderr
        assert "step_00000012.pt was pruned by its run while it was read; taking the newest again" in result.stdout
        assert (run_dir / "exports" / "step_00000008-model-float32").is_dir()
    else:
        assert result.returncode == 2 and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
        assert "was removed while it was read (3 tries): its run prunes its older checkpoints" in result.stderr
        assert not (run_dir / "exports").exists()
    assert removed == [f"step_{step:08d}.pt" for step in (12, 8, 4)][:pruned]
