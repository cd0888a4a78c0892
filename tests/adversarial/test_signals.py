"""Signals outside the training loop and into studies: one line, the right exit code, nothing half-written; a stalled
step named; SLURM's requeue after the checkpoint. (The adversarial suite: real processes where a kill or a signal is
the point.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ampctl.cli import main
from tests.support.adversarial import (
    MLP,
    REPO,
    cli,
    handles,
    neither_ignores_nor_blocks,
    one_line_refusal,
    popen,
    row_count,
    wait_for,
)
from tests.support.in_process import run_ampctl
from tests.support.runs import QUICK, ForkedAmpctl, steps

# --- signals outside the training loop ---------------------------------------------------------------------


@pytest.mark.parametrize("when", ["starting", "training"])
@pytest.mark.parametrize("gap_s", [0.0, 0.05])
def test_two_ctrl_c_in_quick_succession_exit_130_with_their_lines_and_no_traceback(tmp_path, when, gap_s):
    """A second Ctrl-C while the first is handled (it printed a traceback now and then, or killed the process
    without a word in the interpreter's teardown): each signal says its line, and the exit code is 130. Starting:
    the first lands once ampctl handles signals, at whatever point of its start that is (composing, importing
    torch, building), never before Python itself has started (a wait of a fixed second was sometimes that)."""
    run_dir = tmp_path / "run"
    args = ["train", *QUICK, "train.steps=100000", "train.checkpoint.every=5", f"hydra.run.dir={run_dir}"]
    # its start is under test when starting; in its loop, a process forked from the preloaded server will do
    process = popen(*args, cwd=tmp_path) if when == "starting" else ForkedAmpctl(*args, cwd=tmp_path)
    if when == "starting":
        wait_for(lambda: handles(process, signal.SIGHUP) or process.poll() is not None, timeout=120)
        neither_ignores_nor_blocks(process, signal.SIGINT)
    else:
        wait_for(lambda: row_count(run_dir / "metrics.jsonl") >= 8)
    process.send_signal(signal.SIGINT)
    time.sleep(gap_s)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    said = stderr.strip().splitlines()[-1]
    assert said.startswith(("ampctl: interrupted (SIGINT)", "ampctl train: interrupted", "continue with: ",
                            "ampctl: SIGINT again: exiting at once")), stderr


# A weakref's callback, as importlib's module-lock clean-up is (where a second Ctrl-C during ampctl's imports
# landed, seen once in a full run of the suite): the signal's handler runs inside it, where an exception cannot
# propagate, and Python printed the Signalled as "Exception ignored in" with its traceback. A ValueError raised there
# afterwards still reaches the hook that was installed before ampctl's.
_SIGNAL_INSIDE_A_CALLBACK = """
import os, signal, sys, weakref
from ampctl.interrupt import raise_on_signals, signal_raised
def earlier_hook(unraisable):
    print("earlier hook:", type(unraisable.exc_value).__name__, file=sys.stderr)
sys.unraisablehook = earlier_hook
raise_on_signals()
def cleanup(_ref, error=None):
    os.kill(os.getpid(), signal.SIGINT)
    a_python_call()  # the handler runs here, at this function's start
def a_python_call():
    pass
def fail(_ref):
    raise ValueError("a clean-up's own error")
class Thing:
    pass
thing, other = Thing(), Thing()
refs = weakref.ref(thing, cleanup), weakref.ref(other, fail)
del thing
print("went on; signal recorded:", signal_raised())
del other
"""


def test_a_signal_that_lands_inside_a_callback_that_cannot_raise_is_recorded_without_a_traceback():
    result = subprocess.run([sys.executable, "-c", _SIGNAL_INSIDE_A_CALLBACK], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and "went on; signal recorded: True" in result.stdout, result
    assert "Traceback" not in result.stderr and "Signalled" not in result.stderr, result.stderr
    assert result.stderr.strip() == "earlier hook: ValueError", result.stderr


def test_a_launchers_copy_of_ctrl_c_is_not_a_second_one(tmp_path):
    """A terminal's Ctrl-C reaches a sweep's job and the launcher that forwards it (submitit's local controller,
    torchrun's agent): the same signal twice, milliseconds apart. The job stops as after one, with a checkpoint."""
    run_dir = tmp_path / "run"
    slow = ["recipe._target_=tests.support.slow_data_recipe.SlowDataRecipe", "+recipe.data_delay_s=0.3"]
    process = ForkedAmpctl("train", *QUICK, *slow, "train.steps=100000", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    wait_for(lambda: row_count(run_dir / "metrics.jsonl") >= 3)
    process.send_signal(signal.SIGINT)  # in a step of 0.3 s: the copy lands before it ends
    time.sleep(0.05)  # submitit's controller forwards it within its 1/24 s poll
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130 and "again: exiting" not in err and "interrupted at step" in err, err[-3000:]
    assert list((run_dir / "checkpoints").glob("step_*.pt"))


def test_preempt_signal_null_ignores_sigusr1_and_sigterm_still_stops_with_a_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    process = ForkedAmpctl("train", *QUICK, "train.steps=100000", "train.cluster.preempt_signal=null",
                           f"hydra.run.dir={run_dir}", cwd=tmp_path)
    wait_for(lambda: row_count(run_dir / "metrics.jsonl") >= 2)
    process.send_signal(signal.SIGUSR1)
    seen = row_count(run_dir / "metrics.jsonl")
    wait_for(lambda: row_count(run_dir / "metrics.jsonl") > seen + 20)  # it trains on
    assert process.poll() is None
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 143 and "interrupted at step" in err and "Traceback" not in err, err
    assert list((run_dir / "checkpoints").glob("step_*.pt"))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP])
def test_a_signal_before_the_first_step_is_one_line_and_leaves_no_run_dir(tmp_path, signum):
    run_dir = tmp_path / "run"
    process = ForkedAmpctl("train", *QUICK, f"hydra.run.dir={run_dir}",
                           "recipe._target_=tests.support.broken_recipes.BrokenRecipe", "+recipe.mistake=slow_build",
                           cwd=tmp_path)
    # once failed in CI, the run directory not made in 240 s, with nothing to say why: now its stderr is said
    wait_for(lambda: (run_dir / ".hydra" / "config.yaml").exists() or process.poll() is not None,
             seen=process.stderr_so_far)
    assert process.poll() is None, process.communicate()[1]  # what ended it before its run started
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
    wait_for(lambda: row_count(out / "fp32" / "metrics.jsonl") >= 2)
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
    wait_for(lambda: row_count(out / "fp32" / "metrics.jsonl") >= 2)
    process.kill()
    process.wait()
    # the mode's process got SIGTERM from the kernel: it stops after its step, with a checkpoint, and exits
    wait_for(lambda: "interrupted at step" in (out / "fp32.log").read_text(), timeout=120)
    wait_for(lambda: not (out / "fp32" / ".ampctl.lock").exists(), timeout=60)
    assert list((out / "fp32" / "checkpoints").glob("step_*.pt"))


# --- what the most trusted peers guarantee: hang detection, SLURM requeue ------------------------------------


def test_a_stalled_step_is_named_with_every_threads_stack_and_the_run_goes_on(tmp_path, capsys, restore_argv):
    run_dir = tmp_path / "run"
    main(["train", *MLP, "train.steps=14", "recipe._target_=tests.support.slow_data_recipe.StallingRecipe",
          "+recipe.stall_at=10", "+recipe.stall_s=2.5", "train.cluster.hang_after_s=0.6", f"hydra.run.dir={run_dir}"])
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
    process = ForkedAmpctl("train", *QUICK, "train.steps=100000", f"hydra.run.dir={run_dir}", cwd=tmp_path, env=env)
    wait_for(lambda: row_count(run_dir / "metrics.jsonl") >= 2)
    process.send_signal(signal.SIGUSR1)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 138, err
    assert calls.read_text() == "requeue 4242\n"
    assert "requeued SLURM job 4242: it continues this run when it starts again" in err
    done_rows = row_count(run_dir / "metrics.jsonl")
    # another job running the same command into the directory is refused: only the requeued job continues it
    other = run_ampctl("train", *QUICK, "train.steps=100000", f"hydra.run.dir={run_dir}", cwd=tmp_path,
                       env={"SLURM_JOB_ID": "4243", "SLURM_RESTART_COUNT": "1"})
    assert "already holds a run" in one_line_refusal(other, "train")
    # the requeued job runs its script's command again (no resume=auto): it continues its run from the checkpoint
    resumed = ForkedAmpctl("train", *QUICK, "train.steps=100000", f"hydra.run.dir={run_dir}", cwd=tmp_path,
                           env={**env, "SLURM_RESTART_COUNT": "1"})
    wait_for(lambda: row_count(run_dir / "metrics.jsonl") >= done_rows + 2)
    # SIGTERM (a cancel, not the preemption warning) does not requeue
    resumed.send_signal(signal.SIGTERM)
    out, _ = resumed.communicate(timeout=120)
    assert resumed.returncode == 143 and calls.read_text() == "requeue 4242\n"
    assert f"ampctl train: batch job slurm:4242 was requeued: it continues its run in {run_dir}" in out
    assert steps(run_dir / "metrics.jsonl")[:done_rows + 1] == list(range(1, done_rows + 2))


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
    result = cli("compare", *MLP, "train.steps=2", "recipe._target_=tests.support.broken_recipes.BrokenRecipe",
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


def test_ctrl_c_during_a_diffs_proof_keeps_the_diffs_figures_and_says_the_proof_was_stopped(tmp_path):
    """The diff's figures are written before its proof trains; a Ctrl-C there stops the comparison's runs with their
    checkpoints, marks the proof interrupted in diff.json, and says in one line where each part is."""
    out = tmp_path / "diff"
    process = popen("diff", "device=cpu", "recipe=fragile", "precision=bf16", "diff.batches=2", "diff.repair=true",
                    "diff.prove=true", "train.steps=100000", "compare.seeds=2", f"hydra.run.dir={out}", cwd=tmp_path)
    wait_for(lambda: row_count(out / "proof" / "fp32" / "seed_0" / "metrics.jsonl") >= 2)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=240)
    assert process.returncode == 130, err[-2000:]
    assert "Traceback" not in err and err.strip().endswith("its proof's runs so far in "
                                                          f"{out}/proof (each continues with its line above)")
    record = json.loads((out / "diff.json").read_text())
    assert record["proof"]["verdict"] == "interrupted" and record["rows"][0]["layer"] == "cancel"
    assert list((out / "proof" / "fp32" / "seed_0" / "checkpoints").glob("step_*.pt"))


def test_ctrl_c_during_a_diffs_repair_keeps_its_ranking_and_says_the_repair_was_stopped(tmp_path):
    """The ranking is written before the repair searches: a Ctrl-C in the search leaves diff.json, report.md and the
    plot whole, the repair marked interrupted with the sets measured so far, and one line naming the directory (it
    said "interrupted before anything was recorded" after every batch was measured)."""
    out = tmp_path / "diff"
    process = popen("diff", "device=cpu", "recipe=mlp", "recipe.batch_size=2048", "precision=nvfp4",
                    "diff.batches=32", "diff.repair=true", f"hydra.run.dir={out}", cwd=tmp_path)
    wait_for(lambda: (out / "diff.json").is_file() and (out / "layer_errors.png").is_file())
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=240)
    assert process.returncode == 130, err[-2000:]
    assert "Traceback" not in err and err.strip() == f"ampctl diff: interrupted (SIGINT); what was measured until " \
                                                     f"then is in {out}", err
    record = json.loads((out / "diff.json").read_text())
    assert record["repair"]["interrupted"] and record["rows"] and record["repair"]["chosen"] is None
    assert "repair: stopped by a signal after " in (out / "report.md").read_text()
    assert not (out / "repaired.yaml").exists()


def test_a_ctrl_c_a_library_turned_into_its_own_error_still_marks_the_repair_interrupted(tmp_path):
    """A signal landing in a library's clean-up comes out as that library's error with the interrupt as its context
    (a lazy import, a finalizer): the repair's files still say it was stopped, with the sets measured so far, and the
    interrupt goes on (the command then ends as Ctrl-C ends it). The CI flake of the test above: exit 130 with the
    repair null in diff.json."""
    from ampctl.studies.diffing.diff import _repaired
    from ampctl.studies.diffing.diff_repair import Tried

    class Report:
        def __init__(self):
            self.repair, self.written = None, []

        def write(self, out_dir, console, files_only=False):
            self.written.append(self.repair)

    def search(said):
        said(Tried([], 0.1, 1.0))
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("a library's clean-up failed")  # its context: the interrupt

    report = Report()
    with pytest.raises(KeyboardInterrupt):
        _repaired(search, report, tmp_path, None, lambda what: None)
    assert report.repair.interrupted and len(report.repair.tried) == 1 and report.written[-1] is report.repair
