"""Sharded checkpoints (distributed.checkpoint_format=sharded, torch.distributed.checkpoint): the layout, the
checksums, a resume that equals the uninterrupted run, a sharded FSDP checkpoint equal to the gathered one and
resumable on another number of ranks, async saves, and faults (a bit flip, a killed write, a full disk)."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ampctl.cli import main
from tests.support.runs import flip_a_bit, rows, torchrun, torchrun_on_two_nodes

REPO = Path(__file__).resolve().parents[2]
# fp16 with overflows and regrowth: the model, optimizer and scaler states all matter for exactness
RUN = ["device=cpu", "recipe=mlp", "recipe.hidden=128", "recipe.batch_size=32", "precision=fp16",
       "scaler.init_scale=1e9", "scaler.growth_interval=7", "train.steps=20", "train.checkpoint.every=10",
       "train.log_every=5", "train.console=quiet", "distributed.checkpoint_format=sharded",
       "telemetry.profile_cpu_memory=false"]  # the CPU memory peak is not under test here


@pytest.fixture
def sharded_run(tmp_path, restore_argv) -> Path:
    run_dir = tmp_path / "run"
    main(["train", *RUN, f"hydra.run.dir={run_dir}"])
    return run_dir


def test_a_sharded_checkpoint_is_a_dcp_directory_that_sha256sum_checks(sharded_run):
    newest = sharded_run / "checkpoints" / "step_00000020.dcp"
    assert sorted(p.name for p in newest.iterdir()) == [".metadata", "SHA256SUMS", "__0_0.distcp", "state.pt"]
    checked = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=newest, capture_output=True, text=True)
    assert checked.returncode == 0 and checked.stdout.count(": OK") == 3, checked
    state = torch.load(newest / "state.pt", weights_only=True)  # everything but the sharded states
    assert state["step"] == 20 and "model" not in state and "optimizer" not in state


def test_a_run_resumed_from_a_sharded_checkpoint_repeats_the_same_steps(sharded_run, capsys, restore_argv):
    old_rows = rows(sharded_run)
    main(["train", f"resume={sharded_run / 'checkpoints' / 'step_00000010.dcp'}", "train.console=quiet",
          f"hydra.run.dir={sharded_run.parent / 'other'}"])
    assert "resumed from" in capsys.readouterr().out
    assert rows(sharded_run) == old_rows  # steps 11..20 again, bit for bit (CPU)
    [aside] = (sharded_run / "checkpoints").glob("timeline.set-aside-*")
    assert [p.name for p in aside.iterdir()] == ["step_00000020.dcp"]  # the later one set aside, whole


def test_a_bit_flipped_shard_is_passed_over_for_the_newest_good_checkpoint(sharded_run, capsys, restore_argv):
    newest = sharded_run / "checkpoints" / "step_00000020.dcp"
    flip_a_bit(newest / "__0_0.distcp")
    main(["train", *RUN, "train.steps=25", f"hydra.run.dir={sharded_run}", "resume=auto"])
    out = capsys.readouterr().out
    assert f"warning: checkpoint '{newest}': __0_0.distcp does not match its checksum (SHA256SUMS)" in out, out
    assert "step_00000010.dcp at step 10" in out
    assert [r["step"] for r in rows(sharded_run)] == list(range(1, 26))


def test_the_directory_of_a_killed_sharded_write_is_removed_at_start(sharded_run, capsys, restore_argv):
    half_written = sharded_run / "checkpoints" / "step_00000030.dcp.tmp"
    half_written.mkdir()
    (half_written / "__0_0.distcp").write_bytes(b"half")
    main(["train", *RUN, "train.steps=21", f"hydra.run.dir={sharded_run}", "resume=auto"])
    assert "removed 1 temporary file(s) a killed write left: step_00000030.dcp.tmp" in capsys.readouterr().out
    assert not half_written.exists()


def test_a_full_disk_during_an_async_sharded_save_is_one_line_exit_74(sharded_run):
    """RLIMIT_FSIZE (SIGXFSZ ignored) fails the write as a full disk would (EFBIG), in DCP's writer thread."""
    before = {p: p.read_bytes() for p in (sharded_run / "checkpoints").rglob("*") if p.is_file()}
    limit = (sharded_run / "checkpoints" / "step_00000020.dcp" / "__0_0.distcp").stat().st_size // 2

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    full = subprocess.run([sys.executable, "-m", "ampctl", "train", *RUN, "train.steps=30", "resume=auto",
                           "distributed.async_checkpoint=true", f"hydra.run.dir={sharded_run}"],
                          capture_output=True, text=True, cwd=REPO, timeout=300, preexec_fn=small_files)
    assert full.returncode == 74, full.stderr
    assert full.stderr == (f"ampctl train: error: cannot write {sharded_run}/checkpoints/step_00000030.dcp.tmp: "
                           "File too large; the checkpoints written before it are whole (resume=auto continues "
                           "from the newest once it can write)\n")
    assert {p: p.read_bytes() for p in (sharded_run / "checkpoints").rglob("*") if p.is_file()} == before


