"""What the study commands (compare, memory, inspect, advise) share around their study."""

from __future__ import annotations

import contextlib
import signal
import sys
from pathlib import Path
from typing import Iterator

from ampctl.errors import USAGE_EXIT_CODE, UsageError
from ampctl.interrupt import Interrupted, exit_at_once_on_another_signal, exit_code, signal_name
from ampctl.runner.ownership import remove_if_only_hydra_files


@contextlib.contextmanager
def refused_in_one_line(command: str, out_dir: Path, interrupted_means: str = "") -> Iterator[None]:
    """A study's refusal: one line, exit code 2, and its directory gone if it holds only Hydra's files. A stop
    signal the study did not handle itself: one line that says whether anything was measured (and where), the
    directory gone if nothing was; interrupted_means: what the command adds when something was."""
    try:
        yield
    except UsageError as exc:
        remove_if_only_hydra_files(out_dir)
        print(f"ampctl {command}: error: {exc}", file=sys.stderr)
        sys.exit(USAGE_EXIT_CODE)
    except (KeyboardInterrupt, Interrupted) as exc:  # Interrupted: a run the study trained itself stopped
        exit_at_once_on_another_signal(getattr(exc, "signum", signal.SIGINT))
        remove_if_only_hydra_files(out_dir)
        if out_dir.is_dir():
            print(f"\nampctl {command}: interrupted ({signal_name(exc)}); what was measured until then is in "
                  f"{out_dir}{interrupted_means}", file=sys.stderr)
        else:
            print(f"\nampctl {command}: interrupted ({signal_name(exc)}) before anything was recorded", file=sys.stderr)
        sys.exit(exit_code(exc))
