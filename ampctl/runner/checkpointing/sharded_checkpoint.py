"""Sharded checkpoints through torch.distributed.checkpoint (DCP): each rank writes its own shard of the model
and optimizer states, so a model whose full state does not fit one host's memory is saved without gathering
it; DCP reshards on load, so a job of another size, or one process, resumes from it.

Layout: `checkpoints/step_N.dcp/` holds DCP's files (`.metadata`, `__<rank>_<i>.distcp`), `state.pt` (the
rest of the payload: step, config, scaler, schedule, RNG, fp32 masters; small, written by rank 0) and
`SHA256SUMS` (sha256sum's format, every other file; `sha256sum -c SHA256SUMS` inside checks it by hand).
It is written as `step_N.dcp.tmp/` and renamed into place by rank 0 once every rank's shard is on disk, so
a crash at any moment leaves the earlier checkpoints whole.

Async (distributed.async_checkpoint): DCP copies the states to CPU memory, then writes them in a background
thread, whose collectives run over a gloo process group of their own so that they never interleave with
training's; training goes on meanwhile. With distributed.async_checkpointer=process a process of its own on each
rank writes them (runner/checkpointing/checkpoint_process.py). The next save and the end of the run wait for it (as
torchtitan's
async mode does).
"""

from __future__ import annotations

import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

from ampctl import io
from ampctl.conf.schema import AsyncCheckpointer
from ampctl.errors import UsageError, naming_refused_writes
from ampctl.runner.checkpointing import checkpoint_files
from ampctl.runner.checkpointing.checkpoint_process import SavingProcess
from ampctl.runner.rank_zero import told_to_every_rank

if TYPE_CHECKING:  # annotations only: the state's class is the engine's
    from ampctl.engine.loop import TrainState

STATE_FILE = "state.pt"
MANIFEST = "SHA256SUMS"
SHARDED = ("model", "optimizer", "ema")  # the payload's entries DCP writes (those set); the rest goes to state.pt

# DCP warns that it "assumes the intent" to work in a single process even when told so (no_dist=True); the
# async writer's thread warns too, so the filter is the process's, for this message only.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)


def state_dicts(state: TrainState) -> tuple[dict, dict]:
    """The model's and optimizer's state dicts as they are held, sharded under FSDP (DTensors), keyed by
    parameter name, so that they load into the same model however it is wrapped or sharded."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(state.model, state.optimizer)


def _no_dist(state: TrainState) -> bool:
    # one process (a replay on rank 0 included) reads and writes alone, process group or not
    return state.parallel.world_size == 1


class ShardedWriter:
    """Saves checkpoints as DCP directories; every rank calls save() with its payload (a collective)."""

    def __init__(self, run_dir: Path, keep: int, state: TrainState, background: Optional[AsyncCheckpointer],
                 on_saved: Optional[Callable[[Path], None]] = None, timeout_s: int = 600) -> None:
        """background: what writes a save while training goes on (None: the save is written before it returns)."""
        self.run_dir, self.keep, self.state, self.on_saved = run_dir, keep, state, on_saved
        self.is_main = state.parallel.is_main
        self._pending: Optional[Future] = None  # an async save under way, writing into _pending_path
        self._pending_path = run_dir
        self._group = None
        self._process: Optional[SavingProcess] = None
        self._executor: Optional[ThreadPoolExecutor] = None
        if background is AsyncCheckpointer.process:  # a collective: every rank starts its own here
            self._process = SavingProcess(state.parallel, timeout_s)
        elif background is AsyncCheckpointer.thread and not _no_dist(state):
            self._group = dist.new_group(backend="gloo")  # a collective: every rank builds it here
        if background is not None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ampctl-checkpoint")

    def save(self, payload: dict[str, Any]) -> Path:
        import torch.distributed.checkpoint as dcp

        self.wait()  # one save at a time: the previous one is complete (and renamed) before the next starts
        final = checkpoint_files.checkpoint_path(self.run_dir, payload["step"], sharded=True)
        tmp = final.with_name(final.name + ".tmp")
        shards = {key: payload[key] for key in SHARDED if payload.get(key) is not None}
        no_dist = _no_dist(self.state)
        try:
            if self.is_main:
                tmp.mkdir(parents=True, exist_ok=True)
                checkpoint_files.save_atomic({k: v for k, v in payload.items() if k not in SHARDED}, tmp / STATE_FILE,
                                       checksum=False)
            if self._executor is None:
                # DCP reports each rank's failure in a CheckpointException, torch's zip writer a full disk as a
                # RuntimeError ("unexpected pos") with the OSError as its context: said as that OSError, naming tmp
                with naming_refused_writes(tmp):
                    dcp.save(shards, checkpoint_id=str(tmp), no_dist=no_dist)
                told_to_every_rank(self.state.parallel, f"the checkpoint {final.name}",
                                   lambda: self._finish(tmp, final))
                return final
            if self._process is not None:
                written = self._process.save(shards, str(tmp))
            else:
                written = dcp.async_save(shards, checkpoint_id=str(tmp), process_group=self._group, no_dist=no_dist)
        except BaseException:
            _remove_what_this_node_wrote(tmp, self.run_dir)
            raise
        # rank 0's save is done when its shard and DCP's metadata are written, which DCP's coordinator does
        # after every rank reported its shard written: then it is checksummed and renamed into place
        self._pending = self._executor.submit(self._finish_after, written, tmp, final) if self.is_main else written
        self._pending_path = tmp
        return final

    def _finish_after(self, written: Future, tmp: Path, final: Path) -> None:
        try:
            with naming_refused_writes(tmp):
                written.result()
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._finish(tmp, final)

    def _finish(self, tmp: Path, final: Path) -> None:
        """Rank 0, once every shard is on disk: the checksums, the rename, the pruning of old checkpoints."""
        try:
            refuse_missing_shards(tmp)
        except UsageError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        files = sorted(p for p in tmp.iterdir() if p.is_file() and p.name != MANIFEST)
        lines = "".join(f"{checkpoint_files.file_sha256(p)}  {p.name}\n" for p in files)
        io.atomic_write_text(tmp / MANIFEST, lines)
        io.fsync_dir(tmp)
        if final.exists():  # the same step saved again (a run resumed at its last step): the newer one wins
            shutil.rmtree(final)
        tmp.rename(final)
        io.fsync_dir(final.parent)
        checkpoint_files.prune(self.run_dir, self.keep)
        if self.on_saved is not None:
            self.on_saved(final)

    def wait(self) -> None:
        """Until the pending async save is complete, on every rank together (a collective): each rank's shard
        written, then rank 0's checks and rename, whose outcome every rank meets (a refusal ends every rank)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        tmp = self._pending_path
        try:
            own: Optional[Exception] = None
            if not self.is_main:  # this rank's own shard: its failure raised after rank 0's is told (DCP fails the
                try:  # save on every rank alike; a rank that left first had rank 0 ended by torchrun, unsaid)
                    with naming_refused_writes(tmp):
                        pending.result()
                except Exception as exc:  # noqa: BLE001 - raised below, after the collective
                    own = exc
            told_to_every_rank(self.state.parallel, f"the checkpoint {tmp.name.removesuffix('.tmp')}",
                               lambda: self._result(pending, tmp))
            if own is not None:
                raise own
        except BaseException:
            _remove_what_this_node_wrote(tmp, self.run_dir)
            raise

    @staticmethod
    def _result(pending: Future, tmp: Path) -> None:
        with naming_refused_writes(tmp):
            pending.result()

    def finish(self) -> None:
        """At the run's end, on every rank together: the last async save complete and agreed (see wait)."""
        self.wait()

    def close(self) -> None:
        """This rank's part of a pending save complete, without a collective (the run may be ending in an error
        another rank did not meet; finish() agreed where it ended well); the writer's threads and group ended."""
        pending, self._pending = self._pending, None
        try:
            if pending is not None:
                self._result(pending, self._pending_path)
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._process is not None:
                self._process.close()
                self._process = None
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None


