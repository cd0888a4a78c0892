"""ampctl: a command-line runner for mixed-precision training experiments in PyTorch.

From Python: ampctl.train(overrides), ampctl.compare(...), ampctl.inspect(...), ampctl.memory(...),
ampctl.export(path, overrides), each returning an ampctl.Result (run_dir, summary); see ampctl/api.py."""

from ampctl.version import VERSION as __version__

API = ("train", "compare", "inspect", "memory", "export", "Result")
__all__ = [*API, "__version__"]


def __dir__() -> list[str]:
    """The public names too (they are imported on first use, so not in the module's dict yet)."""
    return sorted({*globals(), *API})


def __getattr__(name: str):
    # imported on first use: the command line's start does not pay for the API's imports
    if name in API:
        from ampctl import api

        return getattr(api, name)
    raise AttributeError(f"module 'ampctl' has no attribute {name!r}")
