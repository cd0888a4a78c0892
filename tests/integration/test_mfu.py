"""FLOPs and MFU as a run reports them: the model FLOPs in summary.json equal the hand count of the recipe's
matmuls, every metrics row's TFLOP/s is those FLOPs over its step time, and MFU is that over the peak named."""

from __future__ import annotations

import json

import pytest

from ampctl.analysis import cpu_speed
from ampctl.cli import main

MLP = ["device=cpu", "recipe=mlp", "recipe.in_features=64", "recipe.hidden=32", "recipe.depth=3",
       "recipe.num_classes=10", "recipe.batch_size=16", "recipe.norm=none", "train.steps=6", "train.log_every=3",
       "train.console=plain", "telemetry.profile_cpu_memory=false"]


@pytest.mark.parametrize("mode,dtype", [("fp32", "float32"), ("fp16", "float16"), ("bf16", "bfloat16")])
def test_a_runs_flops_tflops_and_mfu_follow_from_its_matmuls(tmp_path, restore_argv, capsys, mode, dtype):
    """Model FLOPs do not depend on the mode (the same matmuls); the peak is the one of the mode's dtype."""
    main(["train", *MLP, f"precision={mode}", "train.grad_accum_steps=2", f"hydra.run.dir={tmp_path / 'run'}"])
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    shapes, batch = [(64, 32), (32, 32), (32, 32), (32, 10)], 16
    per_micro_batch = sum(4 * batch * i * o for i, o in shapes) + sum(2 * batch * i * o for i, o in shapes[1:])
    assert summary["model_flops_per_step"] == 2 * per_micro_batch  # two micro-batches a step
    for row in rows:
        assert row["tflops"] == pytest.approx(summary["model_flops_per_step"] / (row["step_time_ms"] / 1e3) / 1e12)
    speed = cpu_speed.measured()
    if speed.peak_tflops(dtype) is None:
        # software-converted half matmuls have no peak (their rate depends on the shape), nor has a busy machine's
        # probe: no MFU rather than one over 100%
        assert summary["peak_source"].endswith(speed.why_no_peak(dtype))
        assert summary["mfu"] is None and all(row.get("mfu") is None for row in rows) and "MFU" not in out
        return
    assert f"{dtype} matmuls measured on" in summary["peak_source"]
    for row in rows:
        assert row["tflops"] == pytest.approx(summary["model_flops_per_step"] / (row["step_time_ms"] / 1e3) / 1e12)
        assert row["mfu"] == pytest.approx(row["tflops"] / summary["peak_tflops"])
    assert summary["achieved_tflops"] == pytest.approx(
        summary["model_flops_per_step"] / (summary["median_step_time_ms"] / 1e3) / 1e12)
    assert summary["mfu"] == pytest.approx(summary["achieved_tflops"] / summary["peak_tflops"])
    assert f"= {summary['mfu']:.1%} MFU" in out and f"MFU {rows[-1]['mfu']:.1%}" in out


def test_a_recipe_the_counter_cannot_trace_has_no_mfu_and_says_why(tmp_path, restore_argv):
    """A loss that reads a value back (.item()) cannot run on shapes alone: no figure, and the run goes on."""
    main(["train", *MLP, "recipe._target_=tests.support.broken_recipes.BrokenRecipe", "+recipe.mistake=item_in_loss",
          f"hydra.run.dir={tmp_path / 'run'}"])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["model_flops_per_step"] is None and summary["mfu"] is None
    assert summary["model_flops_source"].startswith("not counted: ")
    assert "tflops" not in json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
