"""Experiment trackers end to end: a real fp16 run with skipped steps and a growing loss scale, logged to csv,
TensorBoard, W&B (offline) and MLflow (a local SQLite store) at once, then resumed. What each tracker holds
is read back with its own reader (tests/support/tracker_readers.py) and compared with the run's metrics.jsonl, step
by step: every step once, every metric, the config and the summary."""

from __future__ import annotations

import csv
import json
import math

import pytest

from ampctl import run_files
from ampctl.cli import main
from ampctl.runner import trackers
from tests.support import tracker_readers

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")

# fp16 from a scale of 2^40: the first steps overflow and are skipped while the scale backs off, then it grows
RUN = ["device=cpu", "recipe=mlp", "recipe.hidden=32", "recipe.batch_size=16", "precision=fp16",
       "scaler.init_scale=1099511627776", "scaler.growth_interval=2", "train.log_every=4", "train.checkpoint.every=6",
       "train.console=quiet", "logger=[csv,tensorboard,wandb,mlflow]", "logger.wandb.mode=offline"]


def same(a: float, b: float, rel: float = 0.0) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b or (math.isinf(a) and a == b) or a == pytest.approx(b, rel=rel)


def test_every_tracker_holds_every_steps_record_the_config_and_the_summary_across_a_resume(
        tmp_path, restore_argv, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run, uri = tmp_path / "run", f"sqlite:///{tmp_path / 'mlflow.db'}"
    main(["train", *RUN, "train.steps=6", f"logger.mlflow.tracking_uri={uri}", f"hydra.run.dir={run}"])
    ids = json.loads((run / run_files.TRACKER_IDS).read_text())
    main(["train", *RUN, "train.steps=10", f"logger.mlflow.tracking_uri={uri}", f"hydra.run.dir={run}",
          "resume=auto"])
    assert json.loads((run / run_files.TRACKER_IDS).read_text()) == ids  # the same tracker runs, continued

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert any(r["skipped"] for r in rows) and len({r["loss_scale"] for r in rows}) > 2  # the figures move
    metrics = [name for name in trackers.METRICS if name in rows[0]]

    def value(row, name):  # metrics.jsonl writes a non-finite grad norm (a skipped step) as null
        return float("nan") if row[name] is None else float(row[name])

    # csv: every step once, numbers only, the columns named with their units
    with (run / "metrics.csv").open(newline="") as f:
        table = list(csv.DictReader(f))
    assert [int(r["step"]) for r in table] == list(range(1, 11))
    for row, line in zip(rows, table):
        for name in metrics:
            assert same(value(row, name), float(line[name])), (name, row, line)

    # TensorBoard: a scalar per metric and step (float32 in the event file), the config as HParams
    scalars = tracker_readers.tensorboard_scalars(run / "tensorboard")
    for name in metrics:
        assert sorted(scalars[f"train/{name}"]) == list(range(1, 11))
        for row in rows:
            assert same(value(row, name), scalars[f"train/{name}"][row["step"]], rel=1e-6), name
    assert scalars["summary/final_loss"][0] == pytest.approx(summary["final_loss"], rel=1e-6)
    hparams = tracker_readers.tensorboard_hparams(run / "tensorboard")
    assert hparams["precision.name"] == "fp16" and hparams["scaler.growth_interval"] == 2

    # W&B: the offline run's history across both processes, its config and summary
    wandb = tracker_readers.wandb_records(run)
    assert sorted(wandb["history"]) == list(range(7, 11))  # the resumed process's file: steps 7-10
    first = tracker_readers.wandb_records_of(sorted((run / "wandb").glob("offline-run-*"))[0])
    assert sorted(first["history"]) == list(range(1, 7))
    history = {**first["history"], **wandb["history"]}
    for row in rows:
        for name in metrics:
            assert same(value(row, name), history[row["step"]][f"train/{name}"]), name
    assert wandb["config"]["precision"]["name"] == "fp16" and wandb["config"]["train"]["steps"] == 10
    assert wandb["summary"]["final_loss"] == summary["final_loss"] and wandb["summary"]["steps"] == 10

    # MLflow: one run, finished; every step's metrics once; the config as params, the summary as metrics
    mlflow = tracker_readers.mlflow_run(uri, ids["mlflow"])
    assert mlflow["status"] == "FINISHED"
    for name in metrics:
        history = mlflow["histories"][f"train/{name}"]
        assert sorted(m.step for m in history) == list(range(1, 11)), name
        for row, m in zip(rows, sorted(history, key=lambda m: m.step)):
            assert same(value(row, name), m.value), name
    assert mlflow["params"]["precision.name"] == "fp16" and mlflow["params"]["train.steps"] == "6"  # as started
    assert mlflow["metrics"]["summary/final_loss"] == {6: pytest.approx(rows[5]["loss"]), 10: summary["final_loss"]}
    assert mlflow["tags"]["ampctl.precision"] == "fp16"


def test_a_tracker_whose_package_is_missing_is_one_line_naming_the_extra(tmp_path, capsys, restore_argv,
                                                                         monkeypatch):
    from ampctl.runner.trackers.wandb_tracker import WandbTracker

    monkeypatch.setattr(WandbTracker, "package", "wandb_is_not_installed_here")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "device=cpu", "recipe=mlp", "train.steps=2", "logger=[csv,wandb]",
              f"hydra.run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and not (tmp_path / "run").exists()
    assert "logger=wandb: the wandb_is_not_installed_here package is not installed; pip install 'ampctl[wandb]'" in err


def test_a_run_a_guard_stops_ends_its_tracker_runs_as_failed_with_every_recorded_step(tmp_path, restore_argv):
    """From step 5 the recipe's loss is not finite: the guard stops the run (exit 1). The trackers hold the
    steps the run recorded, and MLflow's run is FAILED, not left RUNNING."""
    run, uri = tmp_path / "run", f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "recipe=exploding", "recipe.factor=1e36", "recipe.input_gain=1e4", "precision=bf16",
              "device=cpu", "train.steps=40", "train.log_every=1", "train.console=quiet",
              "telemetry.profile_cpu_memory=false",
              "logger=[csv,mlflow]", f"logger.mlflow.tracking_uri={uri}", f"hydra.run.dir={run}"])
    assert exit_info.value.code == 1 and not (run / "summary.json").exists()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]
    with (run / "metrics.csv").open(newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == steps
    mlflow = tracker_readers.mlflow_run(uri, json.loads((run / run_files.TRACKER_IDS).read_text())["mlflow"])
    assert mlflow["status"] == "FAILED" and sorted(mlflow["metrics"]["train/loss"]) == steps
    assert math.isnan(mlflow["metrics"]["train/loss"][5])


def test_every_tracker_holds_every_evaluation_across_a_resume(tmp_path, restore_argv, monkeypatch):
    """Evaluations after steps 3, 6, 9 and the last (10), half of them before the resume: each tracker holds
    each one once, under eval/<metric>, equal to evals.jsonl's rows."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    run, uri = tmp_path / "run", f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = [*RUN, "train.eval.every=3", "train.eval.batches=2", f"logger.mlflow.tracking_uri={uri}",
              f"hydra.run.dir={run}"]
    main(["train", *common, "train.steps=6"])
    main(["train", *common, "train.steps=10", "resume=auto"])
    evals = [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [3, 6, 9, 10]
    names = [k for k in evals[0] if k.startswith("eval/")]
    assert names == ["eval/loss", "eval/accuracy"]

    with (run / "metrics_eval.csv").open(newline="") as f:
        table = list(csv.DictReader(f))
    assert [int(r["step"]) for r in table] == [3, 6, 9, 10]
    for row, line in zip(evals, table):
        assert all(same(row[name], float(line[name])) for name in names)

    scalars = tracker_readers.tensorboard_scalars(run / "tensorboard")
    for name in names:
        assert scalars[name] == {e["step"]: pytest.approx(e[name], rel=1e-6) for e in evals}

    folders = sorted((run / "wandb").glob("offline-run-*"))
    history = {}
    for folder in folders:
        history.update(tracker_readers.wandb_records_of(folder)["history"])
    for row in evals:
        assert all(history[row["step"]][name] == row[name] for name in names)
        assert "train/loss" in history[row["step"]]  # the step's own record beside it

    mlflow = tracker_readers.mlflow_run(uri, json.loads((run / run_files.TRACKER_IDS).read_text())["mlflow"])
    for name in names:
        assert mlflow["metrics"][name] == {e["step"]: pytest.approx(e[name]) for e in evals}
    # each process's summary: the last evaluation as of its end
    assert mlflow["metrics"]["summary/eval/loss"] == {6: pytest.approx(evals[1]["eval/loss"]),
                                                       10: pytest.approx(evals[-1]["eval/loss"])}


def test_every_tracker_holds_train_diff_measurements_across_a_resume(tmp_path, restore_argv, monkeypatch):
    """train.diff.every=3 over 9 steps, resumed after 6: each tracker holds each diffs.jsonl row once, under
    diff/gradient_error, diff/error_over_noise and diff/local/<layer> (the largest of its local errors)."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    run, uri = tmp_path / "run", f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = [*RUN, "train.diff.every=3", f"logger.mlflow.tracking_uri={uri}", f"hydra.run.dir={run}"]
    main(["train", *common, "train.steps=6"])
    main(["train", *common, "train.steps=9", "resume=auto"])
    diffs = [json.loads(line) for line in (run / "diffs.jsonl").read_text().splitlines()]
    assert [d["step"] for d in diffs] == [3, 6, 9]
    expected = {d["step"]: {"diff/gradient_error": d["gradient_error"], "diff/error_over_noise": d["error_over_noise"],
                            **{f"diff/local/{name}": max(v for k, v in layer.items() if k.endswith("_local")
                                                         and v is not None)
                               for name, layer in d["layers"].items()}} for d in diffs}
    names = list(expected[3])
    assert "diff/local/0" in names  # the MLP's first Linear (a Sequential names its layers by number)

    with (run / "metrics_diff.csv").open(newline="") as f:
        table = list(csv.DictReader(f))
    assert {int(r["step"]): {n: float(r[n]) for n in names} for r in table} == expected

    scalars = tracker_readers.tensorboard_scalars(run / "tensorboard")
    for name in names:
        assert scalars[name] == {s: pytest.approx(v[name], rel=1e-6) for s, v in expected.items()}
    history = {}
    for folder in sorted((run / "wandb").glob("offline-run-*")):
        history.update(tracker_readers.wandb_records_of(folder)["history"])
    for step, values in expected.items():
        assert {n: history[step][n] for n in names} == values
    mlflow = tracker_readers.mlflow_run(uri, json.loads((run / run_files.TRACKER_IDS).read_text())["mlflow"])
    for name in names:
        assert mlflow["metrics"][name] == {s: pytest.approx(v[name]) for s, v in expected.items()}


def test_each_sink_spells_a_non_finite_value_by_its_documented_rule(tmp_path):
    """A skipped step's grad norm, inf or NaN: metrics.jsonl null (strict JSON); the CSV Python's `inf`/`nan`;
    TensorBoard the float itself (as W&B, which logs what it is given); MLflow keeps NaN and leaves an infinity out
    of its step, since its SQL store would turn it into 1.8e308 (docs/runs.md)."""
    from omegaconf import OmegaConf

    from ampctl.engine.telemetry import StepRecord
    from ampctl.runner.trackers.csv_tracker import CsvOptions, CsvTracker
    from ampctl.runner.trackers.mlflow_tracker import MlflowOptions, MlflowTracker
    from ampctl.runner.trackers.tensorboard_tracker import TensorBoardOptions, TensorBoardTracker

    def record(step: int, grad_norm: float) -> StepRecord:
        return StepRecord(step=step, loss=1.0, loss_scale=2.0**16, skipped=not math.isfinite(grad_norm),
                          skipped_total=0, grad_norm=grad_norm, lr=1e-3, step_time_ms=1.0, samples_per_s=1.0)

    records = [record(1, 2.0), record(2, float("inf")), record(3, float("nan")), record(4, 3.0)]
    assert [json.loads(r.to_json())["grad_norm"] for r in records] == [2.0, None, None, 3.0]

    csv_tracker = CsvTracker(OmegaConf.structured(CsvOptions), tmp_path, None, None)
    csv_tracker.start(OmegaConf.create({}))
    csv_tracker.write(records)
    csv_tracker.fail()
    with (tmp_path / "metrics.csv").open(newline="") as f:
        assert [row["grad_norm"] for row in csv.DictReader(f)] == ["2.0", "inf", "nan", "3.0"]

    tensorboard = TensorBoardTracker(OmegaConf.structured(TensorBoardOptions), tmp_path, None, None)
    tensorboard.start(OmegaConf.create({}))
    tensorboard.write(records)
    tensorboard.fail()
    scalars = tracker_readers.tensorboard_scalars(tmp_path / "tensorboard")["train/grad_norm"]
    assert scalars[1] == 2.0 and scalars[2] == float("inf") and math.isnan(scalars[3]) and scalars[4] == 3.0

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MlflowTracker(OmegaConf.structured(MlflowOptions(tracking_uri=uri)), tmp_path, None, None)
    tracker.connect()
    tracker.start(OmegaConf.create({"train": {"steps": 4}}))
    tracker.write(records)
    tracker.finish({"steps": 4, "final_grad_norm": float("inf"), "final_loss": 1.0})
    run = tracker_readers.mlflow_run(uri, tracker.run_id)
    norms = {m.step: m.value for m in run["histories"]["train/grad_norm"]}
    assert list(norms) == [1, 3, 4] and norms[1] == 2.0 and math.isnan(norms[3]) and norms[4] == 3.0
    assert "summary/final_grad_norm" not in run["metrics"] and run["metrics"]["summary/final_loss"] == {4: 1.0}
    assert max(m.value for m in run["histories"]["train/loss_scale"]) == 2.0**16  # no 1.8e308 anywhere
