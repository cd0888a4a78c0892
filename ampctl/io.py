"""The small helpers every layer shares, one of each: writing run records (every file whole or not at all,
JSON that strict readers accept), walking nested tensors, and byte counts for people."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    import torch

# torch is imported by the two tensor helpers when called, not with this module: the command line's --help and
# shell completion read run files through here without a training run's imports


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary file beside path, then rename it into place: a reader (or a kill) never sees
    half a file."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write, fsync, rename, fsync the directory: a record a resume trusts survives a power cut whole or not at all.
    The temporary name is unique (two writers of one path, a rank and a callback, never share one) and ends in
    `.tmp`, which a run that starts again removes (runner/checkpointing/checkpoint_files.remove_stale_files)."""
    import secrets

    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to any file written
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """A rename into path (a directory) made durable: POSIX keeps it only once the directory itself is synced."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def strict_json(value: Any) -> Any:
    """value with every non-finite float replaced by None: JSON has no NaN or Infinity, and Python's bare
    `NaN` / `Infinity` tokens are rejected by strict readers (jq, JavaScript, Go, Rust's serde)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """json.dumps of strict_json(value); allow_nan=False guarantees no bare NaN slips through."""
    return json.dumps(strict_json(value), allow_nan=False, **kwargs)


def read_jsonl(path: Path) -> list[Any]:
    """A .jsonl record's rows (none where the file is not there; a line cut short by a kill passed over)."""
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, dumps(data, indent=2, default=str) + "\n")


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in (nested tuples, lists and dicts of) value: a module's output, a batch."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensors_in(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_in(item)]
    return []


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """value with fn applied to every tensor in it, through torch's pytree: nested tuples, named tuples, lists,
    dicts and the containers libraries register (transformers' ModelOutput) keep their type and shape."""
    import torch
    from torch.utils._pytree import tree_map_only  # public torch.utils.pytree is newer than torch 2.11

    return tree_map_only(torch.Tensor, fn, value)


def scale_label(scale: float) -> str:
    """A loss scale as people read it: 2^16 for a power of two (what dynamic scalers hold), 1 for no scaling,
    the number otherwise ('%g': never cut short)."""
    exponent = math.log2(scale) if scale > 0 else float("nan")
    if scale == 1 or not math.isfinite(exponent) or exponent != int(exponent):
        return f"{scale:g}"
    return f"2^{int(exponent)}"


def readable_value(text: str) -> str:
    """An override's value as people read it: a float a sweeper drew (Optuna's 0.005461687968002626) to 4
    significant digits; anything else as written. For display: the config keeps the value."""
    try:
        value = float(text)
    except ValueError:
        return text
    short = f"{value:.4g}"
    return short if len(short) < len(text) and ("." in text or "e" in text.lower()) else text


def readable_override(override: str) -> str:
    key, sep, value = override.partition("=")
    return f"{key}{sep}{readable_value(value)}" if sep else override


def count_of(n: int, noun: str) -> str:
    """1 step, 2 steps, 2 batches: a count with its noun (English plurals by s, es after s, x, z, ch, sh)."""
    plural = "es" if noun.endswith(("s", "x", "z", "ch", "sh")) else "s"
    return f"{n:,} {noun}{'' if n == 1 else plural}"


def si_prefixed(value: float) -> tuple[str, str]:
    """A count in 3 significant digits and its SI prefix: 4710 -> ("4.71", "k"), 4.29e10 -> ("42.9", "G")."""
    rounded = float(f"{value:.3g}")  # 999,999 is 1.00M, not 1e+03k
    for prefix, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(rounded) >= size:
            return f"{rounded / size:.3g}", prefix
    return f"{rounded:.3g}", ""


def milliseconds(ms: float) -> str:
    """A duration in ms as people read it: 3 significant digits, whole ms from 100 up (1,630 ms, not 1.63e+03)."""
    return f"{ms:,.0f}" if abs(ms) >= 100 else f"{ms:.3g}"


def format_bytes(n: Optional[float], decimals: int = 2) -> str:
    """1,536 -> '1.50 KiB' (binary units); None -> '-'."""
    if n is None:
        return "-"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.{decimals}f} {unit}"
    return f"{n:,.0f} B"


def for_the_terminal(text: str, stream: Any = None) -> str:
    """text as a terminal should show it (wrap_words at its width); off a terminal (a pipe, a log, CI) unchanged: one
    line per record, whole for grep."""
    stream = sys.stdout if stream is None else stream
    try:
        if not stream.isatty():
            return text
    except (AttributeError, ValueError):  # no stream, or a closed one
        return text
    return wrap_words(text, shutil.get_terminal_size().columns)


def is_command(line: str) -> bool:
    """A line that is a shell command for the user to copy (`ampctl train -cd DIR -cn NAME`), not a command's own
    line about itself (`ampctl diff: ...`, `ampctl train: error: ...`)."""
    return re.match(r"\s*ampctl [a-z]+ ", line) is not None


def wrap_words(text: str, width: int) -> str:
    """Each line of text longer than width broken at word boundaries, its continuation indented two more than it: a
    terminal breaks a long line wherever its last column falls, mid-word (`run_dir=/tmp/t8` / `0`). A line that is a
    command to copy (`ampctl ...`) is left whole: broken into lines it would no longer run as copied."""
    out = []
    for line in text.split("\n"):
        indent = line[:len(line) - len(line.lstrip(" "))]
        out.append(line if len(line) <= width or is_command(line) else textwrap.fill(
            line, width=width, subsequent_indent=indent + "  ", break_long_words=False, break_on_hyphens=False))
    return "\n".join(out)
