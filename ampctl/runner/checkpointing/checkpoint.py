"""Checkpoints that let a run continue exactly: capture, save, find, load (checked), restore.

A checkpoint holds everything the next step depends on: model, fp32 masters (O2), optimizer, loss scaler,
lr schedule, RNG states, the step, the data position (batches consumed) and the config that made it.
It is written whole or not at all and checksummed (checkpoint_files.py); the checksum is checked before
every load: a checkpoint that changed on disk is refused, and a resume of a run passes over to its newest
good one. Only plain containers and tensors are stored, so it loads with torch.load(weights_only=True).

Two formats (distributed.checkpoint_format): `step_N.pt`, one file holding the whole state (gathered on rank
0 under FSDP), and `step_N.dcp/`, a torch.distributed.checkpoint directory of per-rank shards
(sharded_checkpoint.py). Either resumes under any parallelism on any number of ranks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from ampctl import run_files
from ampctl.conf.migration import CONFIG_VERSION, migrated
from ampctl.conf.schema import CheckpointFormat
from ampctl.engine import optimizer_states
from ampctl.errors import UsageError
from ampctl.runner import identity as run_identity
from ampctl.runner.checkpointing import sharded_checkpoint
from ampctl.runner.checkpointing.checkpoint_files import (
    cached_sha256,
    checkpoint_path,
    checksum_path,
    is_checkpoint,
    is_sharded,
    list_checkpoints,
    prune,
    run_dir_of,
    save_atomic,
)
from ampctl.runner.identity import SAFE_TO_CHANGE, RunIdentity, flatten
from ampctl.runner.rank_zero import told_to_every_rank

if TYPE_CHECKING:  # annotations only: the state's class is the engine's
    from ampctl.engine.loop import TrainState
    from ampctl.engine.parallel import Parallel

FORMAT_VERSION = 1

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
            skipped_total: int, sharded: bool, identity: RunIdentity) -> dict[str, Any]:
    """The checkpoint's payload. Reads the device (scaler scale, lr count): called between steps only, on
    every rank (gathering sharded states is a collective). sharded: the model and optimizer states as each
    rank holds them (every rank writes its own); else whole, and rank 0's payload is the one saved."""
    if sharded:
        model_state, optimizer_state = sharded_checkpoint.state_dicts(state)
    else:
        model_state, optimizer_state = state.parallel.full_state(state.model, state.optimizer)
        optimizer_state = optimizer_states.plain_states(optimizer_state)
    return {
        "format_version": FORMAT_VERSION,
        "config_version": CONFIG_VERSION,  # the layout of "config" (conf/migration.py)
        "run_id": identity.run_id,  # resume=auto takes only its own run's checkpoints (runner/identity.py)
        "config_hash": identity.config_hash,
        "step": state.step,
        "batches_consumed": batches_consumed,
        "skipped_total": skipped_total,
        "world_size": state.parallel.world_size,  # a resume on another number of ranks changes the global batch
        "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
        "choices": dict(choices),  # the config groups chosen (recipe=gpt): a resumed run reports the same names
        "model": model_state,
        "weights": state.weights.state_dict(),
        "optimizer": optimizer_state,
        # the fp32 weight average: as held in a sharded checkpoint (DCP writes each rank's shards), else whole
        "ema": None if state.ema is None else state.ema.state_dict(whole=not sharded),
        "scaler": state.scaler.state_dict(),
        "schedule": state.schedule.state_dict(),
        "rng": rng_state(),
    }


class FullWriter:
    """Saves checkpoints as one file each, written by rank 0 (the others' payloads are the same state); every rank
    calls save() and meets how rank 0's write ended (a full disk ends every rank)."""

    def __init__(self, run_dir: Path, keep: int, parallel: Parallel,
                 on_saved: Optional[Callable[[Path], None]] = None) -> None:
        self.run_dir, self.keep, self.parallel, self.on_saved = run_dir, keep, parallel, on_saved

    def save(self, payload: dict[str, Any]) -> Path:
        path = checkpoint_path(self.run_dir, payload["step"])

        def write() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_atomic(payload, path)
            prune(self.run_dir, self.keep)
            if self.on_saved is not None:
                self.on_saved(path)

        told_to_every_rank(self.parallel, f"the checkpoint {path.name}", write)
        return path

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


