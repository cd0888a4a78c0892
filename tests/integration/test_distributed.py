"""Data parallelism on the CPU: torchrun, gloo, 2 processes. Each test starts real torchrun jobs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ampctl.cli import main
from tests.support.runs import torchrun

REPO = Path(__file__).resolve().parents[2]
MLP = ["device=cpu", "recipe=mlp", "recipe.hidden=64", "train.steps=12", "train.log_every=4",
       "train.console=plain", "train.lr.warmup_steps=0",
       "telemetry.profile_cpu_memory=false"]  # the memory timeline, not under test here, costs ~9 s a torchrun
COMPARED = ("step", "loss", "loss_scale", "skipped")


def single(run_dir: Path, *args: str) -> None:
    main(["train", *args, "train.console=quiet", f"hydra.run.dir={run_dir}"])


def rows(run_dir: Path) -> list[dict]:
    return [{k: r[k] for k in COMPARED} for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.slow
@pytest.mark.parametrize("kind,precision,accum", [("ddp", "fp16", 2), ("ddp", "bf16", 1), ("fsdp", "fp32", 2)])
def test_two_ranks_of_batch_b_train_as_one_process_of_batch_2b(tmp_path, restore_argv, kind, precision, accum):
    args = [*MLP, f"precision={precision}", f"train.grad_accum_steps={accum}",
            *(["scaler.init_scale=1e6"] if precision == "fp16" else [])]
    result = torchrun(tmp_path / "ddp", *args, "recipe.batch_size=16", f"distributed={kind}")
    assert result.returncode == 0, result.stderr
    single(tmp_path / "one", *args, "recipe.batch_size=32")
    ddp, one = rows(tmp_path / "ddp"), rows(tmp_path / "one")
    assert [r["step"] for r in ddp] == list(range(1, 13))
    assert [r["loss"] for r in ddp] == pytest.approx([r["loss"] for r in one], rel=2e-3)
    assert [(r["loss_scale"], r["skipped"]) for r in ddp] == [(r["loss_scale"], r["skipped"]) for r in one]
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert summary["world_size"] == 2
    # only rank 0 speaks and records: one final line, one run dir, nothing written where torchrun ran
    assert result.stdout.count("done: 12 steps") == 1, result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddp", "one"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_an_inf_on_one_rank_makes_every_rank_skip(tmp_path, kind):
    """DDP: the all-reduce carries the inf to every rank. FSDP: each rank sees only its shard of the
    gradients, so the scaler all-reduces its found-inf."""
    recipe = ["recipe._target_=tests.support.rank_fault_recipe.RankFaultRecipe", "+recipe.fault_step=3"]
    result = torchrun(tmp_path / "ddp", *MLP, *recipe, "precision=fp16", "recipe.batch_size=16", f"distributed={kind}")
    assert result.returncode == 0, result.stderr
    skipped = [r["step"] for r in rows(tmp_path / "ddp") if r["skipped"]]
    # rank 0 computed finite gradients at step 3; the all-reduce brought rank 1's inf to it
    assert skipped == [3], rows(tmp_path / "ddp")
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_failure_on_one_rank_ends_the_job_naming_the_rank(tmp_path):
    recipe = ["recipe._target_=tests.support.rank_fault_recipe.RankFaultRecipe", "+recipe.fault=crash"]
    result = torchrun(tmp_path / "ddp", *MLP, *recipe, "precision=bf16", "recipe.batch_size=16",
                      "distributed=ddp", "distributed.timeout_s=30")
    assert result.returncode != 0
    assert "injected failure on rank 1" in result.stderr
    assert "rank      : 1" in result.stderr or "rank: 1" in result.stderr, result.stderr[-2000:]


@pytest.mark.slow
def test_torchrun_max_restarts_with_resume_auto_continues_from_the_newest_checkpoint(tmp_path):
    """docs/distributed.md: `torchrun --max-restarts=N` reruns the same command line after a failure; with a fixed
    run directory and resume=auto, the restart continues the run from its newest checkpoint, no step lost or
    recorded twice."""
    recipe = ["recipe._target_=tests.support.rank_fault_recipe.RankFaultRecipe", "+recipe.fault=crash_once",
              "+recipe.fault_step=7"]
    run_dir = tmp_path / "run"
    result = torchrun(run_dir, *MLP, *recipe, "recipe.batch_size=16", "distributed=ddp", "train.checkpoint.every=4",
                      "resume=auto", torchrun_args=("--max-restarts=1",))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "injected failure on rank 1" in result.stderr  # the first attempt failed at step 7
    assert "resumed from" in result.stdout and "step_00000004.pt" in result.stdout, result.stdout
    assert [r["step"] for r in rows(run_dir)] == list(range(1, 13))
    assert result.stdout.count("done: 12 steps") == 1


GPT = ["device=cpu", "recipe=gpt", "recipe.d_model=64", "recipe.n_layers=2", "recipe.n_heads=2",
       "recipe.block_size=64", "recipe.batch_size=4", "recipe.max_corpus_bytes=200000", "train.steps=12",
       "train.log_every=4", "train.console=plain",
       "telemetry.profile_cpu_memory=false"]  # the memory timeline of a sharded bf16 gpt costs a minute here


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    [*MLP, "distributed=ddp", "precision=fp16", "recipe.batch_size=16", "scaler.init_scale=1e9",
     "scaler.growth_interval=3"],
    [*GPT, "distributed=fsdp", "precision=bf16"],  # sharded states: gathered into one checkpoint, re-sharded
], ids=["ddp-fp16", "fsdp-bf16-gpt"])
def test_a_job_resumes_from_its_checkpoint_as_if_never_stopped(tmp_path, args):
    assert torchrun(tmp_path / "whole", *args).returncode == 0
    first = torchrun(tmp_path / "resumed", *args, "train.steps=6")
    assert first.returncode == 0, first.stderr
    second = torchrun(tmp_path / "resumed", *args, "resume=auto")
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stdout and "changed: train.steps: 6 -> 12" in second.stdout
    assert rows(tmp_path / "resumed") == rows(tmp_path / "whole")


@pytest.mark.parametrize("args,message", [
    (["distributed=ddp"], "distributed=ddp runs under torchrun"),
    (["distributed=fsdp"], "distributed=fsdp runs under torchrun"),
    (["distributed=fsdp", "precision=O2"], "distributed=fsdp with precision=O2: FSDP2 keeps fp32 sharded parameters"),
    (["distributed.timeout_s=0"], "distributed.timeout_s=0 is not allowed"),
])
def test_bad_distributed_input_is_refused_with_one_line(tmp_path, restore_argv, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *MLP, *args, f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_a_usage_error_under_torchrun_is_printed_once_and_names_fsdp(tmp_path):
    result = torchrun(tmp_path / "run", *MLP, "distributed=fsdp", "recipe.batch_size=16.5")
    assert result.returncode != 0
    assert result.stderr.count("ampctl train: error:") == 1, result.stderr
    assert ("ampctl train: error: distributed=fsdp splits the recipe's batches over the ranks: the recipe needs an "
            "integer recipe.batch_size") in result.stderr


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_every_rank_at_a_log_step_with_a_checkpoint(tmp_path):
    """torchrun forwards SIGTERM to its workers; they agree to stop at the next log step, write one checkpoint
    and exit 143; rank 0 says once how to continue (torchrun itself then reports the signal and exits 1)."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "ampctl", "train",
         *MLP, "distributed=ddp", "recipe.batch_size=16", "train.steps=100000", "train.log_every=5",
         f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 240
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 10):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    step = int(re.search(r"interrupted at step (\d+) by SIGTERM", stderr).group(1))
    assert step % 5 == 0 and stderr.count("interrupted at step") == 1, stderr
    assert f"continue with: torchrun --nproc-per-node=2 -m ampctl train resume={run_dir}" in stderr
    assert [p.name for p in (run_dir / "checkpoints").glob("*.pt")] == [f"step_{step:08d}.pt"]
    assert json.loads(metrics.read_text().splitlines()[-1])["step"] == step


