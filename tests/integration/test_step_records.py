"""What whole runs record about their steps: skipped steps, the lr schedule, scale bounds, fused vs unfused."""

from __future__ import annotations

import json
import math

import pytest

from tests.support.training import train_here


def test_skipped_steps_are_the_same_for_fused_and_unfused_optimizers(tmp_path):
    common = ["precision=fp16", "scaler.init_scale=1e20", "scaler.backoff_factor=0.001",
              "scaler.growth_interval=2", "scaler.growth_factor=1000", "train.steps=30"]
    _, fused = train_here(tmp_path / "fused", *common, "optimizer.fused=true")
    _, unfused = train_here(tmp_path / "unfused", *common, "optimizer.fused=false")
    assert [r["skipped"] for r in fused] == [r["skipped"] for r in unfused]
    assert [r["loss_scale"] for r in fused] == [r["loss_scale"] for r in unfused]
    assert 3 < sum(r["skipped"] for r in fused) < 30  # it overflows, backs off, regrows, overflows again
    # a fused step that "ran" while skipped must not have moved anything: losses agree to fp noise
    assert [r["loss"] for r in fused] == pytest.approx([r["loss"] for r in unfused], rel=1e-3)


@pytest.mark.parametrize("fused", ["true", "false"])
def test_the_lr_schedule_does_not_advance_on_skipped_steps(tmp_path, fused):
    _, rows = train_here(
        tmp_path, "precision=fp16", "scaler.init_scale=1e20", "scaler.backoff_factor=0.001",
        "train.lr.schedule=linear", "train.lr.warmup_steps=10", "train.steps=20", f"optimizer.fused={fused}",
    )
    skipped = [r["skipped"] for r in rows]
    assert any(skipped) and not all(skipped)
    applied = 0
    for row in rows:
        # linear warm-up over 10 applied steps, then linear decay to min_lr_ratio=0.1 at step 20
        warmup = min(1.0, (applied + 1) / 10)
        decay = 1 - 0.9 * min(1.0, max(0.0, (applied - 10) / 10))
        assert row["lr"] == pytest.approx(1e-3 * warmup * decay, rel=1e-6), row["step"]
        applied += not row["skipped"]


@pytest.mark.parametrize("fused", ["true", "false"])
def test_the_lr_recorded_is_the_lr_the_optimizer_used(tmp_path, fused):
    """Not its float32 rounding: 5e-05 through a float32 tensor reads back as 4.999999873689376e-05."""
    _, rows = train_here(tmp_path, "optimizer.lr=5e-05", "train.lr.schedule=constant", "train.steps=2",
                    f"optimizer.fused={fused}")
    assert [r["lr"] for r in rows] == [5e-05, 5e-05]


def test_scale_bounds_hold(tmp_path):
    _, rows = train_here(tmp_path / "min", "precision=fp16", "scaler.init_scale=1e20", "scaler.backoff_factor=0.001",
                    "scaler.min_scale=1e6", "guard.stop_at_min_scale=false", "train.steps=20")
    assert [r["loss_scale"] for r in rows][:6] == pytest.approx([1e20, 1e17, 1e14, 1e11, 1e8, 1e6])
    assert min(r["loss_scale"] for r in rows) == pytest.approx(1e6)
    _, rows = train_here(tmp_path / "max", "precision=fp16", "scaler.init_scale=8", "scaler.growth_interval=1",
                    "scaler.max_scale=64", "train.steps=10")
    assert [r["loss_scale"] for r in rows][:5] == [8, 16, 32, 64, 64]


def test_fused_sgd_whose_first_step_is_skipped_trains_as_unfused_sgd(tmp_path):
    """torch's fused SGD marks its empty_like momentum buffers initialised even when the scaler skips its first
    step (NaN weights afterwards); ampctl zeroes them first, which leaves every step bit-identical."""
    common = ["precision=fp16", "optimizer=sgd", "scaler.init_scale=4294967296", "scaler.backoff_factor=0.125",
              "train.steps=12"]
    _, fused = train_here(tmp_path / "fused", *common, "optimizer.fused=true")
    _, unfused = train_here(tmp_path / "unfused", *common, "optimizer.fused=false")
    assert fused[0]["skipped"] and not all(r["skipped"] for r in fused)
    assert [r["loss"] for r in fused] == [r["loss"] for r in unfused]
    assert all(math.isfinite(r["loss"]) for r in fused)


def test_a_disabled_dynamic_scaler_is_the_identity(tmp_path):
    _, rows = train_here(tmp_path, "precision=bf16", "scaler=dynamic", "scaler.enabled=false", "train.steps=3")
    assert [r["loss_scale"] for r in rows] == [1.0, 1.0, 1.0]



def test_a_log_interval_longer_than_the_run_records_every_step_at_the_end(tmp_path):
    """The device buffer holds one log interval, never more rows than the run has (log_every=10**9 allocated
    40 GB before)."""
    summary, rows = train_here(tmp_path, "train.log_every=1000000000", "train.steps=3")
    assert [r["step"] for r in rows] == [1, 2, 3] and summary["steps"] == 3


def test_the_terminal_keeps_every_skip_and_scale_change_of_metrics_jsonl(tmp_path, restore_argv, capsys):
    """What the scale story says (runner/reporting/scale_story.py) against metrics.jsonl read independently: every
    skipped
    step named once, in a burst's range; a line after each step whose next step used a larger scale; the end
    line's counts."""
    import re

    from ampctl.cli import main

    run = tmp_path / "run"
    main(["train", "device=cpu", "recipe=mlp", "precision=fp16", "scaler.init_scale=1e9", "scaler.growth_interval=3",
          "train.steps=40", "train.log_every=7", "train.console=plain", "telemetry.profile_cpu_memory=false",
          f"hydra.run.dir={run}"])
    out = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["step"] for r in rows if r["skipped"]]
    grew_after = [a["step"] for a, b in zip(rows, rows[1:]) if not a["skipped"] and b["loss_scale"] > a["loss_scale"]]
    assert skipped and grew_after  # the run under test has both
    said_skipped = []
    for line in out:
        if m := re.match(r"steps? (\d+)(?:-(\d+))? skipped: gradients not finite", line):
            said_skipped += range(int(m[1]), int(m[2] or m[1]) + 1)
    assert said_skipped == skipped
    assert [int(m[1]) for line in out if (m := re.match(r"after step (\d+): loss scale", line))] == grew_after
    backoffs = sum(b["loss_scale"] < a["loss_scale"] for a, b in zip(rows, rows[1:]))
    [summary] = [line for line in out if line.startswith("loss scale ")]
    assert summary.endswith(f": {len(skipped)} skipped (first at step {skipped[0]}), {backoffs} backoff"
                            f"{'s' if backoffs != 1 else ''}, {len(grew_after)} growths")
    assert out.index(summary) == len(out) - 2 and out[-1].startswith("done:")
