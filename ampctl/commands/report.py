"""`ampctl report PATH`: the table, files and plots of a run, a multirun, a compare, a memory or an inspect
directory, again, from what the runs recorded (no re-training)."""

from __future__ import annotations

import sys
from pathlib import Path

from ampctl.errors import USAGE_EXIT_CODE, WRITE_FAILED_EXIT_CODE, UsageError, write_refused

USAGE = "usage: ampctl report PATH   (a run, multirun, compare, memory or inspect directory)"


def complete(done: list[str], current: str) -> list[str]:
    """Shell completion: PATH, the shell's own file names."""
    return []


def main() -> None:
    args = sys.argv[1:]
    if args in (["-h"], ["--help"]):
        print(USAGE)
        return
    if len(args) != 1:
        print(f"ampctl report: error: expected one PATH (a run, multirun, compare, memory or inspect directory), "
              f"got {len(args)} arguments", file=sys.stderr)
        sys.exit(USAGE_EXIT_CODE)
    try:
        from ampctl.commands.report_rendering import render  # torch, rich's tables: not for --help

        failed = render(Path(args[0]))
    except UsageError as exc:
        print(f"ampctl report: error: {exc}", file=sys.stderr)
        sys.exit(USAGE_EXIT_CODE)
    except OSError as exc:
        if not write_refused(exc):
            raise
        print(f"ampctl report: error: cannot write {exc.filename}: {exc.strerror}; the report's files were not "
              "written (what is on the screen is the report)", file=sys.stderr)
        sys.exit(WRITE_FAILED_EXIT_CODE)
    if failed:
        sys.exit(1)
