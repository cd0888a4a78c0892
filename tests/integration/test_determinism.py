"""train.deterministic=true (engine/determinism.py): two runs of one config are the same bits step by step in every
precision mode that runs here, the run says so (its start line, summary.json), torch's flags are put back after it,
and an op without a deterministic implementation is one line naming it."""

from __future__ import annotations

import json

import pytest
import torch

import ampctl
from tests.support.configs import MODES
from tests.support.in_process import run_ampctl

RUN = ["device=cpu", "recipe=mlp", "recipe.hidden=32", "recipe.batch_size=16", "recipe.norm=batchnorm",
       "train.console=quiet", "train.steps=12", "train.log_every=4", "train.lr.warmup_steps=0",
       "telemetry.profile_cpu_memory=false", "train.deterministic=true"]
KEYS = ("step", "loss", "loss_scale", "grad_norm", "skipped")
CONVERTED = [["precision=bf16_true"], ["precision=fp8_emulated"], ["precision=mxfp8"], ["precision=mxfp4"]]


def rows(run_dir) -> list[dict]:
    return [{k: r[k] for k in KEYS} for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.parametrize("overrides", MODES + CONVERTED, ids=lambda o: " ".join(x.split("=")[1] for x in o))
def test_two_runs_of_one_config_are_the_same_bits_step_by_step(tmp_path, overrides):
    first = ampctl.train([*RUN, *overrides], run_dir=tmp_path / "a")
    second = ampctl.train([*RUN, *overrides], run_dir=tmp_path / "b")
    assert rows(first.run_dir) == rows(second.run_dir) and len(rows(first.run_dir)) == 12
    assert first.summary["deterministic"] is True
    assert not torch.are_deterministic_algorithms_enabled()  # put back: this process goes on


def test_the_start_line_says_it(tmp_path):
    done = run_ampctl("train", *RUN, f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr
    assert "deterministic: torch.use_deterministic_algorithms(True), cuDNN deterministic without autotuning, " \
           "CUBLAS_WORKSPACE_CONFIG=:4096:8" in done.stdout


def test_an_op_without_a_deterministic_implementation_is_one_line_naming_it(tmp_path):
    done = run_ampctl("train", "device=cpu", "recipe=mlp", "recipe._target_=tests.support.broken_recipes.BrokenRecipe",
                      "+recipe.mistake=nondeterministic_op", "train.deterministic=true", "train.console=quiet",
                      f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("ampctl train: error: train.deterministic=true: put_ has no deterministic "
                                  "implementation in torch (at step 1)")
    same = run_ampctl("train", "device=cpu", "recipe=mlp", "recipe._target_=tests.support.broken_recipes.BrokenRecipe",
                      "+recipe.mistake=nondeterministic_op", "train.console=quiet", "train.steps=2",
                      f"hydra.run.dir={tmp_path / 'without'}")
    assert same.returncode == 0, same.stderr  # the op itself is fine without the flag
