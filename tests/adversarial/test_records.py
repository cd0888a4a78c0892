"""Problems named, nothing recorded twice: trackers across resumes, rows lost or damaged on disk, a run whose every step
was skipped. (The adversarial suite: real processes where a kill or a signal is the point.)"""

from __future__ import annotations

import json

import pytest

from ampctl.cli import main
from tests.support.adversarial import MLP, cli
from tests.support.runs import snapshot

# --- problems named, nothing recorded twice ------------------------------------------------------------------


def test_a_resumed_run_logs_no_step_twice_to_mlflow(tmp_path, restore_argv):
    """A run killed after logging steps past its checkpoint (its newest checkpoint removed, as a kill before it
    was written leaves the directory), then resumed: MLflow's append-only history holds each step once."""
    pytest.importorskip("mlflow")
    from tests.support.tracker_readers import mlflow_run

    run, uri = tmp_path / "run", f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = [*MLP, "train.checkpoint.every=4", "logger=mlflow", f"logger.mlflow.tracking_uri={uri}",
              f"hydra.run.dir={run}"]
    main(["train", *common, "train.steps=6"])
    for path in (run / "checkpoints").glob("step_00000006.pt*"):
        path.unlink()
    main(["train", *common, "train.steps=8", "resume=auto"])
    held = mlflow_run(uri, json.loads((run / "trackers.json").read_text())["mlflow"])
    logged = [m.step for m in held["histories"]["train/loss"]]
    assert sorted(logged) == list(range(1, 9)), logged


def test_a_garbled_trackers_json_is_refused_not_taken_for_a_new_tracker_run(tmp_path, capsys, restore_argv):
    pytest.importorskip("mlflow")
    run, uri = tmp_path / "run", f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = [*MLP, "logger=mlflow", f"logger.mlflow.tracking_uri={uri}", f"hydra.run.dir={run}"]
    main(["train", *common, "train.steps=2"])
    (run / "trackers.json").write_bytes(b"\x00{garbled")
    before = snapshot(run)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *common, "train.steps=4", "resume=auto"])
    assert exit_info.value.code == 2
    assert "trackers.json cannot be read: it names the tracker runs this run continues" in capsys.readouterr().err
    assert set(snapshot(run)) >= set(before)


@pytest.mark.parametrize("uri", ["bogus://x", "sqlite:///{tmp}/afile/db.sqlite"])
def test_a_tracker_that_cannot_start_is_refused_before_the_first_record(tmp_path, uri):
    (tmp_path / "afile").write_text("")
    refused = cli("train", *MLP, "train.steps=2", "logger=mlflow",
                  f"logger.mlflow.tracking_uri={uri.format(tmp=tmp_path)}", f"hydra.run.dir={tmp_path / 'run'}",
                  cwd=tmp_path)
    assert refused.returncode == 2 and "logger=mlflow: could not start: " in refused.stderr, refused.stderr
    assert refused.stderr.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_rows_lost_on_disk_are_named_at_resume_and_by_report(tmp_path, capsys, restore_argv):
    run_dir = tmp_path / "run"
    main(["train", *MLP, "train.steps=12", "train.checkpoint.every=6", f"hydra.run.dir={run_dir}"])
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:20])  # cut inside row 4
    for path in (run_dir / "checkpoints").glob("step_00000012.pt*"):
        path.unlink()
    capsys.readouterr()
    main(["train", *MLP, "train.steps=14", f"hydra.run.dir={run_dir}", "resume=auto"])
    out = capsys.readouterr().out
    assert "metrics.jsonl up to the checkpoint at step 6: step(s) 4-6 missing" in out
    main(["report", str(run_dir)])
    assert f"warning: {run_dir / 'metrics.jsonl'}: step(s) 4-6 missing" in capsys.readouterr().out


@pytest.mark.parametrize("damage,named", [
    ("duplicate", "step(s) 2 recorded twice"), ("reorder", "rows out of step order"),
])
def test_report_names_duplicated_and_out_of_order_rows(tmp_path, capsys, restore_argv, damage, named):
    run_dir = tmp_path / "run"
    main(["train", *MLP, "train.steps=4", f"hydra.run.dir={run_dir}"])
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lines = lines + [lines[1]] if damage == "duplicate" else [lines[1], lines[0], *lines[2:]]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    main(["report", str(run_dir)])
    assert named in capsys.readouterr().out


@pytest.mark.parametrize("damage,named", [
    ("overrides", "overrides.yaml cannot be read"), ("loss", "its loss is 'abc', not a number"),
])
def test_report_on_a_damaged_record_is_one_line(tmp_path, capsys, restore_argv, damage, named):
    run_dir = tmp_path / "run"
    main(["train", *MLP, "train.steps=3", f"hydra.run.dir={run_dir}"])
    if damage == "overrides":
        (run_dir / ".hydra" / "overrides.yaml").write_text("- [unclosed\n")
    else:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        lines[1] = json.dumps({**json.loads(lines[1]), "loss": "abc"})
        (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(run_dir)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and named in err, err


def test_a_run_whose_every_step_was_skipped_says_so_and_why_and_fails(tmp_path, capsys, restore_argv):
    """Gradients never finite at the scale: the scale's to fix, a warning. A NaN loss at every step (which an fp16
    run once blamed on the loss scale, exit 0): the loss itself, which no scale reaches: recorded whole (its
    summary), then said as the failure it is (exit 1)."""
    main(["train", *MLP, "precision=fp16", "scaler.init_scale=1e38", "scaler.backoff_factor=0.9999",
          "guard.max_consecutive_skips=null", "train.steps=3", f"hydra.run.dir={tmp_path / 'run'}"])
    assert "warning: every step was skipped (3 of 3: the gradients were never finite at the loss scale)" in \
        capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "device=cpu", "train.console=quiet", "precision=fp16", "train.steps=3",
              "recipe._target_=tests.support.broken_recipes.BrokenRecipe", "+recipe.mistake=nan_loss",
              f"hydra.run.dir={tmp_path / 'nan'}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "the loss itself was not finite at every step, before any loss scaling" in err
    assert json.loads((tmp_path / "nan" / "summary.json").read_text())["skipped_total"] == 3
