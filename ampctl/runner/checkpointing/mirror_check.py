"""train.checkpoint.mirror checked before a run writes anything (runner/plan.py): its file system installed and
readable within a patience that names its endpoint, and holding no run or this one; a new mirror writable."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from ampctl import run_files
from ampctl.errors import UsageError
from ampctl.runner.checkpointing.mirror import names_in, open_mirror, read_identity


def check(url: str, run_dir: Path, continuing: bool, options: Optional[Mapping[str, Any]] = None) -> None:
    """Before anything is written: the mirror's file system is installed and readable, and it holds no run or
    this one (the run in run_dir, when the run continues it). UsageError otherwise."""
    from ampctl.runner import identity

    fs, root = open_mirror(url, options)
    try:
        theirs = answered(lambda: read_identity(fs, f"{root}/{run_files.IDENTITY}"), url, fs)
    except UsageError:
        raise  # an identity that is not one, a mirror that does not answer: said as it is
    except Exception as exc:  # noqa: BLE001 - credentials, a bucket that is not there, the network: one line
        raise UsageError(f"train.checkpoint.mirror={url} cannot be read at {where(fs)} ({type(exc).__name__}: "
                         f"{str(exc).strip()[:200]})") from None
    if theirs is None:
        held = sorted(names_in(fs, root))
        if held:  # a prefix of someone else's: the uploads would replace files ampctl did not write
            raise UsageError(f"train.checkpoint.mirror={url} holds files of its own ({', '.join(held[:3])}"
                             f"{', ...' if len(held) > 3 else ''}) and no run: a mirror is a URL of the run's own; "
                             "choose an empty one")
        _check_writable(fs, root, url)
        return
    ours = identity.read(run_dir) if continuing else None
    if ours is None or ours.run_id != theirs.get("run_id"):
        raise UsageError(f"train.checkpoint.mirror={url} holds another run's checkpoints (run "
                         f"{str(theirs.get('run_id'))[:8]}): a mirror holds one run; choose another URL, or continue "
                         "that run with resume=auto in an empty run directory")


CHECK_PATIENCE_S = 60.0  # for the mirror to answer the start's one small read (an S3 client retries for minutes)
SAY_WAITING_AFTER_S = 2.0


def where(fs: Any) -> str:
    """The mirror's endpoint, in words: an object store's URL where one is set (mirror_options.endpoint_url, the
    environment), else its file system's default."""
    endpoint = getattr(fs, "endpoint_url", None) or (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return f"endpoint {endpoint}" if endpoint else f"{protocol}'s default endpoint"


def answered(read: Callable[[], Any], url: str, fs: Any) -> Any:
    """read() of the mirror, said after SAY_WAITING_AFTER_S and given up after CHECK_PATIENCE_S with a line naming the
    endpoint: a store that takes the connection and never answers held the run's start silent for 6 min 40 s (s3fs
    and botocore retrying), then named nothing but the client's error."""
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["value"] = read()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=call, name="ampctl-mirror-check", daemon=True)
    thread.start()
    thread.join(SAY_WAITING_AFTER_S)
    if thread.is_alive():
        print(f"checking train.checkpoint.mirror={url} at {where(fs)} (up to {CHECK_PATIENCE_S:.0f} s)...", flush=True)
        thread.join(max(CHECK_PATIENCE_S - SAY_WAITING_AFTER_S, 0.0))
    if thread.is_alive():  # left to the file system's own timeouts, in a thread nothing waits for
        raise UsageError(f"train.checkpoint.mirror={url}: {where(fs)} did not answer within {CHECK_PATIENCE_S:.0f} s; "
                         "check that it is up and reachable from here (or give its file system's timeouts in "
                         "train.checkpoint.mirror_options)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


BUCKETED = ("s3", "s3a", "gs", "gcs", "abfs", "az")  # object stores whose first path part is a bucket (a container)


def _check_writable(fs: Any, root: str, url: str) -> None:
    """A new mirror can be written, before the run directory is made: a local (or mounted) path's nearest existing
    folder takes a file (a read-only mount or folder is said now, not as the run's first checkpoint fails); an object
    store's bucket exists (s3fs's makedirs would create one a typo named). UsageError otherwise."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if "file" in protocols:
        folder = Path(root)
        while not folder.exists():
            folder = folder.parent
        try:
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as exc:
            raise UsageError(f"train.checkpoint.mirror={url}: {folder} cannot be written ({exc.strerror}); choose a "
                             "writable path") from None
    elif any(p in BUCKETED for p in protocols):
        bucket = root.split("/", 1)[0]
        if not fs.exists(bucket):
            raise UsageError(f"train.checkpoint.mirror={url}: the bucket {bucket!r} does not exist; create it, or "
                             "name one that does") from None
