"""distributed.async_checkpointer=process: each rank's sharded checkpoint written by DCP in a process of its own,
so that the writing (DCP's planning and pickling, the file writes) never contends with training for the GIL, as the
thread does (pytorch#147039).

The training process copies its states into shared CPU memory (the only part the step waits for) and hands them
over through a pipe (torch's pickler passes shared memory as a handle, not its bytes); the saving process runs
`torch.distributed.checkpoint.save` with the other ranks' saving processes over a gloo process group of their own
(its store on rank 0, its address torchrun's MASTER_ADDR), and answers with the outcome.

Not DCP's own `async_save(..., async_checkpointer_type=PROCESS)`, which does the same, measured side by side
(benchmarks/checkpoint_process_vs_dcp.py, one rank, torch 2.14.1, 3 alternating rounds): DCP's process prints on
the terminal three INFO lines at its start and four a checkpoint on each rank (its child adds a handler to the root
logger at INFO; nothing public turns it off), there is no public way to end it (a private module global; on torch
2.11 each rank's end printed its EOFError traceback), and it stages every save into new memory: the step waited 120
ms a save for 512 MiB of states against this one's 29 ms (12 against 7 ms for 64 MiB), which copies into the same
shared buffer each time; on disk 2.06 s against 1.71 s. Its first save waits less (123 against 435 ms: this one
makes its shared buffer then). This one says nothing, ends when told or when its parent is gone, and raises a full
disk as the OSError it is.

A sharded tensor (FSDP's DTensor, one dimension of ranks) travels as its local shard with its placements, global
shape and stride, and is made a DTensor again on the saving processes' own mesh of the same ranks.
"""

from __future__ import annotations

import errno
import os
import re
import signal
from concurrent.futures import Future
from dataclasses import dataclass
from threading import Thread
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from ampctl.errors import RankStopped, RunStopped, full_disk_at, refused_write_inside

if TYPE_CHECKING:  # annotations only: the ranks' interface is the engine's
    from ampctl.engine.parallel import Parallel

_STOP = "stop"
SHARED_MEMORY = "/dev/shm"  # where torch's shared CPU tensors live (files of a tmpfs) on Linux


@dataclass(frozen=True)
class _Place:
    """Where a tensor's copy lies in the shared buffer: the buffer crosses the pipe once, as one handle, and each
    tensor as its place in it (a handle per tensor would take a file descriptor each on both sides)."""

    offset: int
    dtype: torch.dtype
    shape: tuple

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        nbytes = self.dtype.itemsize * int(torch.Size(self.shape).numel())
        return buffer[self.offset:self.offset + nbytes].view(self.dtype).view(self.shape)


@dataclass
class _Shard:
    """A DTensor's local part on its way to the saving process: what makes it a DTensor again there."""

    local: _Place
    placements: tuple
    shape: tuple
    stride: tuple


