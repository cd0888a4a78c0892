"""Every command and the Python API own their output directories: a run into another's directory, the current directory,
a file where a directory goes, another command's results: refused, nothing touched. (The adversarial suite: real
processes where a kill or a signal is the point.)"""

from __future__ import annotations

import pytest

import ampctl
from ampctl.errors import UsageError
from tests.support.adversarial import MLP, cli, one_line_refusal
from tests.support.runs import snapshot, steps

# --- ownership cannot be bypassed: resume= (empty), the Python API -----------------------------------------


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


@pytest.mark.parametrize("command,key,url", [
    ("train", "hydra.run.dir", "s3://bucket/run"),
    ("compare", "hydra.run.dir", "gs://bucket/compare"),
    ("train", "hydra.sweep.dir", "memory://sweep"),
])
def test_a_url_for_a_run_directory_is_refused_and_nothing_is_written(tmp_path, monkeypatch, command, key, url):
    """pathlib takes s3://bucket/run for the relative path s3:/bucket/run: without the refusal the run went to
    ./s3:/bucket/run/ and exited 0, the user believing it on object storage."""
    monkeypatch.chdir(tmp_path)  # the API's relative paths land here too, where a regression would show
    sweep = ["-m", "optimizer.lr=0.1,0.2"] if key == "hydra.sweep.dir" else []
    refused = cli(command, *sweep, *MLP, "train.steps=2", f"{key}={url}", cwd=tmp_path)
    assert f"{key}={url} is a URL: expected a local directory" in one_line_refusal(refused, command)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(UsageError, match=f"hydra.run.dir={url} is a URL"):
        ampctl.train([*MLP, "train.steps=1"], run_dir=url)
    assert list(tmp_path.iterdir()) == []


# --- no command writes over another's results ----------------------------------------------------------


@pytest.mark.parametrize("command", ["compare", "inspect", "memory", "advise", "diff"])
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


def test_a_file_system_without_locks_is_one_line_and_nothing_is_written(tmp_path, monkeypatch):
    """Lustre mounted without -o flock answers flock() with ENOLCK: one line naming the run directory and the
    mount option, exit 2, before Hydra writes anything; the CPU probe's cache then measures without its lock."""
    import errno
    import fcntl

    def no_locks(handle, flags):
        raise OSError(errno.ENOLCK, "No locks available")

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".ampctl.lock").write_text("")  # a killed run's lock file: read before the run starts
    monkeypatch.setattr(fcntl, "flock", no_locks)
    refused = cli("train", *MLP, "train.steps=1", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert "its file system refuses file locks (flock: No locks available)" in one_line_refusal(refused, "train")
    assert "-o flock" in refused.stderr and [p.name for p in run_dir.iterdir()] == [".ampctl.lock"]
    (run_dir / ".ampctl.lock").unlink()
    run_dir.rmdir()
    fresh = cli("train", *MLP, "train.steps=1", f"hydra.run.dir={run_dir}", cwd=tmp_path)  # locked once it runs
    assert "its file system refuses file locks" in one_line_refusal(fresh, "train")
    assert not run_dir.exists()  # Hydra's files, written before the lock was taken, removed with it
