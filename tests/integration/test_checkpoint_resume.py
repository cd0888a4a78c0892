"""Runs that survive: kill -9 at random points (also mid checkpoint write), SIGINT, corrupt checkpoints and
config changes on resume. A resumed run must equal the uninterrupted one bit for bit on CPU."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ampctl.cli import main

REPO = Path(__file__).resolve().parents[2]
# fp16 with overflows and regrowth, so the scaler state (scale and growth tracker) matters for exactness.
RUN = ["device=cpu", "recipe=mlp", "recipe.hidden=256", "recipe.batch_size=64", "precision=fp16", "scaler.init_scale=1e9",
       "scaler.growth_interval=7", "train.steps=60", "train.checkpoint_every=10", "train.log_every=5",
       "train.console=plain"]
COMPARED = ("step", "loss", "loss_scale", "skipped", "skipped_total", "grad_norm", "lr")


def start(run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ampctl", "train", *RUN, *extra, f"hydra.run.dir={run_dir}"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def rows(run_dir: Path) -> list[dict]:
    return [{k: r[k] for k in COMPARED} for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def final_weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "step_00000060.pt", weights_only=True)["model"]


def assert_same_run(a: Path, b: Path) -> None:
    assert rows(a) == rows(b)
    wa, wb = final_weights(a), final_weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    assert start(run_dir).wait(timeout=300) == 0
    return run_dir


def wait_for(predicate, timeout: float = 120.0, poll: float = 0.002) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(poll)


def metrics_lines(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_kill_9_at_random_points_then_resume_is_bitwise_identical(tmp_path, reference, restore_argv):
    rng = random.Random(1234)
    run_dir = tmp_path / "run"
    kills = 0
    while kills < 3:
        child = start(run_dir, "resume=auto")
        target = metrics_lines(run_dir) + rng.randint(3, 20)
        wait_for(lambda: metrics_lines(run_dir) >= min(target, 60) or child.poll() is not None)
        time.sleep(rng.uniform(0, 0.05))
        if child.poll() is not None:
            break
        child.send_signal(signal.SIGKILL)
        child.wait()
        kills += 1
    assert kills >= 1
    main(["train", *RUN, "train.console=quiet", f"hydra.run.dir={run_dir}", "resume=auto"])
    assert_same_run(reference, run_dir)


def test_kill_9_during_a_checkpoint_write_leaves_the_previous_one_whole(tmp_path, restore_argv):
    # a model large enough that writing a checkpoint takes a while, and one every other step
    big = ["recipe.hidden=1536", "recipe.batch_size=16", "train.checkpoint_every=2", "train.steps=40"]
    for attempt in range(5):  # the write can finish between seeing its .tmp file and the kill: try again
        run_dir = tmp_path / f"run{attempt}"
        child = start(run_dir, *big)
        checkpoints = run_dir / "checkpoints"
        wait_for(lambda: checkpoints.is_dir() and any(p.suffix == ".tmp" for p in checkpoints.iterdir())
                 and len(list(checkpoints.glob("*.pt"))) >= 1, poll=0.0005)
        child.send_signal(signal.SIGKILL)
        child.wait()
        if any(p.suffix == ".tmp" for p in checkpoints.iterdir()):
            break
    assert any(p.suffix == ".tmp" for p in checkpoints.iterdir()), "five kills all missed the write"
    for path in checkpoints.glob("step_*.pt"):
        assert torch.load(path, weights_only=True)["format_version"] == 1
    main(["train", *RUN, *big, "train.console=quiet", f"hydra.run.dir={run_dir}", "resume=auto"])
    assert not list(checkpoints.glob("*.tmp"))
    assert [r["step"] for r in rows(run_dir)] == list(range(1, 41))


def test_sigint_writes_a_checkpoint_and_says_how_to_resume(tmp_path, reference, restore_argv):
    run_dir = tmp_path / "run"
    child = start(run_dir)
    wait_for(lambda: metrics_lines(run_dir) >= 12)
    child.send_signal(signal.SIGINT)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 130
    assert "Traceback" not in stderr and f"resume={run_dir}" in stderr, stderr
    step = int(stderr.split("interrupted at step ")[1].split(";")[0])
    assert len(rows(run_dir)) == step  # every step up to the checkpoint is recorded, none after
    assert torch.load(run_dir / "checkpoints" / f"step_{step:08d}.pt", weights_only=True)["step"] == step
    main(["train", *RUN, "train.console=quiet", f"hydra.run.dir={tmp_path / 'other'}", f"resume={run_dir}"])
    assert not (tmp_path / "other").exists()  # it resumed into its own run dir
    assert_same_run(reference, run_dir)


@pytest.fixture
def stopped_run(tmp_path, restore_argv) -> Path:
    run_dir = tmp_path / "run"
    main(["train", *RUN, "train.steps=20", "train.console=quiet", f"hydra.run.dir={run_dir}"])
    return run_dir


def test_a_corrupt_checkpoint_is_one_line_and_touches_nothing(stopped_run, capsys, restore_argv):
    newest = stopped_run / "checkpoints" / "step_00000020.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    before = (stopped_run / "metrics.jsonl").read_bytes()
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *RUN, f"hydra.run.dir={stopped_run}", "resume=auto"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"checkpoint '{newest}' cannot be read" in err
    assert (stopped_run / "metrics.jsonl").read_bytes() == before


@pytest.mark.parametrize("change,key", [
    ("recipe.hidden=128", "recipe.hidden"),
    ("precision=O2", "precision.name"),
    ("optimizer.lr=0.01", "optimizer.lr"),
])
def test_resume_refuses_a_changed_model_precision_or_optimizer(stopped_run, capsys, restore_argv, change, key):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *RUN, change, f"hydra.run.dir={stopped_run}", "resume=auto"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"resume: {key} was" in err, err


def test_resume_allows_more_steps_and_says_so(stopped_run, capsys, restore_argv):
    main(["train", *RUN, "train.steps=30", f"hydra.run.dir={stopped_run}", "resume=auto"])
    out = capsys.readouterr().out
    assert "resumed from" in out and "train.steps: 20 -> 30" in out
    assert [r["step"] for r in rows(stopped_run)] == list(range(1, 31))


@pytest.mark.parametrize("target,message", [
    ("/no/such/run", "does not exist"),
    ("{tmp}", "holds no checkpoint"),
])
def test_bad_resume_targets(tmp_path, capsys, restore_argv, target, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *RUN, f"hydra.run.dir={tmp_path / 'new'}", f"resume={target.format(tmp=tmp_path)}"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_a_second_sigint_exits_at_once_and_corrupts_nothing(tmp_path, restore_argv):
    run_dir = tmp_path / "run"
    child = start(run_dir, "recipe.hidden=1536", "recipe.batch_size=16", "train.checkpoint_every=2", "train.steps=40")
    wait_for(lambda: metrics_lines(run_dir) >= 6)
    child.send_signal(signal.SIGINT)
    child.send_signal(signal.SIGINT)
    child.wait(timeout=60)
    assert child.returncode == 130
    for path in (run_dir / "checkpoints").glob("step_*.pt"):
        assert torch.load(path, weights_only=True)["format_version"] == 1
    main(["train", *RUN, "recipe.hidden=1536", "recipe.batch_size=16", "train.checkpoint_every=2", "train.steps=40",
          "train.console=quiet", f"hydra.run.dir={run_dir}", "resume=auto"])
    assert [r["step"] for r in rows(run_dir)] == list(range(1, 41))
