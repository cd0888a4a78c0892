"""A checkpoint continues only its own run; a resume restores the run's own config, checkpoint or not; a killed sweep
resumes keeping what finished. (The adversarial suite: real processes where a kill or a signal is the point.)"""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest

from ampctl.cli import main
from tests.support.adversarial import MLP, cli, one_line_refusal, popen, row_count, wait_for
from tests.support.runs import QUICK, snapshot, start_a_long_run, steps

# --- a checkpoint continues only its own run ---------------------------------------------------------------


def test_a_checkpoint_copied_from_another_run_is_passed_over_by_resume_auto(tmp_path, capsys, restore_argv):
    main(["train", *MLP, "train.steps=8", "train.checkpoint.every=4", f"hydra.run.dir={tmp_path / 'A'}"])
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
    main(["train", *MLP, "train.steps=8", "train.checkpoint.every=4", f"hydra.run.dir={run_dir}"])
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


def test_a_finished_run_resumed_again_says_so_and_touches_nothing(tmp_path, capsys, restore_argv):
    """resume=auto into a run that finished at train.steps: one line naming its step, exit 0, every file as it was
    (its summary was set aside on every try, and its .hydra/ files rewritten); ampctl.train returns its summary."""
    import ampctl

    run = tmp_path / "run"
    main(["train", *MLP, "train.steps=6", f"hydra.run.dir={run}"])
    before = snapshot(run)
    capsys.readouterr()
    main(["train", *MLP, "train.steps=6", f"hydra.run.dir={run}", "resume=auto"])  # returns: exit 0
    assert capsys.readouterr().out == (f"ampctl train: {run} finished at step 6 ({run / 'summary.json'}): nothing to "
                                       "do, nothing changed; to train it longer: resume=auto train.steps=N with N > "
                                       "6\n")
    again = ampctl.train([*MLP, "train.steps=6", "resume=auto"], run_dir=run)
    assert again.run_dir == run and again.summary == json.loads((run / "summary.json").read_text())
    assert snapshot(run) == before


def test_a_resume_refused_inside_its_run_leaves_the_earlier_runs_files_as_they_were(tmp_path, capsys, restore_argv):
    """Hydra writes the command's .hydra/ files into the run directory before the run refuses (here: held-out
    batches the recipe does not give, found as the run builds its evaluation): the earlier run's are put back."""
    run = tmp_path / "run"
    main(["train", "device=cpu", "recipe=exploding", "precision=bf16", "train.steps=4", "train.console=quiet",
          f"hydra.run.dir={run}"])
    before = snapshot(run)
    err = one_line_refusal(cli("train", "device=cpu", "recipe=exploding", "precision=bf16", "train.steps=8",
                               "train.eval.every=4", f"hydra.run.dir={run}", "resume=auto", cwd=tmp_path), "train")
    assert "gives no held-out batches" in err
    assert snapshot(run) == before


def test_a_run_without_its_identity_is_refused_whatever_else_it_holds(tmp_path):
    """identity.json is written before a run's first record: a directory with records and no identity lost it, and
    a resume there could not tell the run's own checkpoints and config from another's. (a) killed before its first
    checkpoint: resume=auto trained the default GPT among the mlp's rows; (b) another run's checkpoint copied in:
    it resumed from it; (c) its own checkpoints: it resumed under a newly minted run id. Each is refused in one
    line and leaves the directory as it was."""
    killed = start_a_long_run(tmp_path / "a", rows=2)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    main_run = cli("train", *MLP, "train.steps=6", "train.checkpoint.every=3", "hydra.run.dir=A", cwd=tmp_path)
    other = cli("train", *MLP, "train.steps=2", "train.seed=4", "train.checkpoint.every=100", "hydra.run.dir=B",
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
    main(["train", *MLP, "train.steps=4", "train.checkpoint.every=4", f"hydra.run.dir={run_dir}"])
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


# --- resume=auto restores the run's own config, checkpoint or not ---------------------------------------


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


# --- a sweep resumes -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_killed_sweep_resumes_keeping_finished_jobs_and_continuing_the_killed_one(tmp_path):
    sweep = ["train", "-m", *QUICK, "train.steps=400", "train.checkpoint.every=50", "train.seed=1,2,3",
             f"hydra.sweep.dir={tmp_path / 'sw'}"]
    process = popen(*sweep, cwd=tmp_path)
    second = lambda: next((tmp_path / "sw").glob("1_*/metrics.jsonl"), None)  # noqa: E731
    wait_for(lambda: second() is not None and row_count(second()) >= 120)
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
