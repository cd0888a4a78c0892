"""What the study commands (compare, memory, inspect, advise) share around their study."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from ampctl.errors import UsageError
from ampctl.interrupt import Interrupted, interrupts_surfaced, signal_name
from ampctl.shell.outcomes import leave


@contextlib.contextmanager
def refused_in_one_line(command: str, out_dir: Path, interrupted_means: str = "") -> Iterator[None]:
    """A study's refusal: one line, exit code 2, and its directory gone if it holds only Hydra's files. A stop
    signal the study did not handle itself: one line that says whether anything was measured (and where), the
    directory gone if nothing was; interrupted_means: what the command adds when something was. (Exit codes and
    clean-up: shell/outcomes.py.)"""
    try:
        with interrupts_surfaced():
            yield
    except UsageError as exc:
        leave(exc, [f"ampctl {command}: error: {exc}"], out_dir)
    except (KeyboardInterrupt, Interrupted) as exc:  # Interrupted: a run the study trained itself stopped
        name = signal_name(exc)

        def said() -> list[str]:  # after the clean-up: whether the directory is still there says what was measured
            if out_dir.is_dir():
                return [f"\nampctl {command}: interrupted ({name}); what was measured until then is in "
                        f"{out_dir}{interrupted_means}"]
            return [f"\nampctl {command}: interrupted ({name}) before anything was recorded"]

        leave(exc, said, out_dir)