def test_sharded_checkpoints_are_refused_where_the_optimizer_steps_on_fp32_masters(tmp_path, capsys, restore_argv):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *RUN, "precision=O2", f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    assert "distributed.checkpoint_format=sharded with precision=O2" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


FSDP = ["device=cpu", "recipe=mlp", "recipe.hidden=64", "recipe.batch_size=16", "precision=fp32",
        "train.steps=8", "train.log_every=4", "train.checkpoint.every=4", "train.console=plain",
        "distributed=fsdp", "telemetry.profile_cpu_memory=false"]


@pytest.mark.slow
def test_fsdp_writes_one_shard_per_rank_equal_to_the_gathered_state_and_resumes_on_one_process(
        tmp_path, restore_argv):
    """Two ranks save asynchronously, each its own shard; torch's own converter reads the checkpoint back and
    it equals, tensor for tensor, the full checkpoint (gathered on rank 0) of the same run. Resumed on one
    process (another world size: DCP reshards), it continues exactly as the full checkpoint does."""
    sharded = torchrun(tmp_path / "sharded", *FSDP, "distributed.async_checkpoint=true")
    assert sharded.returncode == 0, sharded.stderr
    full = torchrun(tmp_path / "full", *FSDP, "distributed.checkpoint_format=full")
    assert full.returncode == 0, full.stderr
    newest = tmp_path / "sharded" / "checkpoints" / "step_00000008.dcp"
    assert {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in newest.iterdir()}

    dcp_to_torch_save(newest, tmp_path / "converted.pt")
    converted = torch.load(tmp_path / "converted.pt", weights_only=True)
    gathered = torch.load(tmp_path / "full" / "checkpoints" / "step_00000008.pt", weights_only=True)
    assert converted["model"].keys() == gathered["model"].keys()
    assert all(torch.equal(converted["model"][k], gathered["model"][k]) for k in gathered["model"])
    optimizer_states = gathered["optimizer"]["state"]
    assert all(torch.equal(torch.as_tensor(converted["optimizer"]["state"][name][key]), torch.as_tensor(value))
               for name, state in optimizer_states.items() for key, value in state.items())

    for run in ("sharded", "full"):
        ext = "dcp" if run == "sharded" else "pt"
        main(["train", f"resume={tmp_path / run / 'checkpoints' / f'step_00000004.{ext}'}", "distributed=none",
              "train.console=quiet", "telemetry.profile_cpu_memory=false", f"hydra.run.dir={tmp_path / 'other'}"])
    resumed = [json.loads(line) for line in (tmp_path / "sharded" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == list(range(1, 9))
    assert rows(tmp_path / "sharded")[4:] == rows(tmp_path / "full")[4:]


TWO_NODES = ["device=cpu", "recipe=mlp", "recipe.hidden=32", "recipe.batch_size=8", "train.steps=4",
             "train.checkpoint.every=2", "train.log_every=2", "train.console=plain", "distributed=ddp",
             "distributed.checkpoint_format=sharded", "telemetry.profile_cpu_memory=false"]


@pytest.mark.slow
def test_two_nodes_on_shared_storage_write_whole_checkpoints_and_on_local_disks_are_refused(tmp_path):
    """Two torchrun agents (--nnodes=2, c10d on 127.0.0.1). One run directory both nodes see: every checkpoint
    holds both ranks' shards and checks. A directory of each node's own (a node-local disk): rank 0 sees only its
    own shard, so the first checkpoint is refused in one line instead of being declared whole without rank 1's."""
    shared = tmp_path / "shared" / "run"
    shared.parent.mkdir()
    whole = torchrun_on_two_nodes((shared, shared), *TWO_NODES)
    assert [a.returncode for a in whole] == [0, 0], whole[0].stderr[-3000:] + whole[1].stderr[-3000:]
    newest = shared / "checkpoints" / "step_00000004.dcp"
    assert {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in newest.iterdir()}
    assert subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=newest, capture_output=True).returncode == 0

    local = (tmp_path / "node0" / "run", tmp_path / "node1" / "run")
    for run_dir in local:
        run_dir.parent.mkdir()
    halves = torchrun_on_two_nodes(local, *TWO_NODES)
    assert all(a.returncode != 0 for a in halves)
    # each node says in one line why it stopped (node 1 went on into the next step and died in gloo's "Connection
    # closed by peer" with ~100 lines of traceback and no word of why); the traceback after it is torchrun's own
    said = [[line for line in a.stderr.splitlines() if line.startswith("ampctl train")] for a in halves]
    assert [len(lines) for lines in said] == [1, 1], [a.stderr[-3000:] for a in halves]
    assert said[0][0].startswith("ampctl train: error: the checkpoint step_00000002.dcp lacks __1_0.distcp that "
                                 "other ranks wrote: the run directory ")
    assert "is not on storage every node shares" in said[0][0]
    assert said[1][0] == said[0][0].replace("error: ", "error: rank 0 refused: ", 1)
    assert all("Traceback" not in a.stderr.split("torch/distributed/elastic")[0] for a in halves)
    assert all("[rank1]" not in a.stderr for a in halves)
    assert not list((local[0] / "checkpoints").glob("step_*")), "no checkpoint of rank 0's shard alone"
    assert not local[1].exists(), "node 1's half-written shard is removed with the folders made for it"


@pytest.mark.slow
def test_a_checkpointing_process_writes_what_the_thread_writes_and_says_nothing(tmp_path, restore_argv):
    """distributed.async_checkpointer=process: each rank's states go to a saving process of its own (shared
    memory, a gloo group of the saving processes). Its checkpoints hold what the thread's hold, tensor for tensor;
    nothing of it reaches the terminal (DCP's own process mode printed five INFO lines a checkpoint on each rank and
    an EOFError traceback at every rank's end); a resume from it continues as the thread's does."""
    thread = torchrun(tmp_path / "thread", *FSDP, "distributed.async_checkpoint=true")
    assert thread.returncode == 0, thread.stderr
    process = torchrun(tmp_path / "process", *FSDP, "distributed.async_checkpoint=true",
                       "distributed.async_checkpointer=process")
    assert process.returncode == 0, process.stderr
    assert "INFO" not in process.stderr and "Traceback" not in process.stderr, process.stderr
    assert process.stderr == thread.stderr  # whatever torchrun itself says, and nothing more
    for step in (4, 8):
        read = {}
        for run in ("thread", "process"):
            dcp_to_torch_save(tmp_path / run / "checkpoints" / f"step_{step:08d}.dcp", tmp_path / f"{run}.pt")
            read[run] = torch.load(tmp_path / f"{run}.pt", weights_only=True)
        assert read["process"]["model"].keys() == read["thread"]["model"].keys()
        assert all(torch.equal(read["process"]["model"][k], v) for k, v in read["thread"]["model"].items())
        assert all(torch.equal(torch.as_tensor(read["process"]["optimizer"]["state"][name][key]), torch.as_tensor(v))
                   for name, state in read["thread"]["optimizer"]["state"].items() for key, v in state.items())
    resumed = torchrun(tmp_path / "process", *FSDP, "distributed.async_checkpoint=true",
                       "distributed.async_checkpointer=process", "train.steps=12", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr
    continued = torchrun(tmp_path / "thread", *FSDP, "distributed.async_checkpoint=true", "train.steps=12",
                         "resume=auto")
    assert continued.returncode == 0, continued.stderr
    assert rows(tmp_path / "process") == rows(tmp_path / "thread")


@pytest.mark.slow
def test_shared_memory_too_small_for_a_checkpointing_process_is_one_line_exit_74_on_every_rank(tmp_path):
    """The states reach the saving process through shared memory (/dev/shm, a container's --shm-size): where it
    cannot hold them, each rank says so in one line and how to go on, and exits 74. A file size limit refuses the
    shared memory's files as a full /dev/shm would (torch's 'unable to resize file', a traceback before)."""
    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))  # Hydra's own files fit, the states do not

    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    full = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "ampctl",
         "train", *FSDP, "recipe.hidden=1024", "distributed.async_checkpoint=true",
         "distributed.async_checkpointer=process", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env, preexec_fn=small_files)
    said = {line for line in full.stderr.splitlines() if line.startswith("ampctl train: error:")}
    full_shm = ("ampctl train: error: cannot write /dev/shm: File too large (the states are handed to the saving "
                "process in shared memory; give it more, as a container's --shm-size, or use "
                "distributed.async_checkpointer=thread); no checkpoint was written")
    # a rank whose own states fitted (the limit met on the other first) says why it stopped too
    told = ("ampctl train: error: another rank could not hand its checkpoint over to its saving process (that "
            "rank's line says why)")
    assert full_shm in said and said <= {full_shm, told}, full.stderr
    # the first rank to end ends with 74; torchrun then terminates a rank that had not yet ended (-15)
    codes = re.findall(r"exitcode  : (-?\d+)", full.stderr)
    assert "74" in codes and set(codes) <= {"74", "-15"} and "[rank" not in full.stderr, full.stderr
    assert not list(run_dir.glob("checkpoints/*"))  # nothing half-written left


