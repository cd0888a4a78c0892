"""Runs that survive: kill -9 at random points (also mid checkpoint write), SIGINT, corrupt checkpoints and
config changes on resume. A resumed run must equal the uninterrupted one bit for bit on CPU."""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from ampctl.cli import main
from ampctl.interrupt import FORWARDED_WITHIN_S
from tests.support.runs import ForkedAmpctl, flip_a_bit, rows

REPO = Path(__file__).resolve().parents[2]
# fp16 with overflows and regrowth, so the scaler state (scale and growth tracker) matters for exactness.
RUN = ["device=cpu", "recipe=mlp", "recipe.hidden=256", "recipe.batch_size=64", "precision=fp16",
       "scaler.init_scale=1e9", "scaler.growth_interval=7", "train.steps=60", "train.checkpoint.every=10",
       "train.log_every=5",
       "train.console=plain", "telemetry.profile_cpu_memory=false"]  # the memory timeline is not under test here


def start(run_dir: Path, *extra: str) -> ForkedAmpctl:
    return ForkedAmpctl("train", *RUN, *extra, f"hydra.run.dir={run_dir}", cwd=REPO)


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


@pytest.mark.slow
def test_kill_9_during_a_checkpoint_write_leaves_the_previous_one_whole(tmp_path, restore_argv):
    # a model large enough that writing a checkpoint takes a while, and one every other step
    big = ["recipe.hidden=1536", "recipe.batch_size=16", "train.checkpoint.every=2", "train.steps=40"]
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


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGUSR1])  # Ctrl-C; SLURM's warning before preemption
def test_a_signal_writes_a_checkpoint_and_says_how_to_resume(tmp_path, reference, restore_argv, signum):
    run_dir = tmp_path / "run"
    child = start(run_dir)
    wait_for(lambda: metrics_lines(run_dir) >= 12)
    child.send_signal(signum)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 128 + signum  # 130, 138: what a requeue script tests
    assert "Traceback" not in stderr, stderr
    step = int(re.search(rf"interrupted at step (\d+) by {signum.name}; checkpoint ", stderr).group(1))
    assert len(rows(run_dir)) == step  # every step up to the checkpoint is recorded, none after
    assert torch.load(run_dir / "checkpoints" / f"step_{step:08d}.pt", weights_only=True)["step"] == step
    # The printed command, as printed: the run's config comes from its checkpoint, no override retyped.
    command = shlex.split(stderr.split("continue with: ")[1].splitlines()[0])
    assert command == ["ampctl", "train", f"resume={run_dir}"], stderr
    main([*command[1:], "train.console=quiet", f"hydra.run.dir={tmp_path / 'other'}"])
    assert not (tmp_path / "other").exists()  # it resumed into its own run dir
    assert "resumed from" in (run_dir / "train.log").read_text()  # and logged there, not in Hydra's other dir
    assert_same_run(reference, run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["recipe"], summary["precision_choice"]) == ("mlp", "fp16")  # the run's own choices


def test_resume_from_an_older_checkpoint_starts_a_new_timeline_and_loses_nothing(stopped_run, capsys, restore_argv):
    old_rows, old_newest = rows(stopped_run), (stopped_run / "checkpoints" / "step_00000020.pt").read_bytes()
    main(["train", f"resume={stopped_run / 'checkpoints' / 'step_00000010.pt'}", "train.console=quiet",
          f"hydra.run.dir={stopped_run.parent / 'other'}"])
    out = capsys.readouterr().out
    assert "1 later checkpoint(s) of the abandoned timeline set aside" in out, out
    [aside_dir] = (stopped_run / "checkpoints").glob("timeline.set-aside-*")
    assert (aside_dir / "step_00000020.pt").read_bytes() == old_newest  # kept, byte for byte
    [aside_rows] = stopped_run.glob("metrics.jsonl.set-aside-*")
    assert [r["step"] for r in map(json.loads, aside_rows.read_text().splitlines())] == list(range(11, 21))
    assert list(stopped_run.glob("summary.json.set-aside-*"))
    assert rows(stopped_run) == old_rows  # the new timeline from step 10 is the same run again (CPU: bitwise)
    # resume=auto now continues the new timeline, never jumps back to the set-aside one
    main(["train", "train.steps=25", "train.console=quiet", f"hydra.run.dir={stopped_run}", "resume=auto"])
    assert [r["step"] for r in rows(stopped_run)] == list(range(1, 26))


