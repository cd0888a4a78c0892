"""A run's identity: `identity.json` in its run directory, written once when the run starts and never replaced.

It holds an id (a random uuid), the config the run was started with (resolved), its group choices and a hash
of the config that matters (every key but those a resumed run may change, SAFE_TO_CHANGE). Every
checkpoint carries the id and the hash, so that:
- `resume=auto` takes only its own run's checkpoints: one copied in from another run is passed over, named;
- a run killed before its first checkpoint resumes with its own config (identity.json's), not the defaults;
- a directory with an identity.json belongs to that run: a new run into it is refused (runner/ownership.py),
  except by the batch job that started it, requeued with the same config (runner/requeue.py), which continues it.
A run directory made before identities existed (no identity.json) resumes as it did: from any checkpoint in it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from ampctl import io, run_files
from ampctl.conf.migration import CONFIG_VERSION, migrated
from ampctl.conf.schema import safe_to_change_keys
from ampctl.errors import UsageError
from ampctl.runner.requeue import a_requeue_of, batch_job

_CREATED: set[Path] = set()  # the identity.json files this process wrote (a refused run removes its own only)


# Keys a resumed run may change (the schema's fields made with safe_to_change); any other difference from the
# checkpoint's config is refused.
SAFE_TO_CHANGE = safe_to_change_keys()


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys -> values."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def config_hash(config: dict[str, Any]) -> str:
    """SHA-256 of the config's keys that a resumed run must keep (resolved values, keys sorted)."""
    kept = {k: v for k, v in flatten(config).items() if not k.startswith(SAFE_TO_CHANGE)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def resolved(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]


@dataclass(frozen=True)
class RunIdentity:
    run_id: str
    config_hash: str
    config: dict[str, Any]
    choices: dict[str, str]
    created: str
    job: Optional[str] = None  # the batch job that started the run (runner/requeue.batch_job), None outside one
    config_version: int = CONFIG_VERSION  # the layout `config` is in (conf/migration.py): read as today's

    def disowns(self, payload: dict[str, Any]) -> Optional[str]:
        """Why a checkpoint's payload is not this run's (None when it is)."""
        theirs = payload.get("run_id")
        if theirs is None:
            return "it carries no run id (written before run identities, or by hand), and this run has one"
        if theirs != self.run_id:
            return f"it belongs to run {theirs[:8]}, not to this directory's run {self.run_id[:8]} (copied in?)"
        if payload.get("config_hash") != self.config_hash:
            return "its config is not the one its run was started with"
        return None


def read(run_dir: Path) -> Optional[RunIdentity]:
    """The identity of the run in run_dir; None for a directory without one. UsageError when it is unreadable
    (a run whose identity cannot be read is not resumed or written over)."""
    path = run_dir / run_files.IDENTITY
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
        version = data.get("config_version") or 1  # not recorded before version 2
        config = migrated(dict(data["config"]), version)
        # a record of an earlier layout: its hash is of its own keys, so it is taken again of today's
        recorded_hash = str(data["config_hash"]) if version >= CONFIG_VERSION else config_hash(config)
        return RunIdentity(run_id=str(data["run_id"]), config_hash=recorded_hash, config=config,
                           choices=dict(data.get("choices") or {}), created=str(data.get("created", "")),
                           job=data.get("job"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UsageError(f"{path} cannot be read ({type(exc).__name__}): the run's identity is damaged; restore "
                         "it, or start a new run in another hydra.run.dir") from None


def create(run_dir: Path, cfg: DictConfig, choices: dict[str, str]) -> RunIdentity:
    """A new run's identity, written with O_EXCL: two runs racing into one directory cannot both own it."""
    config = resolved(cfg)
    identity = RunIdentity(run_id=uuid.uuid4().hex, config_hash=config_hash(config), config=config,
                           choices=dict(choices), created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), job=batch_job())
    text = io.dumps(asdict(identity), indent=2, default=str) + "\n"
    tmp = run_dir / f".{run_files.IDENTITY}.{os.getpid()}.tmp"
    tmp.write_text(text, encoding="utf-8")
    try:
        os.link(tmp, run_dir / run_files.IDENTITY)  # fails if another run's identity is there already
    except FileExistsError:
        raise UsageError(f"{run_dir} already holds a run ({run_files.IDENTITY}): continue it with resume=auto, or "
                         "choose another hydra.run.dir") from None
    finally:
        tmp.unlink(missing_ok=True)
    _CREATED.add((run_dir / run_files.IDENTITY).resolve())
    return identity


def created_here(path: Path) -> bool:
    """Whether path is an identity.json this process created (a run refused before its first record removes it)."""
    return path.resolve() in _CREATED


def requeued_here(run_dir: Path, cfg: DictConfig) -> Optional[RunIdentity]:
    """The run in run_dir when this process is the batch job that started it, requeued, with its config (a job
    requeued by its engine runs its original command again, without resume=auto); else None."""
    own = read(run_dir)
    if own is None or not a_requeue_of(own.job):
        return None
    return own if config_hash(resolved(cfg)) == own.config_hash else None


def own_or_create(run_dir: Path, cfg: DictConfig, choices: dict[str, str]) -> RunIdentity:
    """The identity a starting run records under: the directory's own when it continues its run, else new."""
    return read(run_dir) or create(run_dir, cfg, choices)
