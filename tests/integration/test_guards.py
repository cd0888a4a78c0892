"""Numeric guards stop a run that trains nothing, and the replay names the layer that overflowed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ampctl.cli import main

QUIET = ["device=cpu", "train.console=quiet", "train.lr.warmup_steps=0",
         "telemetry.profile_cpu_memory=false"]  # the memory timeline is not under test here


def strict_json(path: Path):
    """Parse as strict JSON readers do: a bare NaN or Infinity is an error, not a float."""
    def refuse(token):
        raise ValueError(f"{path.name} holds {token}, which is not JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


def stopped(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ampctl train: stopped: ")
    return err


def test_fp16_overflow_in_a_named_layer_is_found_by_the_replay(tmp_path, capsys, restore_argv):
    run = tmp_path / "run"
    err = stopped(capsys, ["train", "recipe=exploding", "precision=fp16", "scaler.init_scale=1",
                           "guard.max_consecutive_skips=4", "train.steps=40", "train.log_every=2",
                           "train.checkpoint.every=2", *QUIET, f"hydra.run.dir={run}"])
    assert "4 consecutive skipped steps (5..8)" in err and "'amplifier'" in err
    diagnosis = strict_json(run / "diagnosis.json")
    assert diagnosis["step"] == 5
    assert diagnosis["forward"] == {"module": "amplifier", "type": "Amplify", "dtype": "float16",
                                    "max_abs": None, "problem": "non-finite"}  # inf, written as JSON's null
    assert diagnosis["checkpoint_replayed_from"].endswith("step_00000004.pt")  # replayed from the last good one


def test_a_nonfinite_loss_without_a_scaler_stops_at_once(tmp_path, capsys, restore_argv):
    run = tmp_path / "run"
    err = stopped(capsys, ["train", "recipe=exploding", "recipe.factor=1e36",
                           "recipe.input_gain=1e4", "precision=bf16", "train.steps=40", "train.log_every=1", *QUIET,
                           f"hydra.run.dir={run}"])
    assert "non-finite loss nan at step 5" in err
    diagnosis = strict_json(run / "diagnosis.json")
    assert diagnosis["forward"]["module"] == "amplifier" and diagnosis["checkpoint_replayed_from"] is None
    assert diagnosis["loss"] is None  # nan
    rows = (run / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 5  # with log_every=1 it stops on the very step


def test_on_nonfinite_warn_trains_on(tmp_path, capsys, restore_argv):
    run = tmp_path / "run"
    main(["train", "recipe=exploding", "recipe.factor=1e36", "recipe.input_gain=1e4",
          "precision=bf16", "guard.on_nonfinite=warn", "train.steps=8", "train.log_every=4", *QUIET,
          f"hydra.run.dir={run}"])
    assert "warning: non-finite loss" in capsys.readouterr().out
    summary = strict_json(run / "summary.json")
    assert summary["steps"] == 8 and summary["final_loss"] is None and summary["tail_loss"] is None  # nan


def test_an_overflow_at_min_scale_stops_the_run(tmp_path, capsys, restore_argv):
    run = tmp_path / "run"
    err = stopped(capsys, ["train", "recipe=mlp", "precision=fp16", "scaler.init_scale=1e30",
                           "scaler.backoff_factor=0.01", "scaler.min_scale=1e26", "train.steps=40",
                           "train.log_every=2", *QUIET,
                           f"hydra.run.dir={run}"])
    assert "step 3 overflowed at the minimum loss scale (scaler.min_scale=1e+26)" in err
    assert json.loads((run / "diagnosis.json").read_text())["loss_scale"] == pytest.approx(1e26, rel=1e-6)


def test_hysteresis_tolerates_overflows_before_backing_off(tmp_path, restore_argv):
    run = tmp_path / "run"
    main(["train", "recipe=mlp", "precision=fp16", "scaler.init_scale=1e9", "scaler.hysteresis=3",
          "scaler.growth_interval=1000", "train.steps=6", "train.log_every=3", *QUIET, f"hydra.run.dir={run}"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in rows[:4]] == [True] * 4
    assert [r["loss_scale"] for r in rows[:5]] == [1e9, 1e9, 1e9, 5e8, 2.5e8]  # backs off from the 3rd on


# no norm layer: it would normalize the spiking batch's gain away
SPIKE = ["recipe=loss_spike", "recipe.hidden=32",
         "recipe.norm=none", "guard.loss_spike=6", "guard.loss_spike_window=20", "train.log_every=10", *QUIET]


def test_a_loss_spike_is_caught_at_its_step_and_the_run_stops_with_its_replay(tmp_path, capsys, restore_argv):
    """The batch of step 45 spikes the loss (recipe=loss_spike): the guard, which reads every step's
    record on log steps, names step 45, not the log step after it, and the replay finds every value finite."""
    run = tmp_path / "run"
    err = stopped(capsys, ["train", *SPIKE, "recipe.spike_at=45", "train.steps=80", f"hydra.run.dir={run}"])
    assert "loss spike at step 45: " in err and "robust deviations above the median" in err
    assert "of the 20 steps before it (guard.loss_spike=6)" in err
    assert strict_json(run / "diagnosis.json")["step"] == 45
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 50  # recorded up to the log step that read it, as the other guards


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_smooth_run_is_never_taken_for_a_spike(tmp_path, precision, restore_argv):
    """The same recipe without its spike, 200 steps from a fresh init (its loss falls fast, then wiggles), in
    three modes: the guard never trips."""
    run = tmp_path / "run"
    main(["train", *SPIKE, "recipe.spike_at=0", "train.steps=200", f"precision={precision}",
          f"hydra.run.dir={run}"])
    assert json.loads((run / "summary.json").read_text())["steps"] == 200
