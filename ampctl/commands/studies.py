"""What the study commands (compare, memory, inspect, advise) share around their study."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Iterator

from ampctl.errors import USAGE_EXIT_CODE, UsageError
from ampctl.runner.ownership import remove_if_only_hydra_files


@contextlib.contextmanager
def refused_in_one_line(command: str, out_dir: Path) -> Iterator[None]:
    """A study's refusal: one line, exit code 2, and its directory gone if it holds only Hydra's files."""
    try:
        yield
    except UsageError as exc:
        remove_if_only_hydra_files(out_dir)
        print(f"ampctl {command}: error: {exc}", file=sys.stderr)
        sys.exit(USAGE_EXIT_CODE)
