"""train.profile=N and the data-wait figures, end to end: the trace is a whole Chrome trace of exactly the steps
named, the one-screen breakdown adds up to the step time, the profiled steps are left out of the timings, and a
step that waits on its data says so, with the wait checked against the sleep the recipe's data makes."""

from __future__ import annotations

import gzip
import json

import pytest

from ampctl.cli import main
from ampctl.runner.reporting.speed_warnings import DATA_WAIT_SHARE

MLP = ["device=cpu", "recipe.in_features=64", "recipe.hidden=32", "recipe.depth=2", "recipe.num_classes=10",
       "recipe.batch_size=16", "train.log_every=4", "train.console=plain", "telemetry.profile_cpu_memory=false",
       "train.timing_warmup_steps=2"]
SLOW = ["recipe=mlp", "recipe._target_=tests.support.slow_data_recipe.SlowDataRecipe", "+recipe.data_delay_s=0.05"]


def test_a_profiled_run_writes_the_trace_of_its_window_and_a_breakdown_that_adds_up(tmp_path, restore_argv, capsys):
    run = tmp_path / "run"
    main(["train", *MLP, *SLOW, "train.steps=12", "train.profile=3", f"hydra.run.dir={run}"])
    out = capsys.readouterr().out
    # the window: 2 timing warm-up steps, 1 profiler warm-up step, then steps 4-6
    trace = run / "profile" / "rank0.steps4-6.pt.trace.json.gz"
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert sorted(e["name"] for e in events if e["name"].startswith("ProfilerStep")) == [
        "ProfilerStep#4", "ProfilerStep#5", "ProfilerStep#6"]
    assert any(e["name"] == "aten::addmm" for e in events)
    assert not list((run / "profile").glob("*.tmp"))
    summary = json.loads((run / "summary.json").read_text())
    profile = summary["profile"]
    assert profile["first_step"] == 4 and profile["steps"] == 3 and profile["trace"] == str(trace.relative_to(run))
    parts = profile["ms_per_step"]
    assert sum(parts.values()) == pytest.approx(profile["step_ms"], rel=1e-3)
    # the recipe sleeps 50 ms a batch: all of it is data, and data is the fetch's own time, no more
    assert parts["data"] >= 50.0
    assert parts["data"] == pytest.approx(profile["data_host_ms_per_step"], rel=0.01)
    assert parts["matmul & conv"] > 0 and parts["optimizer"] > 0
    assert {t["name"] for t in profile["top"]} >= {"aten::addmm", "ampctl.data"}
    assert (run / "profile" / "rank0.steps4-6.txt").read_text().splitlines()[0] in out
    # the profiler's warm-up step, the window and the step that wrote the trace are not timed
    assert summary["timed_steps"] == 12 - 2 - 5
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(row["data_ms"] >= 50.0 for row in rows)
    timed = [r for r in rows if r["step"] > 2 and not 3 <= r["step"] <= 7]
    assert summary["data_wait_fraction"] == pytest.approx(
        sum(r["data_ms"] for r in timed) / sum(r["step_time_ms"] for r in timed))
    assert summary["data_wait_fraction"] > DATA_WAIT_SHARE
    warnings = [line for line in out.splitlines() if "waited for their batches" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: steps 3-12 ") and "recipe.num_workers" in warnings[0]


def test_a_run_whose_data_keeps_up_is_not_warned(tmp_path, restore_argv, capsys):
    run = tmp_path / "run"
    main(["train", *MLP, "recipe=mlp", "recipe.hidden=512", "train.steps=14", f"hydra.run.dir={run}"])
    assert "waited for their batches" not in capsys.readouterr().out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["profile"] is None and 0.0 < summary["data_wait_fraction"] < 0.5


def test_a_window_past_the_end_of_the_run_is_refused_before_anything_is_written(tmp_path, restore_argv, capsys):
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *MLP, "recipe=mlp", "train.steps=5", "train.profile=3", f"hydra.run.dir={run}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ampctl train: error: train.profile=3: the profiled steps would be 4-6, past train.steps=5 (the run "
                   "leaves out 2 warm-up step(s), then the profiler warms up for 1); raise train.steps to 6 or more, "
                   "or lower train.profile"]
    assert not run.exists()


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_data_wait_and_the_breakdown_hold_in_half_precision_modes(tmp_path, restore_argv, precision):
    """The fetch's time does not depend on the mode, and the breakdown adds up under autocast and a loss scaler."""
    run = tmp_path / "run"
    main(["train", *MLP, *SLOW, f"precision={precision}", "train.steps=6", "train.timing_warmup_steps=0",
          "train.profile=2", "train.log_every=3", f"hydra.run.dir={run}"])
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(50.0 <= row["data_ms"] < row["step_time_ms"] for row in rows)
    profile = summary["profile"]
    assert (profile["first_step"], profile["steps"]) == (2, 2)
    parts = profile["ms_per_step"]
    assert sum(parts.values()) == pytest.approx(profile["step_ms"], rel=1e-3)
    assert parts["data"] >= 50.0 and parts["matmul & conv"] > 0 and parts["optimizer"] > 0


def test_on_a_cpu_a_batch_made_in_the_loops_thread_is_its_own_cost_not_a_wait(tmp_path, restore_argv, capsys):
    """30 ms of the thread's own CPU work per batch (most of each step): data_ms has it, none of it idle, and no
    warning says the run waits on its data; a batch that sleeps as long (a pipeline behind) is said to."""
    run = tmp_path / "run"
    main(["train", *MLP, "recipe=mlp", "recipe._target_=tests.support.slow_data_recipe.BusyDataRecipe",
          "+recipe.data_work_s=0.03", "train.steps=14", f"hydra.run.dir={run}"])
    assert "waited for their batches" not in capsys.readouterr().out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # the thread's own CPU time is never idle, on a machine as busy as it may be (engine/thread_clock.py)
    assert all(row["data_ms"] - row["data_idle_ms"] >= 29.9 for row in rows), rows
    slept = tmp_path / "slept"
    main(["train", *MLP, *SLOW, "train.steps=14", f"hydra.run.dir={slept}"])
    assert "waited for their batches" in capsys.readouterr().out
    rows = [json.loads(line) for line in (slept / "metrics.jsonl").read_text().splitlines()]
    assert all(row["data_idle_ms"] >= 0.9 * 50.0 for row in rows)  # asleep: idle, all of it


def test_a_busy_machine_preempting_the_loop_is_not_taken_for_a_wait_on_data(tmp_path, restore_argv, capsys):
    """The same batches made in the loop's thread while other processes hold every core (a busy machine): the loop's
    thread is preempted in next() as in the rest of the step, and that is the machine's, not a pipeline's."""
    import os
    import subprocess
    import sys

    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        run = tmp_path / "run"
        main(["train", *MLP, "recipe=mlp", "recipe._target_=tests.support.slow_data_recipe.BusyDataRecipe",
              "+recipe.data_work_s=0.03", "train.steps=14", f"hydra.run.dir={run}"])
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert "waited for their batches" not in capsys.readouterr().out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    idle = sorted(row["data_idle_ms"] / row["data_ms"] for row in rows)
    assert idle[len(idle) // 2] < 0.1, idle  # the median step's
