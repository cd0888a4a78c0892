"""Checkpoints that let a run continue exactly: save (atomic), find, load (checked), restore.

A checkpoint holds everything the next step depends on: model, fp32 masters (O2), optimizer, loss scaler,
lr schedule, RNG states, the step, the data position (batches consumed) and the config that made it.
It is written to a temporary file in the same directory, fsynced, then renamed over its final name, so a
crash at any moment leaves the previous checkpoints whole. Beside it, `step_N.pt.sha256` (sha256sum's format)
is checked before every load: a checkpoint that changed on disk is refused, and a resume of a run passes over
to its newest good one. Only plain containers and tensors are stored, so it loads with
torch.load(weights_only=True).
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Optional

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from ampctl import io
from ampctl.engine.loop import TrainState
from ampctl.errors import UsageError

FORMAT_VERSION = 1
CHECKPOINT_DIR = "checkpoints"
CHECKSUM_SUFFIX = ".sha256"  # beside each checkpoint, in sha256sum's format
_NAME = re.compile(r"^step_(\d{8})\.pt$")

# Keys a resumed run may change; any other difference from the checkpoint's config is refused. distributed.*:
# a checkpoint holds the full state, which one process, DDP or FSDP on any number of ranks loads (the resume
# line says how the global batch changes).
SAFE_TO_CHANGE = (
    "train.steps", "train.log_every", "train.console", "train.checkpoint_every", "train.checkpoint_every_s",
    "train.keep_checkpoints", "train.preempt_signal",
    "train.timing_warmup_steps", "telemetry.profile_cpu_memory", "distributed.", "resume",
)


# --- RNG ------------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    version, mt_state, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": [version, list(mt_state), gauss],
        "numpy": [np_kind, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss, np_gauss],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, mt_state, gauss = state["python"]
    random.setstate((version, tuple(mt_state), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


# --- save -----------------------------------------------------------------------------------------


def capture(state: TrainState, cfg: DictConfig, choices: dict[str, str], batches_consumed: int,
            skipped_total: int) -> dict[str, Any]:
    """The checkpoint's payload. Reads the device (scaler scale, lr count): called between steps only, on
    every rank (gathering sharded states is a collective); rank 0's payload is the one saved."""
    model_state, optimizer_state = state.parallel.full_state(state.model, state.optimizer)
    return {
        "format_version": FORMAT_VERSION,
        "step": state.step,
        "batches_consumed": batches_consumed,
        "skipped_total": skipped_total,
        "world_size": state.parallel.world_size,  # a resume on another number of ranks changes the global batch
        "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        "choices": dict(choices),  # the config groups chosen (recipe=gpt): a resumed run reports the same names
        "model": model_state,
        "weights": state.weights.state_dict(),
        "optimizer": optimizer_state,
        "scaler": state.scaler.state_dict(),
        "schedule": state.schedule.state_dict(),
        "rng": rng_state(),
    }


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Hashing:
    """A file that hashes what is written through it: torch.save writes its zip archive sequentially, so the
    digest is the file's own, computed without reading the checkpoint back."""

    def __init__(self, file: BinaryIO) -> None:
        self.file, self.digest = file, hashlib.sha256()
        self.error: Optional[OSError] = None  # torch's writer turns an OSError into an unhelpful RuntimeError

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.file.flush()


def checksum_path(path: Path) -> Path:
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def save_atomic(payload: dict[str, Any], path: Path) -> None:
    """Write, fsync, checksum, rename: a crash at any moment leaves the earlier checkpoints whole; a failed
    write (a full disk) leaves no temporary file."""
    tmp = path.with_name(path.name + ".tmp")
    hashing: Optional[_Hashing] = None
    try:
        with tmp.open("wb") as f:
            hashing = _Hashing(f)
            torch.save(payload, hashing)
            f.flush()
            os.fsync(f.fileno())
        # `sha256sum -c step_N.pt.sha256` checks it by hand; written first, so no checkpoint exists without it
        io.atomic_write_text(checksum_path(path), f"{hashing.digest.hexdigest()}  {path.name}\n")
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        error = exc if isinstance(exc, OSError) else hashing.error if hashing is not None else None
        if error is not None and (error is not exc or error.filename is None):  # a full disk, named
            raise OSError(error.errno, error.strerror, str(tmp)) from None
        raise
    _fsync_dir(path.parent)  # the rename itself survives a power cut


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINT_DIR / f"step_{step:08d}.pt"


def checkpoint_step(path: Path) -> int:
    return int(_NAME.match(path.name).group(1))  # type: ignore[union-attr]


