"""The model libraries a recipe imports (timm, transformers, torchvision), as one line when they cannot be.

torchvision's compiled operators are built for one torch release: a torchvision from another (the registry's
beside a CPU-only torch from PyTorch's index, say) fails on import with `operator torchvision::nms does not
exist`, deep inside timm or transformers. That is said here in one line naming both versions and the install
line that matches them.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from importlib import metadata
from types import ModuleType
from typing import Iterator, Optional

from ampctl.errors import UsageError


def import_library(name: str, recipe: str, extra: Optional[str] = None) -> ModuleType:
    """`import name` for `recipe`: not installed, one line naming the extra that installs it; torchvision
    built for another torch, one line naming both versions and the fix."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] != name.split(".")[0]:
            raise  # something it needs is missing: its own message names it
        install = f"pip install 'ampctl[{extra}]'" if extra else f"pip install {name}"
        raise UsageError(f"{recipe}: the {name} package is not installed; {install}") from None
    except RuntimeError as exc:
        if not torchvision_mismatch_in(exc):
            raise
        raise UsageError(f"{recipe}: {torchvision_mismatch()}") from None


@contextlib.contextmanager
def library_calls(recipe: str) -> Iterator[None]:
    """Calls into a model library (building a model, a config): a torchvision built for another torch, wherever it
    surfaces (transformers imports it lazily, deep in a model class, and wraps the error in its own), is the one
    line import_library says."""
    try:
        yield
    except UsageError:
        raise
    except Exception as exc:
        if torchvision_mismatch_in(exc):
            raise UsageError(f"{recipe}: {torchvision_mismatch()}") from None
        raise


def torchvision_mismatch_in(exc: BaseException) -> bool:
    """Whether exc, or an error it was raised from or during, is torchvision's missing compiled operator."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if "torchvision::" in str(exc) and "does not exist" in str(exc):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


def torchvision_mismatch() -> str:
    """What is installed and the line that installs a matching pair."""
    torch_version = _version("torch")
    vision_version = _version("torchvision")
    built_for = next((re.sub(r"[\s()]", "", r.split(";")[0]) for r in metadata.requires("torchvision") or []
                      if re.match(r"torch\s*\(?\s*[=<>~!]", r)), None)  # 'torch (>=2.14.0)' -> torch>=2.14.0
    release, _, build = torch_version.partition("+")
    index = f" --index-url https://download.pytorch.org/whl/{build}" if build else ""
    return (f"torchvision {vision_version} does not match torch {torch_version}"
            + (f" (it was built for {built_for})" if built_for else "")
            + f": its compiled operators are missing (operator torchvision::nms); replace it with the torchvision "
              f"built for this torch (the same version number can be another build, which a plain pip install "
              f"keeps): pip install --force-reinstall --no-deps {matching_torchvision(release)}{index}")


def matching_torchvision(torch_release: str) -> str:
    """The torchvision requirement built for a torch release: torch 2.M pairs with torchvision 0.(M+15) since
    torch 2.0 and torchvision 0.15 (pytorch/vision's compatibility table)."""
    parts = torch_release.split(".")
    if len(parts) >= 2 and parts[0] == "2" and parts[1].isdigit():
        return f"'torchvision==0.{int(parts[1]) + 15}.*'"
    return f"torchvision 'torch=={torch_release}'"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "(not installed)"