def _remove_what_this_node_wrote(tmp: Path, run_dir: Path) -> None:
    """A checkpoint that will not be finished: its temporary folder as this rank's node sees it (rank 0's node's, or
    the node-local disk another rank wrote its shard to), and the folders it made for it that hold nothing else."""
    shutil.rmtree(tmp, ignore_errors=True)
    for folder in (tmp.parent, run_dir):
        try:
            folder.rmdir()  # only when empty: a rank other than 0 made them on its own node's disk
        except OSError:
            break


def refuse_missing_shards(folder: Path) -> None:
    """Every file DCP's metadata names, whole, in the folder rank 0 sees: each rank wrote its shard into the run
    directory as its own node sees it, so on disks local to each node rank 0 holds only its node's shards, and a
    checkpoint declared whole there would fail only when a resume reads it. UsageError, naming what is missing."""
    from torch.distributed.checkpoint import FileSystemReader

    ends: dict[str, int] = {}  # storage file -> the bytes its shards need
    for info in FileSystemReader(str(folder)).read_metadata().storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    missing = sorted(name for name, end in ends.items()
                     if not (folder / name).is_file() or (folder / name).stat().st_size < end)
    if missing:
        raise UsageError(f"the checkpoint {folder.name.removesuffix('.tmp')} lacks {', '.join(missing[:3])}"
                         f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''} that other ranks wrote: "
                         f"the run directory {folder.parent.parent} is not on storage every node shares (each node "
                         "wrote its shards to its own disk); give hydra.run.dir on a shared file system "
                         "(docs/distributed.md)")


def verify(folder: Path) -> Optional[str]:
    """Why a DCP checkpoint cannot be trusted: a file that does not match its SHA256SUMS line or is missing,
    no manifest (nothing to check against), an unreadable manifest. None when every file matches."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return f"has no {MANIFEST}, so a change on disk cannot be seen"
    try:
        lines = manifest.read_bytes().decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        return f"its {MANIFEST} cannot be read ({type(exc).__name__})"
    for line in lines:
        expected, _, name = line.partition("  ")
        path = folder / name
        if not name or not path.is_file() or checkpoint_files.cached_sha256(path) != expected:
            return (f"{name or repr(line)} does not match its checksum ({MANIFEST}) or is missing: it changed on disk "
                    "(a bit flip, a truncation)")
    return None


def load_into(folder: Path, state: TrainState) -> None:
    """The model and optimizer states of a DCP checkpoint into a built state, resharded to its ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model_state, optimizer_state = state_dicts(state)
    states = {"model": model_state, "optimizer": optimizer_state}
    if state.ema is not None:  # loaded in place into the average's own tensors (resharded by DCP)
        states["ema"] = state.ema.state_dict()
    dcp.load(states, checkpoint_id=str(folder), no_dist=_no_dist(state))
    set_state_dict(state.model, state.optimizer, model_state_dict=states["model"],
                   optim_state_dict=states["optimizer"])


def load_state(folder: Path) -> Any:
    return torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True)
