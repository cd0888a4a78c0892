"""ampctl: a command-line runner for mixed-precision training experiments in PyTorch.

From Python: ampctl.train(overrides), ampctl.compare(...), ampctl.inspect(...), ampctl.memory(...),
ampctl.advise(...), ampctl.export(path, overrides), each returning an ampctl.Result (run_dir, summary): one function
per command, from its record (ampctl/api.py)."""

from ampctl.version import VERSION as __version__  # noqa: F401 - the package's version attribute


def _public() -> list[str]:
    from ampctl import api

    return [*api.functions(), "Result"]


def __dir__() -> list[str]:
    """The public names too (they are imported on first use, so not in the module's dict yet)."""
    return sorted({*globals(), *_public()})


def __getattr__(name: str):
    # imported on first use: the command line's start does not pay for the API's imports
    if name == "__all__":
        return [*_public(), "__version__"]
    if not name.startswith("_") and not _a_submodule(name):  # `from ampctl import io` imports the module
        from ampctl import api

        found = api.Result if name == "Result" else api.functions().get(name)
        if found is not None:
            return found
    raise AttributeError(f"module 'ampctl' has no attribute {name!r}")


def _a_submodule(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(f"{__name__}.{name}") is not None
