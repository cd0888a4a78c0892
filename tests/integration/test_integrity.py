"""Runs never lose or mix data (issue 25), adversarially: every command and the Python API own their output
directories; a checkpoint continues only its own run; a resume restores its run's own config; signals
outside the loop; sweeps that resume; problems named. Real processes where a kill or a signal is the point."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ampctl
from ampctl.cli import main
from ampctl.errors import UsageError
from tests.integration.test_run_ownership import QUICK, snapshot, start_a_long_run, steps

REPO = Path(__file__).resolve().parents[2]
MLP = ["device=cpu", "recipe=mlp", "recipe.hidden=32", "recipe.batch_size=16", "train.console=quiet",
       "telemetry.profile_cpu_memory=false", "train.log_every=1"]


def cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ampctl", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


def one_line_refusal(result: subprocess.CompletedProcess, command: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"ampctl {command}: error: "), result.stderr
    return result.stderr


# --- 1. ownership cannot be bypassed: resume= (empty), the Python API -----------------------------------------


def test_the_python_api_refuses_a_second_run_into_a_run_directory_and_touches_nothing(tmp_path):
    first = ampctl.train([*MLP, "train.steps=6"], run_dir=tmp_path / "runA")
    before = snapshot(first.run_dir)
    for again in ([*MLP, "train.steps=3"], [*MLP, "train.steps=3", "resume="]):
        with pytest.raises(UsageError, match="already holds a run .*continue it with resume=auto"):
            ampctl.train(again, run_dir=tmp_path / "runA")
        assert snapshot(first.run_dir) == before
    resumed = ampctl.train([*MLP, "train.steps=8", "resume=auto"], run_dir=tmp_path / "runA")
    assert steps(resumed.run_dir / "metrics.jsonl") == list(range(1, 9))


def test_the_python_api_refuses_the_current_directory_and_a_missing_config_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"hydra.run.dir='' is not allowed"):
        ampctl.train([*MLP, "train.steps=1"], run_dir="")
    with pytest.raises(UsageError, match=r"config_dir='/nonexistent' is not a directory"):
        ampctl.train([*MLP, "train.steps=1"], config_dir="/nonexistent")
    assert list(tmp_path.iterdir()) == []


# --- 2. a checkpoint continues only its own run ---------------------------------------------------------------


def test_a_checkpoint_copied_from_another_run_is_passed_over_by_resume_auto(tmp_path, capsys, restore_argv):
    main(["train", *MLP, "train.steps=8", "train.checkpoint_every=4", f"hydra.run.dir={tmp_path / 'A'}"])
    main(["train", *MLP, "train.steps=2", "train.seed=3", f"hydra.run.dir={tmp_path / 'B'}"])
    for path in (tmp_path / "A" / "checkpoints").glob("step_00000008.pt*"):
        shutil.copy(path, tmp_path / "B" / "checkpoints")
    capsys.readouterr()
    main(["train", *MLP, "train.steps=4", f"hydra.run.dir={tmp_path / 'B'}", "resume=auto"])
    out = capsys.readouterr().out
    assert "step_00000008.pt': it belongs to run " in out and "passed over" in out
    assert f"resumed from {tmp_path / 'B' / 'checkpoints' / 'step_00000002.pt'} at step 2" in out
    assert steps(tmp_path / "B" / "metrics.jsonl") == [1, 2, 3, 4]
    seeds = {json.loads((tmp_path / run / "identity.json").read_text())["config"]["train"]["seed"] for run in "AB"}
    assert seeds == {0, 3}
    # named explicitly, the copy is refused: a checkpoint continues only the run it belongs to
    [folder] = (tmp_path / "B" / "checkpoints").glob("timeline.set-aside-*")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *MLP, "train.steps=9", f"resume={folder / 'step_00000008.pt'}",
              f"hydra.run.dir={tmp_path / 'C'}"])
    assert exit_info.value.code == 2
    assert "a checkpoint continues only its own run" in capsys.readouterr().err


def test_a_checkpoint_with_its_checksum_deleted_and_a_bit_flipped_is_never_loaded(tmp_path, capsys, restore_argv):
    run_dir = tmp_path / "run"
    main(["train", *MLP, "train.steps=8", "train.checkpoint_every=4", f"hydra.run.dir={run_dir}"])
    newest = run_dir / "checkpoints" / "step_00000008.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x10
    newest.write_bytes(bytes(data))
    (run_dir / "checkpoints" / "step_00000008.pt.sha256").unlink()
    capsys.readouterr()
    main(["train", *MLP, "train.steps=10", f"hydra.run.dir={run_dir}", "resume=auto"])
    out = capsys.readouterr().out
    assert "step_00000008.pt' has no checksum" in out and "passed over" in out
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000004.pt'} at step 4" in out


def test_a_run_without_its_identity_is_refused_whatever_else_it_holds(tmp_path):
    """identity.json is written before a run's first record: a directory with records and no identity lost it, and
    a resume there could not tell the run's own checkpoints and config from another's. (a) killed before its first
    checkpoint: resume=auto trained the default GPT among the mlp's rows; (b) another run's checkpoint copied in:
    it resumed from it; (c) its own checkpoints: it resumed under a newly minted run id. Each is refused in one
    line and leaves the directory as it was."""
    killed = start_a_long_run(tmp_path / "a", rows=2)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    main_run = cli("train", *MLP, "train.steps=6", "train.checkpoint_every=3", "hydra.run.dir=A", cwd=tmp_path)
    other = cli("train", *MLP, "train.steps=2", "train.seed=4", "train.checkpoint_every=100", "hydra.run.dir=B",
                cwd=tmp_path)
    assert main_run.returncode == 0 and other.returncode == 0, main_run.stderr + other.stderr
    for path in (tmp_path / "B" / "checkpoints").glob("*"):
        path.unlink()
    for path in (tmp_path / "A" / "checkpoints").glob("step_00000006.pt*"):
        shutil.copy(path, tmp_path / "B" / "checkpoints")  # (b): B now holds only A's checkpoint
    shutil.copytree(tmp_path / "A", tmp_path / "C")  # (c): A's own records and checkpoints
    for run in ("a", "B", "C"):
        (tmp_path / run / "identity.json").unlink()
    for run, named in (("a", "holds a run's records (metrics.jsonl) but neither its identity.json nor a checkpoint"),
                       ("B", "holds checkpoints of run "), ("C", "holds checkpoints of run ")):
        before = snapshot(tmp_path / run)
        for resume in ("resume=auto", f"resume={tmp_path / run}"):
            refused = cli("train", "train.steps=8", resume, f"hydra.run.dir={tmp_path / run}", cwd=tmp_path)
            assert named in one_line_refusal(refused, "train"), (run, refused.stderr)
            assert snapshot(tmp_path / run) == before, run
    assert "but not its identity.json (removed or lost)" in refused.stderr
    # a checkpoint of it named as a file is refused the same way
    refused = cli("train", f"resume={tmp_path / 'C' / 'checkpoints' / 'step_00000006.pt'}", "train.steps=8",
                  "hydra.run.dir=D", cwd=tmp_path)
    assert "holds checkpoints of run " in one_line_refusal(refused, "train") and not (tmp_path / "D").exists()


def test_a_run_made_before_identities_resumes_from_its_checkpoints(tmp_path, capsys, restore_argv):
    """Its checkpoints carry no run id (the payload of a run made before identities): resume=auto takes them."""
    import torch

    run_dir = tmp_path / "old"
    main(["train", *MLP, "train.steps=4", "train.checkpoint_every=4", f"hydra.run.dir={run_dir}"])
    checkpoint = run_dir / "checkpoints" / "step_00000004.pt"
    payload = torch.load(checkpoint, weights_only=True)
    del payload["run_id"], payload["config_hash"]
    torch.save(payload, checkpoint)
    (run_dir / "checkpoints" / "step_00000004.pt.sha256").write_text(
        __import__("hashlib").sha256(checkpoint.read_bytes()).hexdigest() + "  step_00000004.pt\n")
    (run_dir / "identity.json").unlink()
    capsys.readouterr()
    main(["train", *MLP, "train.steps=6", f"hydra.run.dir={run_dir}", "resume=auto"])
    assert f"resumed from {checkpoint} at step 4" in capsys.readouterr().out
    assert steps(run_dir / "metrics.jsonl") == list(range(1, 7))


# --- 3. resume=auto restores the run's own config, checkpoint or not ---------------------------------------


def test_resume_auto_after_a_kill_before_the_first_checkpoint_trains_the_runs_own_config(tmp_path):
    run_dir = tmp_path / "run"
    killed = start_a_long_run(run_dir, rows=2)  # recipe=mlp recipe.hidden=32
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    resumed = cli("train", "device=cpu", "train.console=plain", "train.steps=3", "resume=auto",
                  f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "recipe=mlp" in resumed.stdout and "gpt" not in resumed.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["recipe"] == "mlp" and summary["parameters"] < 20_000  # recipe.hidden=32, as it was started
    assert steps(run_dir / "metrics.jsonl") == [1, 2, 3]
    # a change it may not make is refused against the run's own config
    refused = cli("train", "device=cpu", "recipe=mlp", "recipe.hidden=64", "resume=auto", f"hydra.run.dir={run_dir}",
                  cwd=tmp_path)
    assert "recipe.hidden was 32" in one_line_refusal(refused, "train")


# --- 4. no command writes over another's results ----------------------------------------------------------


@pytest.mark.parametrize("command", ["compare", "inspect", "memory", "advise"])
def test_a_command_into_a_directory_that_holds_results_is_refused_and_touches_nothing(tmp_path, command):
    run_dir = tmp_path / "done"
    first = cli("train", *MLP, "train.steps=2", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = snapshot(run_dir)
    again = cli(command, *MLP, "train.steps=2", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert "is not empty (" in one_line_refusal(again, command)
    assert snapshot(run_dir) == before
    empty = cli(command, *MLP, "hydra.run.dir=", cwd=tmp_path)
    assert "hydra.run.dir='' is not allowed" in one_line_refusal(empty, command)


def test_inspect_twice_into_one_directory_keeps_the_first_results(tmp_path):
    first = ampctl.inspect([*MLP, "inspect.steps=1"], out_dir=tmp_path / "ranges")
    before = snapshot(first.run_dir)
    with pytest.raises(UsageError, match="ampctl inspect writes only into a directory of its own"):
        ampctl.inspect([*MLP, "inspect.steps=1"], out_dir=tmp_path / "ranges")
    assert snapshot(first.run_dir) == before


@pytest.mark.parametrize("where", ["/etc/passwd-ampctl.csv", "../elsewhere.csv", "", ".hydra", "metrics.jsonl"])
def test_a_tracker_file_outside_its_run_directory_or_over_a_record_is_refused(tmp_path, where):
    run_dir = tmp_path / "run"
    refused = cli("train", *MLP, "train.steps=2", "logger=csv", f"logger.csv.file={where}",
                  f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert "logger.csv.file=" in one_line_refusal(refused, "train")
    assert not run_dir.exists()


def test_a_multirun_into_the_current_directory_is_refused(tmp_path):
    refused = cli("train", "-m", *MLP, "train.steps=1", "train.seed=1,2", "hydra.sweep.dir=", cwd=tmp_path)
    assert "hydra.sweep.dir='' is not allowed" in one_line_refusal(refused, "train")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,named", [
    (["advise.budget=soon"], "advise.budget='soon' is not allowed: expected a duration such as 90s, 10min"),
    (["advise.budget=0s"], "advise.budget='0s' is not allowed"),
    (["advise.goal=fast"], "advise.goal='fast' is not allowed: expected one of speed, memory, accuracy"),
    (["advise.name=my-config"], "advise.name='my-config' is not allowed: expected a config name"),
    (["advise.layer_loss_limit=2"], "advise.layer_loss_limit=2.0 is not allowed: expected a share of values from 0"),
    (["advise.compile=maybe"], "advise.compile"),
    (["precision=bf16"], "'precision=bf16': ampctl advise chooses the precision mode"),
    (["resume=auto"], "'resume=auto': ampctl advise starts runs of its own"),
    (["distributed=ddp"], "distributed=ddp: ampctl advise runs on one device"),
])
def test_advise_refuses_bad_values_in_one_line_and_leaves_nothing(tmp_path, args, named):
    refused = cli("advise", *MLP, *args, f"hydra.run.dir={tmp_path / 'advice'}", cwd=tmp_path)
    assert named in one_line_refusal(refused, "advise")
    assert not (tmp_path / "advice").exists()


def test_a_run_directory_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "afile").write_text("mine")
    for command in ("train", "inspect"):
        refused = cli(command, *MLP, "hydra.run.dir=afile", cwd=tmp_path)
        assert "hydra.run.dir=afile is a file" in one_line_refusal(refused, command)
    assert (tmp_path / "afile").read_text() == "mine"


def wait_for(condition, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


# --- 5. signals outside the training loop ---------------------------------------------------------------------


def popen(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ampctl", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})


def rows(path: Path) -> int:
    return path.read_text().count("\n") if path.is_file() else 0


@pytest.mark.parametrize("when", ["starting", "training"])
@pytest.mark.parametrize("gap_s", [0.0, 0.05])
def test_two_ctrl_c_in_quick_succession_exit_130_with_their_lines_and_no_traceback(tmp_path, when, gap_s):
    """A second Ctrl-C while the first is handled (it printed a traceback now and then, or killed the process
    without a word in the interpreter's teardown): each signal says its line, and the exit code is 130."""
    run_dir = tmp_path / "run"
    process = popen("train", *QUICK, "train.steps=100000", "train.checkpoint_every=5", f"hydra.run.dir={run_dir}",
                    cwd=tmp_path)
    if when == "starting":
        time.sleep(1.0)
    else:
        wait_for(lambda: rows(run_dir / "metrics.jsonl") >= 8)
    process.send_signal(signal.SIGINT)
    time.sleep(gap_s)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    said = stderr.strip().splitlines()[-1]
    assert said.startswith(("ampctl: interrupted (SIGINT)", "ampctl train: interrupted", "continue with: ",
                            "ampctl: SIGINT again: exiting at once")), stderr


def test_preempt_signal_null_ignores_sigusr1_and_sigterm_still_stops_with_a_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    process = popen("train", *QUICK, "train.steps=100000", "train.preempt_signal=null", f"hydra.run.dir={run_dir}",
                    cwd=tmp_path)
    wait_for(lambda: rows(run_dir / "metrics.jsonl") >= 2)
    process.send_signal(signal.SIGUSR1)
    seen = rows(run_dir / "metrics.jsonl")
    wait_for(lambda: rows(run_dir / "metrics.jsonl") > seen + 20)  # it trains on
    assert process.poll() is None
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 143 and "interrupted at step" in err and "Traceback" not in err, err
    assert list((run_dir / "checkpoints").glob("step_*.pt"))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP])
