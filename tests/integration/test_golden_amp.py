"""Golden behaviour: ampctl's recorded losses and loss scales equal the canonical torch.amp loop's, run for run
(whole training runs: integration tier)."""

from __future__ import annotations

import pytest
import torch

from tests.support.golden import GOLDEN, canonical_loop
from tests.support.training import train_here


@pytest.mark.parametrize(
    "precision,dtype,use_scaler",
    [("fp16", torch.float16, True), ("bf16", torch.bfloat16, False)],
)
def test_losses_and_scales_equal_the_canonical_loop(tmp_path, precision, dtype, use_scaler):
    _, rows = train_here(tmp_path, f"precision={precision}", *GOLDEN)
    losses, scales, _ = canonical_loop(dtype, use_scaler)
    assert [r["loss"] for r in rows] == pytest.approx(losses, rel=0, abs=0)
    assert [r["loss_scale"] for r in rows] == scales


def test_forced_overflow_skips_and_matches_canonical_scales(tmp_path):
    _, rows = train_here(tmp_path, "precision=fp16", "scaler.init_scale=1e20", *GOLDEN)
    losses, scales, _ = canonical_loop(torch.float16, True, init_scale=1e20)
    assert [r["loss_scale"] for r in rows] == pytest.approx(scales, rel=1e-6)
    assert [r["loss"] for r in rows] == losses
    assert rows[0]["skipped"] and rows[0]["loss_scale"] == pytest.approx(1e20, rel=1e-6)


def test_recorded_scale_follows_gradscaler_law(tmp_path):
    """x backoff after a skip, x growth after growth_interval clean steps, unchanged otherwise."""
    growth_interval = 3
    _, rows = train_here(
        tmp_path, "precision=fp16", "scaler.init_scale=1e20", f"scaler.growth_interval={growth_interval}",
        "scaler.growth_factor=4", "scaler.backoff_factor=0.25", "train.steps=40", "train.clip_grad_norm=null",
    )
    skipped = [r["skipped"] for r in rows]
    assert skipped[0] and not all(skipped) and sum(skipped) >= 2
    expected, clean = rows[0]["loss_scale"], 0
    for row in rows:
        assert row["loss_scale"] == pytest.approx(expected, rel=1e-6), f"step {row['step']}"
        if row["skipped"]:
            expected, clean = expected * 0.25, 0
        else:
            clean += 1
            if clean == growth_interval:
                expected, clean = expected * 4, 0
    assert rows[-1]["skipped_total"] == sum(skipped)

