"""What a command's Python API function returns (ampctl.Result)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Result:
    """What a call leaves: its directory and its record (train: summary.json; compare: comparison.json;
    inspect: ranges.json; memory: memory.json; advise: advice.json; export: export.json), the same files `ampctl
    report` reads."""

    run_dir: Path
    summary: dict[str, Any]