def _descendants(root: int) -> list[int]:
    """Every process below root (Linux /proc): the job's own, not another test's."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _saving_processes(root: int) -> list[int]:
    def cmdline(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return ""

    return [pid for pid in _descendants(root) if "spawn_main" in cmdline(pid)]


@pytest.mark.slow
def test_a_checkpointing_process_killed_is_one_line_naming_it(tmp_path):
    """kill -9 of the ranks' saving processes (the OOM killer's way): each rank whose saving process died says so in
    one line (its rank, the signal, that the checkpoints before are whole), exit 1, no traceback of ampctl's; it
    ended with exit 0 and Hydra's 'Error executing job' alone (the dead process's broken pipe was taken for stdout's
    reader gone)."""
    import time

    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "ampctl", "train",
         *FSDP, "train.steps=100000", "train.log_every=2", "train.checkpoint.every=2",
         "distributed.async_checkpoint=true", "distributed.async_checkpointer=process", f"hydra.run.dir={run_dir}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    deadline = time.monotonic() + 240
    while not list(run_dir.glob("checkpoints/step_*.dcp")) and time.monotonic() < deadline:
        time.sleep(0.2)
    savers = _saving_processes(job.pid)
    assert len(savers) == 2, savers
    for pid in savers:
        os.kill(pid, signal.SIGKILL)
    _, err = job.communicate(timeout=240)
    said = [line for line in err.splitlines() if line.startswith("ampctl train:")]
    assert said and all(re.fullmatch(r"ampctl train: stopped: rank [01]'s checkpoint saving process died \(killed by "
                                     r"SIGKILL\) .*; the checkpoints it wrote before are whole: resume=auto continues "
                                     r"from the newest|ampctl train: interrupted .*", line) for line in said), err
    assert "[rank" not in err and "Error executing job" not in err and job.returncode != 0, err
    assert list(run_dir.glob("checkpoints/step_*.dcp"))  # the ones written before: whole


@pytest.fixture
def small_disk(tmp_path):
    """A 40 MB file system of its own (a tmpfs: needs the right to mount, as root in a VM or container has)."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small file system here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.slow
