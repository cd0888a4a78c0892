"""train.checkpoint.mirror: a run's checkpoints kept off the machine too, at an fsspec URL (s3://, gs://, memory://,
or a path every machine mounts), so that a preempted or lost machine's run continues elsewhere.

Each checkpoint is written and checksummed in the run directory as always; a thread then uploads it, so the step
never waits on the network. Object stores have no rename, so a checkpoint cannot appear there whole at once: its
records (metrics.jsonl, evals.jsonl, as of the checkpoint) go first, then its data, then its checksum, last, as the
commit marker. A checkpoint whose marker is missing (an upload killed half-way) or does not match its data is never
taken. Mirrored checkpoints beyond the run's train.checkpoint.keep are removed, the marker first.

`resume=auto` in a run directory that holds none of the run (a new machine) pulls the run's identity, its records
and the newest mirrored checkpoint that verifies, then resumes from them as from its own. A mirror holds one run:
a new run refuses a mirror that holds another (as it refuses a run directory that does).
"""

from __future__ import annotations

import json
import queue
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

from ampctl import run_files
from ampctl.errors import UsageError
from ampctl.runner.checkpointing import checkpoint_files
from ampctl.runner.checkpointing.checkpoint_files import CHECKSUM_SUFFIX
from ampctl.runner.checkpointing.sharded_checkpoint import (
    MANIFEST,  # a sharded checkpoint's commit marker, uploaded last
)

# uploaded with each checkpoint; pulled with the newest (escalations.jsonl: the rules a resume keeps)
RECORDS = (run_files.METRICS, run_files.EVALS, run_files.ESCALATIONS)
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}  # the ampctl extra that installs each protocol


def open_mirror(url: str, options: Optional[Mapping[str, Any]] = None) -> tuple[Any, str]:
    """The fsspec file system and root path of a mirror URL, made with its storage options
    (train.checkpoint.mirror_options); UsageError naming what to install when its protocol is not (s3fs for s3://,
    gcsfs for gs://) or is unknown, or saying which option its file system refuses."""
    import fsspec

    key = "train.checkpoint.mirror"
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    try:
        fsspec.get_filesystem_class(protocol)  # raises for an unknown protocol, or one whose package is missing
    except ValueError:
        raise UsageError(f"{key}={url}: fsspec knows no protocol {protocol!r}; give a URL such as s3://bucket/run, "
                         "gs://bucket/run or memory://run, or a directory every machine mounts") from None
    except ImportError as exc:
        extra = EXTRAS.get(protocol)
        how = f"pip install 'ampctl[{extra}]'" if extra else f"install what it names: {exc}"
        raise UsageError(f"{key}={url}: the {protocol}:// file system is not installed; {how}") from None
    try:
        fs, root = fsspec.core.url_to_fs(url, **dict(options or {}))
    except TypeError as exc:  # an option the file system's constructor does not take
        raise UsageError(f"train.checkpoint.mirror_options={dict(options or {})}: the {protocol}:// file system "
                         f"refuses them ({str(exc).strip()[:200]}); see its storage options") from None
    return fs, root.rstrip("/")


def _marker(name: str) -> str:
    """The commit marker of a checkpoint, relative to checkpoints/: a file's checksum, a sharded one's manifest."""
    return f"{name}/{MANIFEST}" if name.endswith(".dcp") else name + CHECKSUM_SUFFIX


