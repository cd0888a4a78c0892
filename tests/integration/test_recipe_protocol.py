"""A user recipe that breaks the protocol ends in one line naming the recipe member and what the protocol
needs, exit 2, no run directory left (each mistake as a new user would make it; tests/support/broken_recipes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ampctl.cli import main

RECIPE = "tests.support.broken_recipes.BrokenRecipe"
SOURCE = Path(__file__).resolve().parents[1] / "support" / "broken_recipes.py"
MODEL_CALL = SOURCE.read_text().splitlines().index("        out = model(x)") + 1  # where a list batch fails


@pytest.mark.parametrize("mistake,message", [
    ("vector_loss", "loss(model, batch) returned a torch.float32 tensor of shape (8, 1); the protocol needs a "
                    "scalar (0-dim) floating-point tensor: reduce it, e.g. .mean()"),
    ("integer_loss", "loss(model, batch) returned an int (3); the protocol needs a scalar (0-dim) floating-point "
                     "tensor"),
    ("none_loss", "loss(model, batch) returned None; the protocol needs a scalar (0-dim) floating-point tensor"),
    ("detached_loss", "loss(model, batch) returned a torch.float32 tensor of shape () without grad; the protocol "
                      "needs a loss computed from the model's output (this one has no grad"),
    ("not_a_module", "build_model() returned a list; the protocol needs a torch.nn.Module"),
    ("list_batches", "loss() raised TypeError: linear(): argument 'input' (position 1) must be Tensor, not list "
                     f"(broken_recipes.py:{MODEL_CALL}); loss(model, batch) gets one batch exactly as batches() "
                     f"yielded it"),
    ("finite_batches", "batches(device, seed) ended after step 3; the protocol needs an endless iterator"),
    ("raises_in_init", f"recipe._target_='{RECIPE}' could not be instantiated: ValueError: vocab file "
                       "'data/vocab.txt' not found"),
    ("string_samples", "samples_per_batch is a str ('8'); the protocol needs an integer >= 1 (the samples in one "
                       "batch)"),
    ("zero_samples", "samples_per_batch is an int (0); the protocol needs an integer >= 1 (the samples in one batch)"),
    ("int_batches", "batches(device, seed) returned an int (42); the protocol needs an endless iterator"),
    ("int_blocks", "activation_checkpoint_blocks(model) returned an int (5); the protocol needs a list of the "
                   "model's torch.nn.Module blocks"),
])
def test_a_recipe_that_breaks_the_protocol_is_one_line(tmp_path, restore_argv, capsys, mistake, message):
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "recipe=mlp", "recipe.batch_size=8", "device=cpu", "train.steps=5", "train.console=quiet",
              f"recipe._target_={RECIPE}", f"+recipe.mistake={mistake}", f"hydra.run.dir={run_dir}",
              *(["train.activation_checkpointing=true"] if mistake == "int_blocks" else [])])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    if mistake not in ("raises_in_init", "string_samples", "zero_samples"):
        assert f"recipe {RECIPE}: " in err
    else:
        assert mistake == "raises_in_init" or f"recipe._target_='{RECIPE}': " in err
    if mistake == "finite_batches":  # found at step 4: the steps that ran are recorded (step 1's row shows at once)
        assert not (run_dir / "summary.json").exists() and (run_dir / "metrics.jsonl").read_text().count("\n") == 1
    else:  # found before anything ran: nothing is left
        assert not run_dir.exists()


def test_a_recipe_module_that_cannot_be_imported_says_why(tmp_path, restore_argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "recipe._target_=my_recipes.LinReg", f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "ampctl train: error: recipe._target_='my_recipes.LinReg' could not be instantiated: ModuleNotFoundError: "
        "No module named 'my_recipes' (is its module importable? run from the directory that holds it with "
        "PYTHONPATH=.)\n")


@pytest.mark.parametrize("mistake,precision,message", [
    ("half_overflow", "fp16", "loss() raised RuntimeError at step 1 under precision=fp16: value cannot be converted to "
                              "type c10::Half without overflow (broken_recipes.py:LINE); 1e5 does not fit float16 (max "
                              "65504): a tensor made like autocast's output"),
    ("mixed_dtypes", "bf16", "loss() raised RuntimeError at step 1 under precision=bf16: expected m1 and m2 to have "
                             "the same dtype, but got: c10::BFloat16 != float (broken_recipes.py:LINE); a dtype "
                             "mismatch: autocast runs the ops it lists (matmuls, convolutions) in bfloat16"),
])
def test_a_recipe_that_raises_under_a_precision_says_what_where_and_why_and_shows_its_own_frames(
        tmp_path, restore_argv, capsys, mistake, precision, message):
    """Not ampctl's or Hydra's 60 lines: the member, the step, the precision and, where the error is precision's,
    what it is in its terms; then the user's own frames; the whole traceback in train.log, the run directory kept."""
    run_dir = tmp_path / "run"
    line = next(i for i, text in enumerate(SOURCE.read_text().splitlines(), 1)
                if f'self.mistake == "{mistake}"' in text) + (1 if mistake == "half_overflow" else 2)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "recipe=mlp", "recipe.batch_size=8", "device=cpu", "train.steps=5", "train.console=quiet",
              f"precision={precision}", f"recipe._target_={RECIPE}", f"+recipe.mistake={mistake}",
              f"hydra.run.dir={run_dir}"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"ampctl train: stopped: recipe {RECIPE}: ") and \
        message.replace("LINE", str(line)) in err[0], err
    assert err[1] == f"the recipe's own frames (the whole traceback is in {run_dir / 'train.log'}):"
    assert err[2] == f'  File "{SOURCE}", line {line}, in loss' and len(err) <= 6, err
    assert "Traceback" not in "\n".join(err) and "hydra" not in "\n".join(err)
    log = (run_dir / "train.log").read_text()
    assert "Traceback (most recent call last):" in log and "ampctl/engine/loop.py" in log and err[0][:60] in log