def test_a_signal_before_the_first_step_is_one_line_and_leaves_no_run_dir(tmp_path, signum):
    run_dir = tmp_path / "run"
    process = popen("train", *QUICK, f"hydra.run.dir={run_dir}", "recipe._target_=tests.broken_recipes.BrokenRecipe",
                    "+recipe.mistake=slow_build", cwd=tmp_path)
    wait_for(lambda: (run_dir / ".hydra" / "config.yaml").exists())
    process.send_signal(signum)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signum
    # the train command's line, or the router's when the signal came before train's task function took over
    assert err.strip() in (f"ampctl train: interrupted ({signal.Signals(signum).name}) before the first step; "
                           "nothing recorded",
                           f"ampctl: interrupted ({signal.Signals(signum).name}) before anything was recorded"), err
    assert not run_dir.exists()


def test_sigusr1_to_compare_stops_its_mode_with_a_checkpoint_and_writes_the_comparison(tmp_path):
    out = tmp_path / "cmp"
    process = popen("compare", *MLP, "train.steps=100000", "compare.precisions=[fp32,bf16]", "compare.rounds=1",
                    f"hydra.run.dir={out}", cwd=tmp_path)
    wait_for(lambda: rows(out / "fp32" / "metrics.jsonl") >= 2)
    process.send_signal(signal.SIGUSR1)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 138 and "ampctl compare: interrupted (SIGUSR1)" in err, err
    comparison = json.loads((out / "comparison.json").read_text())
    assert [r["precision"] for r in comparison["rows"]][:1] == ["fp32"]
    assert list((out / "fp32" / "checkpoints").glob("step_*.pt"))