def _whole_lines(path: Path) -> Optional[bytes]:
    """A records file as of now, to its last whole row (the run may be appending)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    return data[: data.rfind(b"\n") + 1]


class Mirror:
    """The mirror of one run: its identity claimed when the run starts, each checkpoint uploaded by a thread."""

    def __init__(self, url: str, run_dir: Path, warn: Callable[[str], None],
                 options: Optional[Mapping[str, Any]] = None) -> None:
        self.url, self.run_dir, self.warn = url, run_dir, warn
        self.fs, self.root = open_mirror(url, options)
        self.failed: list[str] = []
        # checkpoints to upload, and start_timeline_at's (step, done) in their turn; None: the end
        self._queue: "queue.Queue[Optional[Union[Path, tuple[int, threading.Event]]]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._checked_before_uploading = False

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def claim(self) -> None:
        """The run's identity in the mirror, written only where there is none (fsspec's exclusive create, mode "xb":
        O_EXCL on a path, a conditional write on S3, GCS and Azure), then read back: two runs started together at one
        URL both passed the plan's check, and only one of them may go on. UsageError for the other."""
        ours = (self.run_dir / run_files.IDENTITY).read_bytes()
        path = self._path(run_files.IDENTITY)
        self.fs.makedirs(self.root, exist_ok=True)
        try:
            with self.fs.open(path, "xb") as file:
                file.write(ours)
        except FileExistsError:
            pass  # this run's own (a resume), or another's: read below
        except (ValueError, NotImplementedError):  # a file system without exclusive create: written where absent,
            # read back below and again before the first upload (_upload), where a later writer is seen
            if read_identity(self.fs, path) is None:
                self.fs.pipe_file(path, ours)
        self._check_still_ours()

    def _check_still_ours(self) -> None:
        """UsageError unless the mirror's identity is this run's."""
        ours = json.loads((self.run_dir / run_files.IDENTITY).read_bytes())["run_id"]
        theirs = _settled_identity(self.fs, self._path(run_files.IDENTITY))
        if theirs.get("run_id") != ours:
            raise UsageError(f"train.checkpoint.mirror={self.url} was claimed by another run (run "
                             f"{str(theirs.get('run_id'))[:8]}) that started at the same moment: a mirror holds one "
                             "run; choose another URL")

    def upload(self, checkpoint: Path) -> None:
        """Queue a checkpoint (whole in the run directory) for upload; the thread starts with the first."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._upload_queued, name="ampctl-mirror", daemon=True)
            self._thread.start()
        self._queue.put(checkpoint)

    def start_timeline_at(self, step: int) -> None:
        """The run went back to its checkpoint at `step` (a resume to an older one, an escalation) and set aside what
        lay past it: so does the mirror, before the run trains on, after the uploads queued before (a pull must never
        take the abandoned timeline's newer checkpoint). The abandoned checkpoints' markers go first, then their
        data, then the records (escalations.jsonl among them): a mirror cut short in between offers the checkpoint
        at `step` with the old records, from which a resume sets aside the same and trips again as this run did."""
        done = threading.Event()
        if self._thread is None:
            self._set_aside_after(step)
            return
        self._queue.put((step, done))
        done.wait()

    def _set_aside_after(self, step: int) -> None:
        folder = self._path(run_files.CHECKPOINTS)
        try:
            for name in checkpoint_names(self.fs, folder):
                if checkpoint_files.checkpoint_step(Path(name)) > step:
                    self._remove(folder, name)
            for name in RECORDS:
                data = _whole_lines(self.run_dir / name)
                if data is not None:
                    self.fs.pipe_file(self._path(name), data)
                elif self.fs.exists(self._path(name)):
                    self.fs.rm(self._path(name))
        except Exception as exc:  # noqa: BLE001 - the network's failure is said; the run directory is whole
            self.warn(f"warning: the mirror {self.url} could not set aside what lies past step {step} ("
                      f"{type(exc).__name__}: {str(exc).strip()[:200]}): a resume=auto from it may take an abandoned "
                      "checkpoint")

    def _remove(self, folder: str, name: str) -> None:
        """A mirrored checkpoint, its commit marker first: removal cut short leaves data no one takes."""
        marker = f"{folder}/{_marker(name)}"
        if self.fs.exists(marker):
            self.fs.rm(marker)
        self.fs.rm(f"{folder}/{name}", recursive=name.endswith(".dcp"))

    def close(self) -> list[str]:
        """Wait for the uploads under way; the checkpoints that could not be mirrored (each said when it failed)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        return self.failed

    def _upload_queued(self) -> None:
        while (checkpoint := self._queue.get()) is not None:
            if isinstance(checkpoint, tuple):  # start_timeline_at's, in its turn among the uploads
                step, done = checkpoint
                self._set_aside_after(step)
                done.set()
                continue
            try:
                self._upload(checkpoint)
                self._prune()
            except Exception as exc:  # noqa: BLE001 - the network's failure is said; the local checkpoint is whole
                if not checkpoint.exists():  # pruned in the run directory before its upload ended: superseded
                    continue
                self.failed.append(checkpoint.name)
                self.warn(f"warning: {checkpoint.name} was not mirrored to {self.url} ({type(exc).__name__}: "
                          f"{str(exc).strip()[:200]}); the local checkpoint is whole, and the next one is tried")

    def _upload(self, checkpoint: Path) -> None:
        if not self._checked_before_uploading:  # a store without exclusive create: a later claim wrote over ours
            self._check_still_ours()
            self._checked_before_uploading = True
        for name in RECORDS:  # first: a pulled checkpoint's steps are in its records
            data = _whole_lines(self.run_dir / name)
            if data is not None:
                self.fs.pipe_file(self._path(name), data)
        folder = self._path(run_files.CHECKPOINTS, checkpoint.name)
        self.fs.makedirs(self._path(run_files.CHECKPOINTS), exist_ok=True)  # a local or mounted mirror's folder
        if checkpoint.is_dir():
            files = sorted(checkpoint.iterdir(), key=lambda p: p.name == MANIFEST)  # the manifest last
            self.fs.makedirs(folder, exist_ok=True)
            for file in files:
                self.fs.put_file(str(file), f"{folder}/{file.name}")
        else:
            self.fs.put_file(str(checkpoint), folder)
            self.fs.put_file(str(checkpoint_files.checksum_path(checkpoint)), folder + CHECKSUM_SUFFIX)

    def _prune(self) -> None:
        """Mirrored checkpoints older than the oldest kept in the run directory: the marker first, so that a prune
        cut short leaves data no one takes rather than a marker without its data."""
        kept = checkpoint_files.list_checkpoints(self.run_dir)
        if not kept:
            return
        oldest = checkpoint_files.checkpoint_step(kept[0])
        folder = self._path(run_files.CHECKPOINTS)
        for name in checkpoint_names(self.fs, folder):  # with a marker or not (an upload cut short, superseded)
            if checkpoint_files.checkpoint_step(Path(name)) < oldest:
                self._remove(folder, name)


def _settled_identity(fs: Any, path: str, patience_s: float = 5.0) -> dict:
    """The identity at path, once whole: a run that won an exclusive create on a local path writes it after creating
    it, and a reader in between sees it empty or cut short."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            found = read_identity(fs, path)
        except UsageError:
            if time.monotonic() > deadline:
                raise
            found = None
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise UsageError(f"the mirror's {path} was not written within {patience_s:.0f} s of its creation")
        time.sleep(0.05)


def read_identity(fs: Any, path: str) -> Optional[dict]:
    try:
        return json.loads(fs.cat_file(path))
    except FileNotFoundError:
        return None
    except ValueError:
        raise UsageError(f"the mirror's {path} cannot be read: it is not a run's identity") from None


def names_in(fs: Any, folder: str) -> set[str]:
    try:
        return {entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(folder, detail=False, refresh=True)}
    except FileNotFoundError:
        return set()


def checkpoint_names(fs: Any, folder: str) -> list[str]:
    """Every checkpoint name in a mirror's checkpoints/, whole or not, oldest first."""
    return sorted((n for n in names_in(fs, folder) if checkpoint_files.is_checkpoint_name(n)),
                  key=lambda n: checkpoint_files.checkpoint_step(Path(n)))


def mirrored_checkpoints(fs: Any, folder: str) -> list[str]:
    """The checkpoint names in a mirror's checkpoints/ with their commit marker, oldest first."""
    names = names_in(fs, folder)
    return [n for n in checkpoint_names(fs, folder)
            if (fs.exists(f"{folder}/{n}/{MANIFEST}") if n.endswith(".dcp") else n + CHECKSUM_SUFFIX in names)]


def pull(url: str, run_dir: Path, say: Callable[[str], None], options: Optional[Mapping[str, Any]] = None) -> bool:
    """Into a run directory that holds none of the run: the mirror's identity, records and newest checkpoint that
    verifies (newer ones that do not are said and left). False when the mirror holds no run. UsageError when it
    holds one but no checkpoint of it verifies (nothing is left in run_dir then)."""
    fs, root = open_mirror(url, options)
    identity = root + "/" + run_files.IDENTITY
    if read_identity(fs, identity) is None:
        return False
    folder = run_dir / run_files.CHECKPOINTS
    created = not run_dir.exists()
    written: list[Path] = []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        failures: list[str] = []
        for name in reversed(mirrored_checkpoints(fs, f"{root}/{run_files.CHECKPOINTS}")):
            why = _pull_checkpoint(fs, f"{root}/{run_files.CHECKPOINTS}/{name}", folder / name, written)
            if why is None:
                for record in (run_files.IDENTITY, *RECORDS):
                    if fs.exists(f"{root}/{record}"):
                        fs.get_file(f"{root}/{record}", str(run_dir / record))
                        written.append(run_dir / record)
                for failure in failures:
                    say(f"resume=auto: passed over the mirror's {failure}")
                say(f"resume=auto: pulled {name} and the run's records from {url}")
                return True
            failures.append(f"{name} ({why})")
        raise UsageError(f"resume=auto: train.checkpoint.mirror={url} holds a run but no checkpoint of it that "
                         f"verifies{': ' + '; '.join(failures) if failures else ''}")
    except BaseException:
        for path in reversed(written):
            if checkpoint_files.is_checkpoint(path):
                checkpoint_files.remove(path)
            else:
                path.unlink(missing_ok=True)
        if created:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def _pull_checkpoint(fs: Any, remote: str, local: Path, written: list[Path]) -> Optional[str]:
    """Download one mirrored checkpoint under a .tmp name, check it against its marker, rename it into place.
    Why it does not verify, or None."""
    tmp = local.with_name(local.name + ".tmp")
    try:
        if local.suffix == ".dcp":
            fs.get(remote + "/", str(tmp) + "/", recursive=True)
            from ampctl.runner.checkpointing.sharded_checkpoint import verify

            why = verify(tmp)
            if why is not None:
                return why
            tmp.rename(local)
        else:
            marker = fs.cat_file(remote + CHECKSUM_SUFFIX).decode("utf-8", "replace")
            fs.get_file(remote, str(tmp))
            digest = checkpoint_files.file_sha256(tmp)
            if marker.split()[:1] != [digest]:
                return "its data does not match its checksum"
            checkpoint_files.checksum_path(local).write_text(marker, encoding="utf-8")
            tmp.rename(local)
        written.append(local)
        return None
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {str(exc).strip()[:200]}"
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