def list_checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run, oldest first (temporary files of an interrupted write excluded)."""
    folder = run_dir / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _NAME.match(p.name))


def save(payload: dict[str, Any], run_dir: Path, keep: int) -> Path:
    path = checkpoint_path(run_dir, payload["step"])
    path.parent.mkdir(parents=True, exist_ok=True)
    save_atomic(payload, path)
    for old in list_checkpoints(run_dir)[:-keep]:
        remove(old)
    return path


def remove(path: Path) -> None:
    path.unlink()
    checksum_path(path).unlink(missing_ok=True)


def move(path: Path, folder: Path) -> None:
    """A checkpoint and its checksum into folder (a set-aside timeline)."""
    if checksum_path(path).is_file():
        checksum_path(path).rename(folder / checksum_path(path).name)
    path.rename(folder / path.name)


def remove_stale_files(run_dir: Path) -> list[Path]:
    """What a killed write left: temporary files (`*.tmp`) beside the checkpoints and the run's records, and
    a checksum whose checkpoint was never renamed into place. Removed at the start of a run; returned."""
    folder = run_dir / CHECKPOINT_DIR
    stale = [*run_dir.glob("*.tmp"), *folder.glob("*.tmp")]
    sums = folder.glob(f"*.pt{CHECKSUM_SUFFIX}")
    stale += [p for p in sums if not p.with_name(p.name.removesuffix(CHECKSUM_SUFFIX)).exists()]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


# --- find and load --------------------------------------------------------------------------------


@dataclass
class Found:
    """The checkpoint a resume loads, and the newer ones it passed over because they failed their check."""

    path: Path
    config: dict[str, Any]
    choices: dict[str, str]
    passed_over: list[str]


def resolve_resume(target: str, run_dir: Path) -> Optional[Found]:
    """The checkpoint named by resume=...: a file as given; for a run directory or auto (this run dir), the
    newest that passes its check, newer ones that fail it passed over (said, and set aside by the run).
    None for resume=auto when this run dir has no checkpoint yet. UsageError when none is good."""
    if target == "auto":
        return _newest_good(list_checkpoints(run_dir), f"resume=auto ({run_dir})")
    path = Path(target).expanduser()
    if path.is_file():
        payload = load(path, mmap=True)
        return Found(path, payload["config"], payload.get("choices") or {}, [])
    if path.is_dir():
        found = list_checkpoints(path)
        if not found:
            raise UsageError(f"resume={target!r} holds no checkpoint ({CHECKPOINT_DIR}/step_*.pt)")
        return _newest_good(found, f"resume={target}")
    raise UsageError(f"resume={target!r} does not exist; give a run directory, a checkpoint file, or auto")


def _newest_good(candidates: list[Path], what: str) -> Optional[Found]:
    failures: list[str] = []
    for path in reversed(candidates):
        try:
            payload = load(path, mmap=True)  # checked against its checksum; the tensors stay on disk
        except UsageError as exc:
            failures.append(str(exc))
            continue
        return Found(path, payload["config"], payload.get("choices") or {}, failures)
    if failures:
        raise UsageError(f"{what}: no checkpoint passes its check: {'; '.join(failures)}")
    return None


def run_dir_of(checkpoint: Path) -> Path:
    return checkpoint.resolve().parent.parent


def load(path: Path, mmap: bool = False) -> dict[str, Any]:
    """The checkpoint's payload, checked against its checksum first (UsageError when it fails or cannot be
    read). mmap: tensors stay on disk until used."""
    verify(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - any failure to read is the same answer for the user
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"checkpoint {str(path)!r} cannot be read (truncated or corrupt?): {reason}") from None
    if not isinstance(payload, dict) or payload.get("format_version") != FORMAT_VERSION:
        raise UsageError(f"checkpoint {str(path)!r} is not an ampctl checkpoint of format {FORMAT_VERSION}")
    return payload


def verify(path: Path) -> None:
    """The file against its `.sha256` (none: a checkpoint written by hand, checked only by torch.load)."""
    sidecar = checksum_path(path)
    if not sidecar.is_file():
        return
    stat = path.stat()
    expected = sidecar.read_text(encoding="utf-8").split()[0] if sidecar.stat().st_size else ""
    if _sha256(str(path), stat.st_mtime_ns, stat.st_size) != expected:
        raise UsageError(f"checkpoint {str(path)!r} does not match its checksum ({sidecar.name}): it changed on "
                         "disk (a bit flip, a truncation)")


@functools.lru_cache(maxsize=8)
def _sha256(path: str, _mtime_ns: int, _size: int) -> str:
    """Cached per file version: the check before Hydra writes and the run's own load read it once."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def config_changes(saved: dict[str, Any], cfg: DictConfig) -> list[str]:
    """The safe differences between the checkpoint's config and this one; raises UsageError on any other."""
    old = _flatten(saved)
    new = _flatten(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    changes = []
    # a mode's or a class's name first: "precision.name was 'fp16'" says more than one of its fields
    for key in sorted(old.keys() | new.keys(), key=lambda k: (not k.endswith((".name", "._target_")), k)):
        if old.get(key) == new.get(key):
            continue
        if not key.startswith(SAFE_TO_CHANGE):
            raise UsageError(
                f"resume: {key} was {old.get(key)!r} in the checkpoint and is {new.get(key)!r} now; a resumed run "
                f"must keep its model, precision, scaler, optimizer, recipe and data (may change: "
                f"{', '.join(k + '*' if k.endswith('.') else k for k in SAFE_TO_CHANGE if k != 'resume')})"
            )
        if key != "resume":
            changes.append(f"{key}: {old.get(key)!r} -> {new.get(key)!r}")
    return changes


def restore(payload: dict[str, Any], state: TrainState) -> None:
    """Load a checkpoint into a freshly built state (same config), so the next step is the one that follows."""
    state.weights.load_state_dict(payload["weights"])
    # The lr tensors of fused optimizers are the schedule's own device tensors: keep them, not the saved copies.
    lrs = [group["lr"] for group in state.optimizer.param_groups]
    state.parallel.load_full_state(state.model, state.optimizer, payload["model"], payload["optimizer"])
    for group, lr in zip(state.optimizer.param_groups, lrs):
        group["lr"] = lr
    state.scaler.load_state_dict(payload["scaler"])
    state.schedule.load_state_dict(payload["schedule"])
    state.step = payload["step"]
    set_rng_state(payload["rng"])
