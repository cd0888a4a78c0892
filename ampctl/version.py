"""ampctl's version: pyproject.toml's, the one place it is written (from the installed package's metadata, or from
pyproject.toml itself for a source checkout on PYTHONPATH that was never installed, as on the GPU image)."""

from __future__ import annotations

import pathlib
from importlib.metadata import PackageNotFoundError, version


def _version() -> str:
    try:
        return version("ampctl")
    except PackageNotFoundError:
        import tomllib

        pyproject = pathlib.Path(__file__).parents[1] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"]


VERSION = _version()