@pytest.fixture
def stopped_run(tmp_path, restore_argv) -> Path:
    run_dir = tmp_path / "run"
    main(["train", *RUN, "train.steps=20", "train.console=quiet", f"hydra.run.dir={run_dir}"])
    return run_dir


def test_each_checkpoint_has_a_checksum_that_sha256sum_checks(stopped_run):
    checked = subprocess.run(["sha256sum", "-c", "step_00000010.pt.sha256", "step_00000020.pt.sha256"],
                             cwd=stopped_run / "checkpoints", capture_output=True, text=True)
    assert checked.returncode == 0 and checked.stdout.count(": OK") == 2, checked


def test_a_bit_flipped_newest_checkpoint_is_passed_over_for_the_newest_good_one(stopped_run, capsys, restore_argv):
    old_rows, newest = rows(stopped_run), stopped_run / "checkpoints" / "step_00000020.pt"
    flip_a_bit(newest)
    flipped = newest.read_bytes()
    main(["train", *RUN, f"hydra.run.dir={stopped_run}", "resume=auto"])
    out = capsys.readouterr().out
    assert f"warning: checkpoint '{newest}' does not match its checksum (step_00000020.pt.sha256)" in out, out
    assert "resumed from" in out and "step_00000010.pt at step 10" in out
    [aside] = (stopped_run / "checkpoints").glob("timeline.set-aside-*")
    assert (aside / "step_00000020.pt").read_bytes() == flipped  # kept for a post-mortem
    assert [r["step"] for r in rows(stopped_run)] == list(range(1, 61))
    assert rows(stopped_run)[:20] == old_rows  # steps 11..20 again, the same as before the flip


@pytest.mark.parametrize("resume", ["auto", "newest file"])
def test_no_good_checkpoint_is_one_line_and_touches_nothing(stopped_run, capsys, restore_argv, resume):
    """resume=auto with every checkpoint bad, or a bad checkpoint named by its file: refused, nothing touched."""
    for path in (stopped_run / "checkpoints").glob("*.pt"):
        flip_a_bit(path)
    newest = stopped_run / "checkpoints" / "step_00000020.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    before = {p: p.read_bytes() for p in stopped_run.rglob("*") if p.is_file()}
    target = "auto" if resume == "auto" else str(newest)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *RUN, f"hydra.run.dir={stopped_run}", f"resume={target}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"checkpoint '{newest}' does not match its checksum" in err, err
    assert {p: p.read_bytes() for p in stopped_run.rglob("*") if p.is_file()} == before