def writer(cfg: DictConfig, run_dir: Path, state: TrainState,
           on_saved: Optional[Callable[[Path], None]] = None) -> "FullWriter | Any":
    """The writer of distributed.checkpoint_format: save(payload) -> path; finish() at a run's good end, on every rank
    (an async save completed and agreed); close() always (this rank's pending write completed); on_saved(path) on
    rank 0 once a checkpoint is whole and in place (an async one: from the writer's thread)."""
    keep = cfg.train.checkpoint.keep
    if cfg.distributed.checkpoint_format is CheckpointFormat.sharded:
        background = cfg.distributed.async_checkpointer if cfg.distributed.async_checkpoint else None
        return sharded_checkpoint.ShardedWriter(run_dir, keep, state, background, on_saved,
                                                cfg.distributed.timeout_s)
    return FullWriter(run_dir, keep, state.parallel, on_saved)


# --- find and load --------------------------------------------------------------------------------


@dataclass
class Found:
    """The checkpoint a resume loads (checked against its checksum and loaded once, its tensors mapped from
    disk), and the newer ones it passed over because they failed their check."""

    path: Path
    payload: dict[str, Any]
    passed_over: list[str]

    @property
    def config(self) -> dict[str, Any]:
        return self.payload["config"]

    @property
    def choices(self) -> dict[str, str]:
        return self.payload.get("choices") or {}


def resolve_resume(target: str, run_dir: Path) -> Optional[Found]:
    """The checkpoint named by resume=...: a file as given; for a run directory or auto (this run dir), the
    newest that passes its check and belongs to the directory's run, newer ones that do not passed over (said,
    and set aside by the run). None for resume=auto when this run dir has no checkpoint yet. UsageError when
    none is good."""
    if target == "auto":
        return _newest_good(list_checkpoints(run_dir), run_dir, f"resume=auto ({run_dir})")
    path = Path(target).expanduser()
    if path.is_file() or is_checkpoint(path):
        payload = load(path, mmap=True)
        owner = run_identity.read(run_dir_of(path))
        if owner is None:
            refuse_without_identity(run_dir_of(path), payload)
        why = owner.disowns(payload) if owner else None
        if why:
            raise UsageError(f"resume={target}: {why}; a checkpoint continues only its own run")
        return Found(path, payload, [])
    if path.is_dir():
        found = list_checkpoints(path)
        if not found:
            raise UsageError(f"resume={target!r} holds no checkpoint ({run_files.CHECKPOINTS}/step_*.pt)")
        return _newest_good(found, path, f"resume={target}")
    raise UsageError(f"resume={target!r} does not exist; give a run directory, a checkpoint file, or auto")


def _newest_good(candidates: list[Path], run_dir: Path, what: str) -> Optional[Found]:
    owner = run_identity.read(run_dir)  # None: a directory of a run made before identities, any checkpoint
    failures: list[str] = []
    for path in reversed(candidates):
        try:
            payload = load(path, mmap=True)  # checked against its checksum; the tensors stay on disk
        except UsageError as exc:
            failures.append(str(exc))
            continue
        if owner is None:
            refuse_without_identity(run_dir, payload)
        why = owner.disowns(payload) if owner else None
        if why:
            failures.append(f"checkpoint {str(path)!r}: {why}")
            continue
        return Found(path, payload, failures)
    if failures:
        raise UsageError(f"{what}: no checkpoint passes its check: {'; '.join(failures)}")
    return None


def refuse_without_identity(run_dir: Path, payload: dict[str, Any]) -> None:
    """A directory without identity.json resumes from its checkpoints only if it is a run made before identities
    (checkpoints without a run id). One whose checkpoints carry a run id lost its identity (removed, or a run
    copied in without it): it cannot tell its own checkpoints and config from another run's, and is refused."""
    run_id = payload.get("run_id")
    if run_id is not None:
        raise UsageError(
            f"{run_dir} holds checkpoints of run {str(run_id)[:8]} but not its {run_files.IDENTITY} (removed or lost): "
            "without it a resume cannot tell the run's own checkpoints and config from another run's; restore "
            f"{run_files.IDENTITY}, or start a new run in another hydra.run.dir")