def test_a_full_disk_under_a_checkpointing_process_is_one_line_exit_74(small_disk):
    """The saving processes' DCP writers meet a full disk: their OSError does not survive the way back ("unexpected
    pos 704 vs 598", a traceback on each rank), so a failure on a full file system is said as its ENOSPC: one line,
    exit 74, the checkpoint's temporary folder gone, those before it whole."""
    run_dir = small_disk / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    full = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "ampctl", "train",
         "device=cpu", "recipe=gpt", "recipe.n_layers=4", "recipe.d_model=256", "recipe.batch_size=4",
         "train.steps=40", "train.log_every=2", "train.checkpoint.every=2", "train.checkpoint.keep=100",
         "train.console=quiet", "distributed=fsdp", "distributed.async_checkpoint=true",
         "distributed.async_checkpointer=process", "telemetry.profile_cpu_memory=false", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, timeout=300, cwd=small_disk.parent, env=env)
    said = [line for line in full.stderr.splitlines() if line.startswith("ampctl train:")]
    assert said and all(re.fullmatch(rf"ampctl train: error: cannot write {run_dir}/checkpoints/step_\d+\.dcp\.tmp: "
                                     r"No space left on device; the checkpoints written before it are whole "
                                     r"\(resume=auto continues from the newest once it can write\)", line)
                        for line in said), full.stderr
    assert "exitcode  : 74" in full.stderr and "[rank" not in full.stderr and "unexpected pos" not in full.stderr
    assert not list(run_dir.glob("checkpoints/*.tmp")) and list(run_dir.glob("checkpoints/step_*.dcp"))