class SavingProcess:
    """This rank's saving process. Created by every rank together (a collective: rank 0's store address is
    broadcast), like the thread's process group."""

    def __init__(self, parallel: Parallel, timeout_s: int) -> None:
        import torch.multiprocessing as mp  # registers torch's reductions: shared tensors cross as handles

        self._parallel = parallel
        rank, world_size = parallel.rank, parallel.world_size
        self._store = None
        address: Optional[tuple[str, int]] = None
        if world_size > 1:
            if rank == 0:  # the saving processes meet at a store this process keeps for them
                self._store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
                address = (os.environ.get("MASTER_ADDR", "127.0.0.1"), self._store.port)
            address = parallel.main_value(address)
        context = mp.get_context("spawn")
        self._pipe, child_end = context.Pipe()
        self._process = context.Process(target=_serve, args=(child_end, address, rank, world_size, timeout_s),
                                        name=f"ampctl-checkpoint-rank{rank}", daemon=True)
        self._process.start()
        child_end.close()  # a recv() here fails at once if the saving process dies
        self._buffer: Optional[torch.Tensor] = None  # the shared memory the last save was copied into
        # the buffer the saving process holds: a buffer crosses the pipe once (its handle's file descriptor is
        # served by multiprocessing's resource sharer, whose thread prints a traceback where the saving process dies
        # while it fetches one: only a new buffer's handover can meet a kill there)
        self._handed: Optional[torch.Tensor] = None

    def save(self, state_dict: dict[str, Any], checkpoint_id: str) -> Future:
        """The states copied into shared memory now (training may change them after this returns); written by the
        saving process. The future's result is None, or the saving process's failure raised here. The caller
        waits for the previous save's future first: its shared copies are then free to be written again. Every
        rank calls it (a collective): a rank that cannot hand its states over (shared memory too small) ends every
        rank here, before any saving process starts a save that could not be finished."""
        failure: Optional[OSError] = None
        try:
            staged, self._buffer = _staged(state_dict, self._buffer)
        except OSError as exc:
            failure = exc
        if self._parallel.agree(failure is not None):
            raise failure or RunStopped("another rank could not hand its checkpoint over to its saving process "
                                        "(that rank's line says why)")
        try:
            self._pipe.send((self._buffer if self._buffer is not self._handed else None, staged, checkpoint_id))
        except OSError:  # BrokenPipeError: it is gone (killed), not stdout's reader
            raise self._gone("before this checkpoint was handed to it") from None
        self._handed = self._buffer
        written: Future = Future()
        Thread(target=self._answer, args=(written,), name="ampctl-checkpoint-answer", daemon=True).start()
        return written

    def _gone(self, when: str) -> RankStopped:
        """The run's stop when its saving process died (a kill, the machine's OOM killer): the checkpoints it wrote
        before are whole (each committed by its metadata file, last)."""
        self._process.join(timeout=5)
        code = self._process.exitcode
        how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 and -code in
               signal.valid_signals() else f"exit code {code}")
        return RankStopped(f"rank {self._parallel.rank}'s checkpoint saving process died ({how}) {when}; the "
                          "checkpoints it wrote before are whole: resume=auto continues from the newest")

    def _answer(self, written: Future) -> None:
        try:
            answer = self._pipe.recv()
        except (EOFError, OSError):
            written.set_exception(self._gone("before it said this checkpoint was written"))
            return
        if answer is None:
            written.set_result(None)
        else:
            written.set_exception(_raised(answer))

    def close(self) -> None:
        """Ends the saving process (after the pending save: a caller waits for its future first) and the store."""
        try:
            self._pipe.send(_STOP)
        except (BrokenPipeError, OSError):
            pass  # it has ended already
        self._process.join(timeout=60)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join()
        self._pipe.close()
        self._store = None


ALIGNMENT = 64  # bytes: each tensor's place in the shared buffer starts at a multiple (any dtype's alignment)