def load(path: Path, mmap: bool = False) -> dict[str, Any]:
    """The checkpoint's payload, checked against its checksum first (UsageError when it fails or cannot be
    read). mmap: tensors stay on disk until used. A sharded checkpoint's payload holds all but the model and
    optimizer states, which restore() loads from its shards."""
    verify(path)
    try:
        if is_sharded(path):
            payload = sharded_checkpoint.load_state(path)
        else:
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - any failure to read is the same answer for the user
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"checkpoint {str(path)!r} cannot be read (truncated or corrupt?): {reason}") from None
    if not isinstance(payload, dict) or payload.get("format_version") != FORMAT_VERSION:
        raise UsageError(f"checkpoint {str(path)!r} is not an ampctl checkpoint of format {FORMAT_VERSION}")
    if (payload.get("config_version") or 1) < CONFIG_VERSION and isinstance(payload.get("config"), dict):
        # written by an earlier ampctl: its config as today's, and the run's hash taken again of today's keys (as
        # its identity's is: runner/identity.read)
        payload["config"] = migrated(payload["config"], payload.get("config_version"))
        if payload.get("config_hash") is not None:
            payload["config_hash"] = run_identity.config_hash(payload["config"])
    return payload


def verify(path: Path) -> None:
    """The file against its `.sha256`, a sharded checkpoint's files against its SHA256SUMS. A checkpoint
    without its checksum is not trusted: refused, saying how to trust it on purpose."""
    if is_sharded(path):
        bad = sharded_checkpoint.verify(path)
        if bad is not None:
            raise UsageError(f"checkpoint {str(path)!r}: {bad}")
        return
    sidecar = checksum_path(path)
    if not sidecar.is_file():
        raise UsageError(f"checkpoint {str(path)!r} has no checksum ({sidecar.name}), so a change on disk "
                         f"cannot be seen; if you trust it, write one: sha256sum {path.name} > {sidecar.name}")
    try:
        words = sidecar.read_bytes().decode("ascii").split()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"checkpoint {str(path)!r}: its checksum file {sidecar.name} cannot be read "
                         f"({type(exc).__name__}); the checkpoint cannot be checked") from None
    if cached_sha256(path) != (words[0] if words else ""):
        raise UsageError(f"checkpoint {str(path)!r} does not match its checksum ({sidecar.name}): it changed on "
                         "disk (a bit flip, a truncation)")


def config_changes(saved: dict[str, Any], cfg: DictConfig) -> list[str]:
    """The safe differences between the checkpoint's config and this one; raises UsageError on any other."""
    old = flatten(saved)
    new = flatten(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    changes = []
    # a mode's or a class's name first: "precision.name was 'fp16'" says more than one of its fields
    for key in sorted(old.keys() | new.keys(), key=lambda k: (not k.endswith((".name", "._target_")), k)):
        if old.get(key) == new.get(key) or (key not in old and new[key] == []):  # a list newer than the record
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


def restore(payload: dict[str, Any], state: TrainState, source: Path) -> None:
    """Load a checkpoint (payload, read from source) into a freshly built state (same config), so the next
    step is the one that follows."""
    state.weights.load_state_dict(payload["weights"])
    # The lr tensors of fused optimizers are the schedule's own device tensors: keep them, not the saved copies.
    lrs = [group["lr"] for group in state.optimizer.param_groups]
    if is_sharded(source):
        sharded_checkpoint.load_into(source, state)
    else:
        state.parallel.load_full_state(state.model, state.optimizer, payload["model"],
                                       optimizer_states.quantized_states(payload["optimizer"],
                                                                         state.parallel.shards_gradients))
        if state.ema is not None:
            state.ema.load_state_dict(payload["ema"])
    for group, lr in zip(state.optimizer.param_groups, lrs):
        group["lr"] = lr
    state.scaler.load_state_dict(payload["scaler"])
    state.schedule.load_state_dict(payload["schedule"])
    state.step = payload["step"]
    set_rng_state(payload["rng"])
