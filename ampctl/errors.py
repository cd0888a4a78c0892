"""User-facing errors. Each one renders as a single line and exits with code 2 (a usage error)."""

from __future__ import annotations

from typing import Any

USAGE_EXIT_CODE = 2


class UsageError(Exception):
    """A mistake the user can fix: printed as one line, no traceback, exit code 2."""


class ConfigError(UsageError):
    """A config value out of its allowed range, naming the key, the value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={value!r} is not allowed: expected {allowed}")


class UnsupportedError(UsageError):
    """A combination this device or torch build cannot honour. Refused, never silently downgraded."""


class RunStopped(Exception):
    """A guard stopped the run (non-finite values, the scale at its minimum): not the user's typing, exit 1."""


class CommandLineRefused(BaseException):
    """A UsageError found by a Hydra callback (the check of every job of a sweep), carried out of Hydra to the
    router. A BaseException because Hydra turns an Exception raised by a callback into a warning and goes on."""

    def __init__(self, error: UsageError) -> None:
        super().__init__(str(error))