def test_a_checkpoint_without_its_checksum_is_never_trusted_silently(stopped_run, capsys, restore_argv):
    """No .sha256: refused, saying how to trust it on purpose; trusted that way, a truncated file is still
    refused by loading it. A garbled checksum file is named, one line."""
    newest = stopped_run / "checkpoints" / "step_00000020.pt"
    sidecar = stopped_run / "checkpoints" / "step_00000020.pt.sha256"
    sidecar.unlink()
    newest.write_bytes(newest.read_bytes()[:1000])
    with pytest.raises(SystemExit):
        main(["train", *RUN, f"hydra.run.dir={stopped_run}", f"resume={newest}"])
    assert capsys.readouterr().err == (f"ampctl train: error: checkpoint '{newest}' has no checksum "
                                       "(step_00000020.pt.sha256), so a change on disk cannot be seen; if you trust "
                                       "it, write one: sha256sum step_00000020.pt > step_00000020.pt.sha256\n")
    sidecar.write_text(hashlib.sha256(newest.read_bytes()).hexdigest() + "  step_00000020.pt\n")
    with pytest.raises(SystemExit):
        main(["train", *RUN, f"hydra.run.dir={stopped_run}", f"resume={newest}"])
    assert f"checkpoint '{newest}' cannot be read (truncated or corrupt?)" in capsys.readouterr().err
    sidecar.write_bytes(b"\xff\xfe\x00garbled")
    with pytest.raises(SystemExit):
        main(["train", *RUN, f"hydra.run.dir={stopped_run}", f"resume={newest}"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its checksum file step_00000020.pt.sha256 cannot be read" in err, err


def test_time_based_checkpoints_are_written_on_log_steps(tmp_path, restore_argv):
    """train.checkpoint.every_s: on the first log step that long after the last checkpoint (a tiny interval:
    every log step), beside the step-based ones (train.checkpoint.every=10 of RUN)."""
    run_dir = tmp_path / "run"
    main(["train", *RUN, "train.steps=23", "train.log_every=3", "train.checkpoint.every_s=1e-6",
          "train.checkpoint.keep=100", "train.console=quiet", f"hydra.run.dir={run_dir}"])
    written = sorted(int(p.name[5:13]) for p in (run_dir / "checkpoints").glob("step_*.pt"))
    assert written == [3, 6, 9, 10, 12, 15, 18, 20, 21, 23]


def test_files_a_killed_write_left_are_removed_at_start(stopped_run, capsys, restore_argv):
    leftovers = [stopped_run / "checkpoints" / "step_00000030.pt.tmp", stopped_run / "checkpoints" /
                 "step_00000030.pt.sha256", stopped_run / "metrics.jsonl.tmp"]
    for path in leftovers:
        path.write_bytes(b"half")
    main(["train", *RUN, "train.steps=21", f"hydra.run.dir={stopped_run}", "resume=auto"])
    assert "removed 3 temporary file(s) a killed write left" in capsys.readouterr().out
    assert not any(path.exists() for path in leftovers)


@pytest.mark.parametrize("change,key", [
    ("recipe.hidden=128", "recipe.hidden"),
    ("precision=O2", "precision.name"),
    ("optimizer.lr=0.01", "optimizer.lr"),
])
def test_resume_refuses_a_changed_model_precision_or_optimizer(stopped_run, capsys, restore_argv, change, key):
    before = {p: p.read_bytes() for p in stopped_run.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *RUN, change, f"hydra.run.dir={stopped_run}", "resume=auto"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"resume: {key} was" in err, err
    assert {p: p.read_bytes() for p in stopped_run.rglob("*") if p.is_file()} == before  # .hydra/ included


def test_resume_takes_the_runs_own_config_for_what_the_command_line_does_not_name(stopped_run, capsys, restore_argv):
    """Only the keys a command line names are compared; a named default (recipe=gpt) is a change, refused."""
    main(["train", "train.steps=22", "train.console=quiet", f"hydra.run.dir={stopped_run}", "resume=auto"])
    assert "changed: train.steps: 20 -> 22" in capsys.readouterr().out
    log = (stopped_run / "train.log").read_text()  # the run's lines, both runs, in order
    assert log.index("done: 20 steps") < log.index("resumed from") < log.index("done: 22 steps"), log
    assert "name: fp16" in (stopped_run / ".hydra" / "config.yaml").read_text()  # says what runs now
    assert "steps: 22" in (stopped_run / ".hydra" / "config.yaml").read_text()
    with pytest.raises(SystemExit):
        main(["train", "recipe=gpt", f"hydra.run.dir={stopped_run}", "resume=auto"])
    assert "resume: recipe._target_ was 'ampctl.recipes.mlp.MLPRecipe'" in capsys.readouterr().err


def expected_lr(applied: int, total: int, cfg: dict) -> float:
    """Warm-up then cosine decay to train.lr.min_ratio, written out by hand (engine/optim.py computes it on the
    device)."""
    train, base = cfg["train"], cfg["optimizer"]["lr"]
    warm = min(1.0, (applied + 1) / train["lr"]["warmup_steps"])
    progress = min(1.0, max(0.0, (applied - train["lr"]["warmup_steps"]) / max(1, total - train["lr"]["warmup_steps"])))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return base * warm * (train["lr"]["min_ratio"] + (1 - train["lr"]["min_ratio"]) * cosine)


def test_resume_allows_more_steps_and_says_what_happens_to_the_lr_schedule(tmp_path, capsys, restore_argv):
    """The schedule decays over train.steps: extending a run moves its end, and the lr of the next step jumps
    (stated at resume). Every resumed step's lr is the schedule's over the new total."""
    run_dir, short_warmup = tmp_path / "run", "train.lr.warmup_steps=5"
    main(["train", *RUN, short_warmup, "train.steps=20", "train.console=quiet", f"hydra.run.dir={run_dir}"])
    cfg = torch.load(run_dir / "checkpoints" / "step_00000020.pt", weights_only=True)["config"]
    main(["train", *RUN, short_warmup, "train.steps=40", f"hydra.run.dir={run_dir}", "resume=auto"])
    out = capsys.readouterr().out
    assert "resumed from" in out and "train.steps: 20 -> 40" in out
    records = rows(run_dir)
    assert [r["step"] for r in records] == list(range(1, 41))
    applied = [r["step"] - 1 - (prev["skipped_total"] if prev else 0) for prev, r in zip([None, *records], records)]
    for r, n in zip(records, applied):
        assert r["lr"] == pytest.approx(expected_lr(n, 20 if r["step"] <= 20 else 40, cfg), rel=1e-12), r
    said = f"lr of the next step {expected_lr(applied[20], 20, cfg):.4g} -> {expected_lr(applied[20], 40, cfg):.4g}"
    assert f"lr schedule: cosine decay now ends at step 40 (was 20); {said}" in out, out


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


@pytest.mark.slow
def test_a_second_sigint_exits_at_once_and_corrupts_nothing(tmp_path, restore_argv):
    run_dir = tmp_path / "run"
    child = start(run_dir, "recipe.hidden=1536", "recipe.batch_size=16", "train.checkpoint.every=2", "train.steps=40")
    wait_for(lambda: metrics_lines(run_dir) >= 6)
    child.send_signal(signal.SIGINT)
    time.sleep(FORWARDED_WITHIN_S + 0.1)  # sooner, it is taken for a launcher's copy of the first (test_signals.py)
    child.send_signal(signal.SIGINT)
    child.wait(timeout=60)
    assert child.returncode == 130
    for path in (run_dir / "checkpoints").glob("step_*.pt"):
        assert torch.load(path, weights_only=True)["format_version"] == 1
    main(["train", *RUN, "recipe.hidden=1536", "recipe.batch_size=16", "train.checkpoint.every=2", "train.steps=40",
          "train.console=quiet", f"hydra.run.dir={run_dir}", "resume=auto"])
    assert [r["step"] for r in rows(run_dir)] == list(range(1, 41))


@pytest.mark.parametrize("how", ["command line", "python api"])
def test_a_resume_reads_its_checkpoint_once(tmp_path, restore_argv, monkeypatch, how):
    """The resume target is resolved once, by the check before anything is written, and handed to the run: the
    checkpoint is hashed and loaded once (a 7B model's checkpoint is tens of GB)."""
    import ampctl
    from ampctl.runner.checkpointing import checkpoint

    run = tmp_path / "run"
    first = [*RUN, "train.steps=10", "train.console=quiet"]
    main(["train", *first, f"hydra.run.dir={run}"])
    verified, loaded = [], []
    verify, load = checkpoint.verify, torch.load
    monkeypatch.setattr(checkpoint, "verify", lambda path: (verified.append(Path(path).name), verify(path))[1])
    monkeypatch.setattr(torch, "load", lambda path, *a, **k: (loaded.append(Path(path).name), load(path, *a, **k))[1])
    if how == "command line":
        main(["train", *first, "train.steps=12", f"resume={run}", f"hydra.run.dir={tmp_path / 'next'}"])
    else:
        ampctl.train([*first, "train.steps=12", f"resume={run}"], run_dir=tmp_path / "next")
    assert verified == loaded == ["step_00000010.pt"]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == list(range(1, 13))