def test_the_buffer_crosses_to_the_saving_process_once_and_again_only_when_made_anew(tmp_path):
    """A real saving process: the second save of states of the same size sends no buffer (the process keeps the
    first: no handle to fetch, where a kill would meet multiprocessing's resource sharer mid-fetch and print its
    traceback), larger states a new one; each checkpoint holds its own states."""
    from ampctl.engine.parallel import Parallel
    from ampctl.runner.checkpointing.checkpoint_process import SavingProcess

    process = SavingProcess(Parallel(), timeout_s=60)
    pipe, handed = process._pipe, []

    class Watched:  # the pipe, telling whether each save carried a buffer
        def send(self, message):
            handed.append(message != "stop" and message[0] is not None)
            pipe.send(message)

        def __getattr__(self, name):
            return getattr(pipe, name)

    process._pipe = Watched()
    states = [{"w": torch.full((64,), 1.0)}, {"w": torch.full((64,), 2.0)}, {"w": torch.full((4096,), 3.0)}]
    try:
        for i, state in enumerate(states):
            process.save({"model": state}, str(tmp_path / f"step_{i}.dcp")).result(timeout=60)
    finally:
        process.close()
    assert handed[:3] == [True, False, True]
    for i, state in enumerate(states):
        back = {"model": {"w": torch.empty_like(state["w"])}}
        dcp.load(back, checkpoint_id=str(tmp_path / f"step_{i}.dcp"), no_dist=True)
        assert torch.equal(back["model"]["w"], state["w"])
