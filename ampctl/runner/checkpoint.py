"""Checkpoints that let a run continue exactly: save (atomic), find, load (checked), restore.

A checkpoint holds everything the next step depends on: model, fp32 masters (O2), optimizer, loss scaler,
lr schedule, RNG states, the step, the data position (batches consumed) and the config that made it.
It is written to a temporary file in the same directory, fsynced, then renamed over its final name, so a
crash at any moment leaves the previous checkpoints whole. Only plain containers and tensors are stored,
so it loads with torch.load(weights_only=True).
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from ampctl.engine.loop import TrainState
from ampctl.errors import UsageError

FORMAT_VERSION = 1
CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^step_(\d{8})\.pt$")

# Keys a resumed run may change; any other difference from the checkpoint's config is refused.
SAFE_TO_CHANGE = (
    "train.steps", "train.log_every", "train.console", "train.checkpoint_every", "train.keep_checkpoints",
    "train.timing_warmup_steps", "telemetry.profile_cpu_memory", "resume",
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


def save_atomic(payload: dict[str, Any], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
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
    for stale in path.parent.glob("*.tmp"):  # left by a write that was killed
        stale.unlink()
    save_atomic(payload, path)
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink()
    return path


# --- find and load --------------------------------------------------------------------------------


def resolve_resume(target: str, run_dir: Path) -> Optional[Path]:
    """The checkpoint file named by resume=...; None for resume=auto when this run dir has none yet."""
    if target == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(target).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        found = list_checkpoints(path)
        if not found:
            raise UsageError(f"resume={target!r} holds no checkpoint ({CHECKPOINT_DIR}/step_*.pt)")
        return found[-1]
    raise UsageError(f"resume={target!r} does not exist; give a run directory, a checkpoint file, or auto")


def run_dir_of(checkpoint: Path) -> Path:
    return checkpoint.resolve().parent.parent


def load(path: Path, mmap: bool = False) -> dict[str, Any]:
    """The checkpoint's payload (UsageError when it cannot be read). mmap: tensors stay on disk until used."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - any failure to read is the same answer for the user
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"checkpoint {str(path)!r} cannot be read (truncated or corrupt?): {reason}") from None
    if not isinstance(payload, dict) or payload.get("format_version") != FORMAT_VERSION:
        raise UsageError(f"checkpoint {str(path)!r} is not an ampctl checkpoint of format {FORMAT_VERSION}")
    return payload


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
                f"{', '.join(k for k in SAFE_TO_CHANGE if k != 'resume')})"
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
