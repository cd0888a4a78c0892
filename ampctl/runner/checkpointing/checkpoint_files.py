"""Checkpoints on disk: where they live, how each is written whole, how they are listed, pruned, set aside and
checksummed. What a checkpoint holds and how it is loaded is checkpoint.py's; the sharded writer's is
sharded_checkpoint.py's.

`checkpoints/step_N.pt` is one file, with its SHA-256 beside it (`step_N.pt.sha256`, sha256sum's format);
`checkpoints/step_N.dcp/` is a torch.distributed.checkpoint directory with a SHA256SUMS inside. Either is
written under a `.tmp` name and renamed into place once complete, so a listed checkpoint is a whole one.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Optional

from ampctl import io, run_files

CHECKSUM_SUFFIX = ".sha256"  # beside each checkpoint file, in sha256sum's format
_NAME = re.compile(r"^step_(\d{8})\.(pt|dcp)$")  # one file, or a directory of shards


# --- naming and listing ---------------------------------------------------------------------------


def checkpoint_path(run_dir: Path, step: int, sharded: bool = False) -> Path:
    return run_dir / run_files.CHECKPOINTS / f"step_{step:08d}.{'dcp' if sharded else 'pt'}"


def is_sharded(path: Path) -> bool:
    return path.suffix == ".dcp"


def checkpoint_step(path: Path) -> int:
    return int(_NAME.match(path.name).group(1))  # type: ignore[union-attr]


def is_checkpoint_name(name: str) -> bool:
    """step_N.pt or step_N.dcp: a checkpoint's name (a `.tmp` one being written is not)."""
    return bool(_NAME.match(name))


def is_checkpoint(path: Path) -> bool:
    """A complete checkpoint by its name: a step_N.pt file or a step_N.dcp directory (not a `.tmp` one)."""
    return bool(_NAME.match(path.name)) and (path.is_dir() if is_sharded(path) else path.is_file())


def list_checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run, oldest first."""
    folder = run_dir / run_files.CHECKPOINTS
    if not folder.is_dir():
        return []
    return sorted(filter(is_checkpoint, folder.iterdir()), key=checkpoint_step)


# --- writing whole ---------------------------------------------------------------------------------


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


def save_atomic(payload: dict[str, Any], path: Path, checksum: bool = True) -> None:
    """Write, fsync, checksum, rename: a crash at any moment leaves the earlier checkpoints whole; a failed
    write (a full disk) leaves no temporary file. checksum=False: a part of a sharded checkpoint, whose
    manifest checksums it."""
    import torch  # here: the rest of this module (names, lists, checks) serves the command line without torch

    tmp = path.with_name(path.name + ".tmp")
    hashing: Optional[_Hashing] = None
    try:
        with tmp.open("wb") as f:
            hashing = _Hashing(f)
            torch.save(payload, hashing)
            f.flush()
            os.fsync(f.fileno())
        if checksum:  # `sha256sum -c step_N.pt.sha256` checks it by hand; written first, so never missing
            io.atomic_write_text(checksum_path(path), f"{hashing.digest.hexdigest()}  {path.name}\n")
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        error = exc if isinstance(exc, OSError) else hashing.error if hashing is not None else None
        if error is not None and (error is not exc or error.filename is None):  # a full disk, named
            raise OSError(error.errno, error.strerror, str(tmp)) from None
        raise
    io.fsync_dir(path.parent)  # the rename itself survives a power cut


# --- pruning, setting aside, cleaning up ----------------------------------------------------------


def prune(run_dir: Path, keep: int) -> None:
    for old in list_checkpoints(run_dir)[:-keep]:
        remove(old)


def remove(path: Path) -> None:
    if is_sharded(path):
        shutil.rmtree(path)
        return
    path.unlink()
    checksum_path(path).unlink(missing_ok=True)


def move(path: Path, folder: Path) -> None:
    """A checkpoint and its checksum into folder (a set-aside timeline)."""
    if checksum_path(path).is_file():
        checksum_path(path).rename(folder / checksum_path(path).name)
    path.rename(folder / path.name)


def remove_stale_files(run_dir: Path) -> list[Path]:
    """What a killed write left: temporary files and sharded checkpoint directories (`*.tmp`) beside the
    checkpoints and the run's records, and a checksum whose checkpoint was never renamed into place. Removed
    at the start of a run; returned."""
    folder = run_dir / run_files.CHECKPOINTS
    stale = [*run_dir.glob("*.tmp"), *run_dir.glob("*/*.tmp")]  # checkpoints/ and profile/ among them
    sums = folder.glob(f"*.pt{CHECKSUM_SUFFIX}")
    stale += [p for p in sums if not p.with_name(p.name.removesuffix(CHECKSUM_SUFFIX)).exists()]
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return stale


# --- checksums -------------------------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def cached_sha256(path: Path) -> str:
    """Cached per file version: the check before Hydra writes and the run's own load read it once."""
    stat = path.stat()
    return _sha256(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _sha256(path: str, _mtime_ns: int, _size: int) -> str:
    return file_sha256(Path(path))


def run_dir_of(checkpoint: Path) -> Path:
    """The run directory a checkpoint belongs to: the nearest above it with the run's identity (a checkpoint set
    aside sits deeper), else the one its checkpoints/ folder is in (a run made before identities)."""
    path = checkpoint.resolve()
    owner = next((d for d in path.parents if (d / run_files.IDENTITY).is_file()), None)
    return owner or path.parent.parent