@pytest.mark.slow
def test_a_resume_on_another_number_of_ranks_says_how_the_global_batch_changes(tmp_path, restore_argv):
    run_dir = tmp_path / "run"
    single(run_dir, *MLP, "recipe.batch_size=16", "train.steps=6")
    resumed = torchrun(run_dir, *MLP, "distributed=ddp", "recipe.batch_size=16", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr
    assert "world size: 1 -> 2 ranks; global batch 16 -> 32 samples per step" in resumed.stdout, resumed.stdout
    assert [r["step"] for r in rows(run_dir)] == list(range(1, 13))


@pytest.mark.slow
def test_a_write_rank_0_cannot_make_ends_every_rank_with_its_line(tmp_path):
    """A whole checkpoint is rank 0's to write: where its disk is full (a file size limit, EFBIG, as a full disk would
    refuse it), rank 1 went on into the next step and died in gloo's "Connection closed by peer" with a traceback.
    Both ranks now end with rank 0's refused write: exit 74, one line, no rank's traceback."""
    import resource

    run_dir = tmp_path / "run"

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))  # the rows fit, a 0.3 MB checkpoint does not

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "ampctl", "train",
         *MLP, "recipe.hidden=256", "train.checkpoint.every=4", "distributed=ddp", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env, preexec_fn=small_files)
    assert done.returncode != 0
    said = [line for line in done.stderr.splitlines() if line.startswith("ampctl train")]
    assert said == [f"ampctl train: error: cannot write {run_dir}/checkpoints/step_00000004.pt.tmp: File too large; "
                    "no checkpoint was written"], done.stderr[-3000:]
    assert "[rank1]" not in done.stderr and "Connection closed" not in done.stderr, done.stderr[-3000:]
    # The rank that ends first is torchrun's root cause; the agent then sends the other SIGTERM, which can reach it
    # before its own exit 74 does (a race CI lost once): that rank's -15 is torchrun's doing, not a second failure.
    codes = re.findall(r"exitcode\s*: (-?\d+)", done.stderr)
    assert len(codes) == len(re.findall(r"exitcode", done.stderr)) and set(codes) <= {"74", "-15"}, done.stderr[-3000:]
    root_cause = done.stderr.split("Root Cause", 1)[1]
    assert re.findall(r"exitcode\s*: (-?\d+)", root_cause) == ["74"], done.stderr[-3000:]
    assert not list((run_dir / "checkpoints").glob("*.tmp")) if (run_dir / "checkpoints").exists() else True


