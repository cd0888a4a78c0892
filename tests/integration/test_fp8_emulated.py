"""The emulated formats train like bf16 within a tolerance: precision=fp8_emulated for each scaling granularity,
and the microscaling formats (mxfp8, mxfp4, nvfp4)."""

from __future__ import annotations

import math

import pytest

from ampctl.cli import main
from tests.support.training import QUIET, train_here

GPT = ["recipe=gpt", "recipe.d_model=64", "recipe.n_layers=2", "recipe.n_heads=2", "recipe.block_size=64",
       "recipe.batch_size=8", "recipe.max_corpus_bytes=200000", "train.steps=30"]


@pytest.fixture(scope="module")
def bf16_losses(tmp_path_factory):
    _, rows = train_here(tmp_path_factory.mktemp("bf16"), *GPT, "precision=bf16", base=QUIET)
    return [r["loss"] for r in rows]


@pytest.mark.parametrize("scaling", ["current", "delayed", "blockwise precision.options.format=e4m3"])
def test_an_emulated_fp8_gpt_trains_within_a_tolerance_of_bf16(tmp_path, bf16_losses, scaling):
    scaling_args = f"precision.options.scaling={scaling}".split()
    _, rows = train_here(tmp_path, *GPT, "precision=fp8_emulated", *scaling_args, base=QUIET)
    losses = [r["loss"] for r in rows]
    assert losses[-1] < losses[0] - 1.0  # it learns
    assert abs(losses[-1] - bf16_losses[-1]) < 0.05, (losses[-1], bf16_losses[-1])


# The tolerance each format is held to, from the loss after 30 steps (measured on this GPT: bf16 4.084, mxfp8
# 4.094, mxfp8 e5m2-gradients/rceil 4.088, nvfp4 4.099, mxfp4 4.132): FP4 with power-of-two scales is the coarsest.
MX_TOLERANCE = {"mxfp8": 0.03, "mxfp8 precision.options.grad_elements=e5m2 precision.options.scale_mode=rceil": 0.03,
                "nvfp4": 0.05, "mxfp4": 0.1}


@pytest.mark.parametrize("mode", list(MX_TOLERANCE))
def test_an_emulated_microscaling_gpt_trains_within_a_tolerance_of_bf16(tmp_path, bf16_losses, mode):
    _, rows = train_here(tmp_path, *GPT, *f"precision={mode}".split(), base=QUIET)
    losses = [r["loss"] for r in rows]
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0] - 1.0  # it learns
    assert abs(losses[-1] - bf16_losses[-1]) < MX_TOLERANCE[mode], (losses[-1], bf16_losses[-1])
    assert losses != bf16_losses  # and it is not bf16 under another name


def test_blockwise_scaling_in_the_hybrid_format_is_refused(tmp_path, restore_argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "precision=fp8_emulated", "precision.options.scaling=blockwise", "device=cpu",
              f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "precision.options.format='hybrid' is not allowed: expected e4m3 with scaling=blockwise" in err
    assert err.count("\n") == 1


def test_delayed_scaling_resumes_exactly_because_its_amax_history_is_checkpointed(tmp_path):
    args = [*GPT, "precision=fp8_emulated", "precision.options.scaling=delayed",
            "precision.options.amax_history_len=4",
            "train.steps=8", "train.lr.schedule=constant"]
    _, whole = train_here(tmp_path / "whole", *args, base=QUIET)
    train_here(tmp_path / "resumed", *args, "train.steps=4", base=QUIET)
    _, resumed = train_here(tmp_path / "resumed", *args, "resume=auto", base=QUIET)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]
