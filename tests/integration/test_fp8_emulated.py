"""precision=fp8_emulated trains like bf16 within a tolerance, for each scaling granularity."""

from __future__ import annotations

import pytest

from ampctl.cli import main
from tests.conftest import QUIET, train

GPT = ["recipe=gpt", "recipe.d_model=64", "recipe.n_layers=2", "recipe.n_heads=2", "recipe.block_size=64",
       "recipe.batch_size=8", "recipe.max_corpus_bytes=200000", "train.steps=30"]


@pytest.fixture(scope="module")
def bf16_losses(tmp_path_factory):
    _, rows = train(tmp_path_factory.mktemp("bf16"), *GPT, "precision=bf16", base=QUIET)
    return [r["loss"] for r in rows]


@pytest.mark.parametrize("scaling", ["current", "delayed", "blockwise precision.fp8_emulated.format=e4m3"])
def test_an_emulated_fp8_gpt_trains_within_a_tolerance_of_bf16(tmp_path, bf16_losses, scaling):
    _, rows = train(tmp_path, *GPT, "precision=fp8_emulated", *f"precision.fp8_emulated.scaling={scaling}".split(), base=QUIET)
    losses = [r["loss"] for r in rows]
    assert losses[-1] < losses[0] - 1.0  # it learns
    assert abs(losses[-1] - bf16_losses[-1]) < 0.05, (losses[-1], bf16_losses[-1])


def test_blockwise_scaling_in_the_hybrid_format_is_refused(tmp_path, restore_argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "precision=fp8_emulated", "precision.fp8_emulated.scaling=blockwise", "device=cpu",
              f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "precision.fp8_emulated.format='hybrid' is not allowed: expected e4m3 with scaling=blockwise" in err
    assert err.count("\n") == 1


def test_delayed_scaling_resumes_exactly_because_its_amax_history_is_checkpointed(tmp_path):
    args = [*GPT, "precision=fp8_emulated", "precision.fp8_emulated.scaling=delayed", "precision.fp8_emulated.amax_history_len=4",
            "train.steps=8", "train.lr_schedule=constant"]
    _, whole = train(tmp_path / "whole", *args, base=QUIET)
    train(tmp_path / "resumed", *args, "train.steps=4", base=QUIET)
    _, resumed = train(tmp_path / "resumed", *args, "resume=auto", base=QUIET)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]