@pytest.mark.slow
def test_deepseeks_expert_bias_is_moved_by_every_ranks_load(tmp_path):
    """recipe=moe recipe.bias_update_speed under DDP: each step's load is summed over the ranks before the bias moves
    (else each rank's bias would follow its half of the tokens), so the two ranks of batch b end with the bias of one
    process of batch 2b."""
    import torch

    args = ["device=cpu", "recipe=moe", "recipe.n_layers=2", "recipe.d_model=32", "recipe.n_heads=2",
            "recipe.experts=4", "recipe.expert_hidden=32", "recipe.block_size=32", "recipe.max_corpus_bytes=200000",
            "recipe.bias_update_speed=0.01", "train.steps=12", "train.log_every=4", "train.lr.warmup_steps=0",
            "telemetry.profile_cpu_memory=false", "train.checkpoint.every=12"]
    result = torchrun(tmp_path / "ddp", *args, "train.console=plain", "recipe.batch_size=4", "distributed=ddp")
    assert result.returncode == 0, result.stderr
    single(tmp_path / "one", *args, "recipe.batch_size=8")
    models = [torch.load(run / "checkpoints" / "step_00000012.pt", weights_only=False)["model"]
              for run in (tmp_path / "ddp", tmp_path / "one")]
    biases = [{k: v for k, v in model.items() if k.endswith("expert_bias")} for model in models]
    assert len(biases[0]) == 2 and any(v.any() for v in biases[0].values())
    for name, bias in biases[0].items():
        assert torch.equal(bias, biases[1][name]), name
