"""ampctl's version: pyproject.toml's, the one place it is written (from the installed package's metadata, or from
pyproject.toml itself for a source checkout on PYTHONPATH that was never installed, as on the GPU image)."""

from __future__ import annotations

import pathlib
from importlib.metadata import PackageNotFoundError, version


def _version() -> str:
    try:
        return version("ampctl")
    except PackageNotFoundError:
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10: the same parser, as a package (a dependency there)
            import tomli as tomllib  # type: ignore[no-redef]

        pyproject = pathlib.Path(__file__).parents[1] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"]


VERSION = _version()