def _staged(state_dict: dict[str, Any], buffer: Optional[torch.Tensor]) -> tuple[Any, torch.Tensor]:
    """Every tensor of the state dict (a DTensor's local shard) copied into one buffer of shared CPU memory, and the
    state dict with each tensor's place in it instead: the previous save's buffer where it is large enough (made
    once, it crosses the pipe once: the saving process keeps it), a new one otherwise."""
    tensors = list(_local_tensors(state_dict))
    places, end = [], 0
    for tensor in tensors:
        places.append(_Place(end, tensor.dtype, tuple(tensor.shape)))
        end += -(-tensor.numel() * tensor.element_size() // ALIGNMENT) * ALIGNMENT
    if buffer is None or buffer.numel() < end:
        buffer = _shared_bytes(max(end, 1))
    for tensor, place in zip(tensors, places):
        place.view(buffer).copy_(tensor.detach())
    return _with_places(state_dict, iter(places)), buffer


def _local_tensors(value: Any) -> Any:
    """Every tensor of the state dict, in order (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        if value.device_mesh.ndim != 1:
            raise NotImplementedError("a checkpoint's saving process takes DTensors on one dimension of ranks")
        yield value.to_local()
    elif isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _local_tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _local_tensors(item)


def _with_places(value: Any, places: Any) -> Any:
    """The state dict's structure with its tensors replaced, in _local_tensors' order, by their places."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return _Shard(next(places), tuple(value.placements), tuple(value.shape), tuple(value.stride()))
    if isinstance(value, torch.Tensor):
        return next(places)
    if isinstance(value, dict):
        return {key: _with_places(item, places) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_with_places(item, places) for item in value)
    return value


def _shared_bytes(nbytes: int) -> torch.Tensor:
    try:
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()
    except RuntimeError as exc:  # torch's "unable to resize file <...> to the right size: No space left (28)"
        number = re.search(r"\((\d+)\)\s*$", str(exc).strip())
        raise OSError(int(number.group(1)) if number else errno.ENOSPC,
                      f"{os.strerror(int(number.group(1))) if number else 'full'} (the states are handed to the "
                      "saving process in shared memory; give it more, as a container's --shm-size, or use "
                      "distributed.async_checkpointer=thread)", SHARED_MEMORY) from None


def _raised(answer: tuple) -> BaseException:
    kind, *details = answer
    if kind == "refused":
        number, reason, filename = details
        return OSError(number, reason, filename)
    return RuntimeError(f"the checkpoint's saving process failed: {details[0]}")


def _serve(pipe: Any, address: Optional[tuple[str, int]], rank: int, world_size: int, timeout_s: int) -> None:
    """The saving process: joins the other ranks' saving processes, then saves what it is sent until told to stop
    or its parent is gone (the pipe closed: it ends without a word). The signals that stop a run (a Ctrl-C reaches
    the terminal's whole process group, a cluster's preemption every process of the job) are its parent's to
    handle: the parent's stop checkpoint is written through this process, which ends when told."""
    import signal
    import warnings

    # as in the training process (sharded_checkpoint.py): DCP warns that one process saves alone, as it is told to
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                            category=UserWarning)
    for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(stop, signal.SIG_IGN)
    try:
        mesh = _joined(address, rank, world_size, timeout_s)
        failure = None
    except Exception as exc:  # noqa: BLE001 - said as the answer to each request
        mesh, failure = None, ("failed", f"it could not join the other ranks' ({type(exc).__name__}: {exc})")
    buffer = None  # the shared buffer, sent with the first save and again only where it was made anew
    try:
        while True:
            try:
                request = pipe.recv()
            except (EOFError, OSError):
                return
            if request == _STOP:
                return
            handed, state_dict, checkpoint_id = request
            buffer = handed if handed is not None else buffer
            pipe.send(failure or _saved(buffer, state_dict, checkpoint_id, mesh))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _joined(address: Optional[tuple[str, int]], rank: int, world_size: int, timeout_s: int) -> Any:
    """The saving processes' process group and their mesh of the ranks (None for one process)."""
    import datetime

    if address is None:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address[0], address[1], is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("ampctl-checkpoint", store), rank=rank,
                            world_size=world_size, timeout=timeout)
    return init_device_mesh("cpu", (world_size,))


def _saved(buffer: torch.Tensor, state_dict: dict[str, Any], checkpoint_id: str, mesh: Any) -> Optional[tuple]:
    """DCP's save of what was sent (the shared buffer, the state dict with its tensors' places in it); None, or the
    failure as the training process raises it (picklable)."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.save(_unstaged(state_dict, buffer, mesh), checkpoint_id=checkpoint_id, no_dist=mesh is None)
        return None
    except BaseException as exc:  # noqa: BLE001 - every failure goes back (DCP's CheckpointException is a BaseException)
        refused = refused_write_inside(exc) or full_disk_at(checkpoint_id)
        if refused is not None:
            return "refused", refused.errno, refused.strerror, refused.filename
        return "failed", f"{type(exc).__name__}: {exc}"


def _unstaged(value: Any, buffer: torch.Tensor, mesh: Any) -> Any:
    """The state dict's tensors as views of the shared buffer (a DTensor made again on the saving processes' mesh)."""
    if isinstance(value, _Place):
        return value.view(buffer)
    if isinstance(value, _Shard):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(value.local.view(buffer), mesh, value.placements, run_check=False,
                                  shape=torch.Size(value.shape), stride=value.stride)
    if isinstance(value, dict):
        return {key: _unstaged(item, buffer, mesh) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_unstaged(item, buffer, mesh) for item in value)
    return value
