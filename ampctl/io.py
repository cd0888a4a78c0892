"""Writing run records: every file whole or not at all, and JSON that strict readers accept."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary file beside path, then rename it into place: a reader (or a kill) never sees
    half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


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


def write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, dumps(data, indent=2, default=str) + "\n")