def test_a_comparison_killed_with_sigkill_takes_its_running_mode_with_it(tmp_path):
    out = tmp_path / "cmp"
    process = popen("compare", *MLP, "train.steps=100000", "compare.precisions=[fp32]", "compare.rounds=1",
                    f"hydra.run.dir={out}", cwd=tmp_path)
    wait_for(lambda: rows(out / "fp32" / "metrics.jsonl") >= 2)
    process.kill()
    process.wait()
    # the mode's process got SIGTERM from the kernel: it stops after its step, with a checkpoint, and exits
    wait_for(lambda: "interrupted at step" in (out / "fp32.log").read_text(), timeout=120)
    wait_for(lambda: not (out / "fp32" / ".ampctl.lock").exists(), timeout=60)
    assert list((out / "fp32" / "checkpoints").glob("step_*.pt"))


# --- 6. a sweep resumes -----------------------------------------------------------------------------------------


def test_a_killed_sweep_resumes_keeping_finished_jobs_and_continuing_the_killed_one(tmp_path):
    sweep = ["train", "-m", *QUICK, "train.steps=400", "train.checkpoint_every=50", "train.seed=1,2,3",
             f"hydra.sweep.dir={tmp_path / 'sw'}"]
    process = popen(*sweep, cwd=tmp_path)
    second = lambda: next((tmp_path / "sw").glob("1_*/metrics.jsonl"), None)  # noqa: E731
    wait_for(lambda: second() is not None and rows(second()) >= 120)
    process.kill()
    process.communicate()
    jobs_before = sorted(p.name for p in (tmp_path / "sw").iterdir() if p.is_dir())
    [first] = (tmp_path / "sw").glob("0_*")
    first_before = snapshot(first)
    # without resume=auto, a sweep into it is refused: it holds a sweep
    refused = cli(*sweep, cwd=tmp_path)
    assert "already holds a sweep" in one_line_refusal(refused, "train")
    resumed = cli(*sweep, "resume=auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"job in {first} finished earlier (400 steps): kept as it is" in resumed.stdout
    assert sorted(p.name for p in (tmp_path / "sw").iterdir() if p.is_dir()) == jobs_before + \
        [name for name in sorted(p.name for p in (tmp_path / "sw").iterdir() if p.is_dir()) if name.startswith("2_")
         and name not in jobs_before]
    assert snapshot(first) == first_before  # a finished job is not touched
    for job in sorted((tmp_path / "sw").glob("[0-2]_*")):
        assert steps(job / "metrics.jsonl") == list(range(1, 401)), job.name
        assert "resume=auto" not in job.name
    assert "resumed from" in resumed.stdout and "step_00000" in resumed.stdout


# --- 7. problems named, nothing recorded twice ------------------------------------------------------------------


def test_a_resumed_run_logs_no_step_twice_to_mlflow(tmp_path, restore_argv):
    """A run killed after logging steps past its checkpoint (its newest checkpoint removed, as a kill before it
    was written leaves the directory), then resumed: MLflow's append-only history holds each step once."""
    pytest.importorskip("mlflow")
    from tests.tracker_readers import mlflow_run

    run, uri = tmp_path / "run", f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = [*MLP, "train.checkpoint_every=4", "logger=mlflow", f"logger.mlflow.tracking_uri={uri}",
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
    main(["train", *MLP, "train.steps=12", "train.checkpoint_every=6", f"hydra.run.dir={run_dir}"])
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
              "recipe._target_=tests.broken_recipes.BrokenRecipe", "+recipe.mistake=nan_loss",
              f"hydra.run.dir={tmp_path / 'nan'}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "the loss itself was not finite at every step, before any loss scaling" in err
    assert json.loads((tmp_path / "nan" / "summary.json").read_text())["skipped_total"] == 3


# --- 8. no tracebacks ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("args,named", [
    (["recipe.hidden=2.5"], "recipe.hidden=2.5 is not allowed: expected an integer"),
    (["recipe.hidden=abc"], "recipe.hidden='abc' is not allowed: expected an integer"),
    (["recipe.batch_size=1e11"], "recipe.batch_size=100000000000.0 is not allowed: expected an integer"),
    (["recipe.norm=batchnorm", "recipe.batch_size=1"], "recipe.batch_size=1 is not allowed"),
    (["+optimizer.foo=1"], "optimizer.foo: torch.optim.AdamW takes no argument 'foo'; it takes lr, betas"),
    (["optimizer._target_=os.getcwd"], "takes no arguments: it must name a torch.optim.Optimizer"),
    (["optimizer.fused=maybe"], "optimizer.fused='maybe' is not allowed: expected true, false or null"),
    (["telemetry.profile_cpu_memory=2"], "telemetry.profile_cpu_memory=2 is not allowed: expected true or false"),
    (["train.steps=${oops}"], "Interpolation key 'oops' not found"),
    (["+experiment=x"], "To choose experiment=x from a config group of your own, put it in DIR/experiment/x.yaml"),
    (["hydra.run.dir=/proc/ampctl-test/run"], "cannot write /proc/ampctl-test"),
    # precision per layer and the microscaling formats (issue 26)
    (["precision=mxfp4", "precision.mx.elements=e5m2"], "precision.mx.elements='e5m2' is not allowed: expected e4m3"),
    (["precision=nvfp4", "precision.mx.scale_mode=rceil"], "precision.mx.scale_mode='rceil' is not allowed"),
    (["precision=mxfp8", "precision.mx.scale_mode=round"], "precision.mx.scale_mode"),
    (["precision=bf16", "precision.mx.scale_mode=rceil"],
     "precision.mx.* are the options of precision=mxfp4, mxfp8 or nvfp4 only"),
    (["precision.converter=nope"], "precision.converter=nope: no such converter"),
    (["precision.rules=[{match:'9',run_in:fp32}"], "no viable alternative at input"),
    (["precision.rules=[{match:'9',run_in:fp32,extra:1}]"], "precision.rules[].extra: no such key; allowed: run_in, "
                                                            "match, type"),
    (["precision.rules=[{match:'9'}]"], "precision.rules[0].run_in: required, and not given"),
    (["precision.rules={match:'9'}"], "precision.rules: expected a list"),
    (["precision=O2", "precision.keep_norm_fp32=false"], "precision.keep_norm_fp32: replaced by the per-layer rule"),
    # sizes torch cannot build or train (issue 35)
    (["recipe.in_features=9223372036854775807"], "its model cannot be built, its tensors are too large to allocate "
     "(Storage size calculation overflowed with sizes=[32, 9223372036854775807]); its largest size option: "
     "recipe.in_features=9223372036854775807"),
])
def test_bad_values_are_one_line_exit_2_and_leave_nothing(tmp_path, args, named):
    refused = cli("train", *MLP, "train.steps=1", f"hydra.run.dir={tmp_path / 'run'}", *args, cwd=tmp_path)
    assert named in one_line_refusal(refused, "train")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command,named", [
    (["train", "recipe=resnet", "recipe.data=synthetic", "recipe.image_size=1", "recipe.batch_size=1"],
     "recipe.image_size=1 with recipe.batch_size=1: ResNet's last stage would hold one value per channel"),
    (["train", "recipe=timm", "recipe.model=resnet18", "recipe.image_size=32", "recipe.batch_size=1"],
     "a BatchNorm layer got one value per channel (Expected more than 1 value per channel when training"),
    (["inspect", "recipe=timm", "recipe.model=resnet18", "recipe.image_size=32", "recipe.batch_size=1"],
     "a BatchNorm layer got one value per channel"),
])
def test_a_batch_norm_given_one_value_per_channel_is_one_line(tmp_path, command, named):
    refused = cli(*command, "device=cpu", "train.steps=1", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert named in one_line_refusal(refused, command[0])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("damage,named", [
    (lambda run: (shutil.rmtree(run / "checkpoints"), (run / "checkpoints").write_text("x")),
     "checkpoints is a file, where an ampctl run keeps a directory: the run directory is damaged"),
    (lambda run: (run / ".ampctl.lock").mkdir(), ".ampctl.lock is a directory, where an ampctl run keeps a file"),
])
def test_a_run_directory_whose_own_names_are_the_wrong_kind_is_refused_and_left_as_it_is(tmp_path, damage, named):
    """checkpoints/ replaced by a file (it failed in mkdir after setting the rows aside), the lock a directory."""
    run = tmp_path / "run"
    assert cli("train", *MLP, "train.steps=4", "train.checkpoint_every=2", f"hydra.run.dir={run}",
               cwd=tmp_path).returncode == 0
    damage(run)
    before = snapshot(run)
    refused = cli("train", *MLP, "train.steps=6", "resume=auto", f"hydra.run.dir={run}", cwd=tmp_path)
    assert named in one_line_refusal(refused, "train")
    assert snapshot(run) == before and (run / ".ampctl.lock").is_dir() == ("lock" in named)


def test_report_on_a_directory_it_cannot_write_shows_the_report_and_says_so(tmp_path):
    """A finished run in a directory that refuses writes (made immutable: root ignores permission bits): the table
    on the screen, one line naming the file it could not write, exit 74, no traceback."""
    run = tmp_path / "run"
    assert cli("train", *MLP, "train.steps=2", f"hydra.run.dir={run}", cwd=tmp_path).returncode == 0
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(run)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not available here")
    else:
        run.chmod(0o555)
    try:
        shown = cli("report", str(run), cwd=tmp_path)
        (run / "train.log").unlink() if os.geteuid() != 0 else None
        resumed = cli("train", *MLP, "train.steps=4", "resume=auto", f"hydra.run.dir={run}", cwd=tmp_path)
    finally:
        subprocess.run(["chattr", "-i", str(run)], capture_output=True) if os.geteuid() == 0 else run.chmod(0o755)
    assert shown.returncode == 74 and "Traceback" not in shown.stderr, shown.stderr
    assert shown.stderr.startswith("ampctl report: error: cannot write ") and shown.stderr.count("\n") == 1
    assert "final_loss" in shown.stdout and not (run / "run.csv").exists()
    # a resume into it: one line naming what could not be written (it said Hydra's "Unable to configure handler")
    assert resumed.returncode == 74 and resumed.stderr.startswith("ampctl train: error: cannot write "), resumed.stderr
    assert resumed.stderr.count("\n") == 1


@pytest.mark.parametrize("command", [
    ["train", "recipe=timm", "train.steps=1"], ["train", "recipe=resnet", "train.steps=1"],
    ["train", "recipe=hf_causal_lm", "recipe.model_type=llama", "train.steps=1"],  # transformers imports it lazily
    ["inspect", "recipe=hf_causal_lm", "recipe.model_type=qwen2", "+recipe.config.num_hidden_layers=2",
     "inspect.steps=1"],  # the README's line: deep in a model class, wrapped in transformers' own error
])
def test_a_torchvision_for_another_torch_is_the_same_one_line_on_every_path(tmp_path, command):
    """As after `pip install '.[models]'` beside a CPU-only torch from PyTorch's index: torchvision's compiled
    operators are missing, which surfaces wherever a library first imports it. Simulated by a torchvision that fails
    the same way, first on the path. The fix it names replaces the installed torchvision even where its version
    number is the right one (another build): --force-reinstall, and --no-deps to leave torch as it is."""
    (tmp_path / "broken" / "torchvision").mkdir(parents=True)
    (tmp_path / "broken" / "torchvision" / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n')
    refused = subprocess.run([sys.executable, "-m", "ampctl", *command, f"hydra.run.dir={tmp_path / 'run'}"],
                             capture_output=True, text=True, cwd=tmp_path, timeout=300,
                             env={**os.environ, "PYTHONPATH": f"{tmp_path / 'broken'}:{REPO}"})
    line = one_line_refusal(refused, command[0])
    recipe = command[1]
    assert f"{recipe}: torchvision " in line and " does not match torch " in line, line
    assert "pip install --force-reinstall --no-deps 'torchvision==0." in line and not (tmp_path / "run").exists()


def test_a_config_that_is_not_ampctls_is_refused_before_it_touches_a_run(tmp_path):
    """A --cfg job dump from before it wrote its defaults list (or any primary config without `- train`) would
    run without ampctl's callbacks: it overwrote an earlier run's metrics.jsonl. Refused in one line."""
    first = ampctl.train([*MLP, "train.steps=3"], run_dir=tmp_path / "run")
    before = snapshot(first.run_dir)
    dump = cli("train", *MLP, "train.steps=2", "--cfg", "job", cwd=tmp_path)
    assert dump.returncode == 0, dump.stderr
    (tmp_path / "old.yaml").write_text(dump.stdout.split("  - _self_\n", 1)[1])  # the values, no defaults list
    refused = cli("train", "-cd", str(tmp_path), "-cn", "old", f"hydra.run.dir={first.run_dir}", cwd=tmp_path)
    assert "-cn old: the config does not start from ampctl's train config" in one_line_refusal(refused, "train")
    assert snapshot(first.run_dir) == before


def test_a_config_that_includes_itself_is_one_line(tmp_path):
    (tmp_path / "self.yaml").write_text("defaults:\n  - self\n")
    refused = cli("train", "-cd", str(tmp_path), "-cn", "self", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert "defaults include themselves" in one_line_refusal(refused, "train")


def test_init_next_to_a_file_in_its_way_writes_nothing(tmp_path, capsys, restore_argv):
    (tmp_path / "recipe").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        main(["init", "x", "--dir", str(tmp_path)])
    assert exit_info.value.code == 2 and "(nothing was written)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe"]


# --- what the most trusted peers guarantee: hang detection, SLURM requeue ------------------------------------


def test_a_stalled_step_is_named_with_every_threads_stack_and_the_run_goes_on(tmp_path, capsys, restore_argv):
    run_dir = tmp_path / "run"
    main(["train", *MLP, "train.steps=14", "recipe._target_=tests.slow_data_recipe.StallingRecipe",
          "+recipe.stall_at=10", "+recipe.stall_s=2.5", "train.hang_after_s=0.6", f"hydra.run.dir={run_dir}"])
    out = capsys.readouterr().out
    assert "warning: step 10 has not finished after" in out and "a hang?" in out, out
    stacks = (run_dir / "hang-step-10.txt").read_text()
    assert "slow_data_recipe.py" in stacks and "in batches" in stacks  # where it waits
    assert steps(run_dir / "metrics.jsonl") == list(range(1, 15))  # the run went on to its end
    assert [p.name for p in run_dir.glob("hang-step-*.txt")] == ["hang-step-10.txt"]  # one report, one stall


def test_the_preemption_signal_in_a_slurm_job_requeues_it_after_the_checkpoint(tmp_path):
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol.calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    (bin_dir / "scontrol").chmod(0o755)
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}
    process = subprocess.Popen([sys.executable, "-m", "ampctl", "train", *QUICK, "train.steps=100000",
                                f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    wait_for(lambda: rows(run_dir / "metrics.jsonl") >= 2)
    process.send_signal(signal.SIGUSR1)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 138, err
    assert calls.read_text() == "requeue 4242\n"
    assert "requeued SLURM job 4242: it continues this run with resume=auto" in err
    # SIGTERM (a cancel, not the preemption warning) does not requeue
    resumed = subprocess.Popen([sys.executable, "-m", "ampctl", "train", *QUICK, "train.steps=100000", "resume=auto",
                                f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    done_rows = rows(run_dir / "metrics.jsonl")
    wait_for(lambda: rows(run_dir / "metrics.jsonl") >= done_rows + 2)
    resumed.send_signal(signal.SIGTERM)
    resumed.communicate(timeout=120)
    assert resumed.returncode == 143 and calls.read_text() == "requeue 4242\n"


def test_a_comparison_with_an_optimizer_argument_no_mode_can_take_is_refused_before_any_mode_runs(tmp_path):
    out = tmp_path / "cmp"
    result = cli("compare", *MLP, "train.steps=2", "+optimizer.foo=1", "compare.precisions=[fp32]",
                 "compare.rounds=1", "compare.warmup_steps=0", f"hydra.run.dir={out}", cwd=tmp_path)
    assert "torch.optim.AdamW takes no argument 'foo'" in one_line_refusal(result, "compare")
    assert not out.exists()


def test_a_mode_refused_in_its_own_process_before_its_first_step_records_why(tmp_path):
    """A mistake only the mode's process meets (here: the recipe's model cannot be built) leaves the mode's
    error.txt, though the refused run removed its directory."""
    out = tmp_path / "cmp"
    result = cli("compare", *MLP, "train.steps=2", "recipe._target_=tests.broken_recipes.BrokenRecipe",
                 "+recipe.mistake=not_a_module", "compare.precisions=[fp32]", "compare.rounds=1",
                 "compare.warmup_steps=0", f"hydra.run.dir={out}", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr + result.stdout, result.stderr[-2000:]
    assert (out / "fp32" / "error.txt").read_text().strip()
    assert json.loads((out / "comparison.json").read_text())["rows"][0]["status"] == "failed"


def test_an_image_the_loader_cannot_read_is_one_line_naming_it(tmp_path):
    pytest.importorskip("timm")
    from PIL import Image

    for label, good in (("cat", 2), ("dog", 0)):
        (tmp_path / "images" / label).mkdir(parents=True)
        for i in range(good):
            Image.new("RGB", (40, 48), (i * 60, 0, 0)).save(tmp_path / "images" / label / f"{i}.png")
    (tmp_path / "images" / "dog" / "bad.png").write_bytes(b"not an image")
    refused = cli("train", "device=cpu", "recipe=timm", "recipe.model=test_resnet", "recipe.image_size=32",
                  "recipe.num_classes=null", "recipe.data=imagefolder", f"recipe.data_root={tmp_path / 'images'}",
                  "recipe.batch_size=3", "recipe.num_workers=1", "train.steps=2", "train.console=quiet",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert "the data loader cannot read an image: " in one_line_refusal(refused, "train")
    assert "bad.png" in refused.stderr


def test_a_vocabulary_smaller_than_the_corpus_is_refused(tmp_path):
    pytest.importorskip("transformers")
    refused = cli("train", "device=cpu", "recipe=hf_causal_lm", "+recipe.config.vocab_size=10", "train.steps=1",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    line = one_line_refusal(refused, "train")
    assert "recipe.config.vocab_size=10 is not allowed: expected an integer >= 256" in line
    assert not (tmp_path / "run").exists()


def test_a_corpus_cut_too_short_by_max_corpus_bytes_names_that_key(tmp_path):
    refused = cli("train", "device=cpu", "recipe=gpt", "recipe.max_corpus_bytes=10", "train.steps=1",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert "recipe.max_corpus_bytes=10 keeps 10 bytes of the standard library; at least 1290 are needed" in \
        one_line_refusal(refused, "train")


def test_wandb_online_without_a_login_is_refused_before_the_run(tmp_path):
    pytest.importorskip("wandb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update({"PYTHONPATH": str(REPO), "HOME": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
                "NETRC": str(tmp_path / "no-netrc")})
    refused = subprocess.run([sys.executable, "-m", "ampctl", "train", *MLP, "train.steps=1", "logger=wandb",
                              f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=tmp_path,
                             env=env, timeout=300)
    assert "logger=wandb: online mode needs a W&B login" in one_line_refusal(refused, "train")
    assert not (tmp_path / "run").exists()
