"""`ampctl report PATH`: the table, files and plots of a run, a multirun, a compare, a memory or an inspect
directory, again, from what the runs recorded (no re-training)."""

from __future__ import annotations

import sys
from pathlib import Path

from ampctl import run_files
from ampctl.errors import SomeRunsFailed, UsageError
from ampctl.shell.command import Command, Section
from ampctl.shell.outcomes import leave, said_in_one_line

USAGE = (f"usage: ampctl report PATH   ({run_files.REPORTABLE})\n\n"
         "The table, files and plots of PATH again, from what its command recorded: nothing is trained again.")


def complete(done: list[str], current: str) -> list[str]:
    """Shell completion: PATH, the shell's own file names."""
    return []


def main() -> None:
    args = sys.argv[1:]
    if "-h" in args or "--help" in args:  # anywhere, as argparse takes it: `ampctl report PATH --help`
        print(USAGE)
        return
    with said_in_one_line("report", " (the report's files were not written; what is on the screen is the report)"):
        if len(args) != 1:
            raise UsageError(f"expected one PATH ({run_files.REPORTABLE}), got {len(args)} arguments")
        from ampctl.studies.rerender import render  # torch, rich's tables: not for --help

        failed = render(Path(args[0]))
    if failed:
        leave(SomeRunsFailed(failed), [])  # the table names them


COMMAND = Command(name="report", summary="the table, files and plots of any directory ampctl wrote, again",
                  section=Section.FILES, main=main, complete=complete)
