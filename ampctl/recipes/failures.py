"""A user's recipe that raises while it trains, said as the user's mistake rather than as ampctl's traceback.

A type-level mistake (TypeError, ValueError, AttributeError, KeyError, IndexError in the recipe's own code) is one
line naming the member, its file and line, and what the protocol passes it (a refusal, exit 2). Any other error
raised in the user's own code (a RuntimeError of torch's, most often) stops the run (exit 1, its directory kept):
one line saying which member failed, at which step, under which precision, then the user's own frames only (not
Hydra's, ampctl's or torch's), the whole traceback in the run's log. Where the error is precision's, the line says
so: a constant the half type cannot hold, a dtype mismatch that autocast left.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import sys
import sysconfig
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from ampctl.errors import RecipeFailed, RunStopped, UsageError
from ampctl.recipes.base import Recipe, recipe_name

# What each member of the protocol receives and returns, for the line that names a recipe's mistake.
_MEMBERS = {
    "build_model": "build_model() takes no arguments and returns a torch.nn.Module",
    "batches": "batches(device, seed) returns an endless iterator of batches, on `device`",
    "loss": "loss(model, batch) gets one batch exactly as batches() yielded it and returns a scalar tensor",
}
NOT_DETERMINISTIC = "does not have a deterministic implementation"  # torch's words (torch.use_deterministic_algorithms)
TYPE_LEVEL = (TypeError, ValueError, AttributeError, KeyError, IndexError)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0].split(", set env var HYDRA_FULL_ERROR")[0] if text else type(exc).__name__


@dataclass(frozen=True)
class Context:
    """Where the run was when the recipe raised: `at step 3`, `building the model`; the precision mode's name and
    the half dtype its autocast or its weights compute in (None in fp32)."""

    where: str
    precision: str
    half: Optional[torch.dtype] = None
    rank: Optional[int] = None  # under torchrun: the rank that raised (the others may not have)


@contextlib.contextmanager
def recipe_errors(recipe: Recipe, context: Callable[[], Optional[Context]] = lambda: None) -> Iterator[None]:
    """A user's recipe's error, raised while training, as its mistake (recipe_error); context(): where the run was
    (asked only when the recipe raised)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised as it was unless it is the user's recipe's
        error = recipe_error(exc, recipe, context)
        if error is None:
            raise
        raise error from None


def recipe_error(exc: BaseException, recipe: Recipe, context: Callable[[], Optional[Context]] = lambda: None
                 ) -> Optional[Exception]:
    """The user's recipe's mistake as a UsageError (type-level) or a RecipeFailed (any other error raised in the
    user's code). None for errors elsewhere, and for ampctl's own recipes, whose errors are bugs with a traceback."""
    cls = type(getattr(recipe, "_recipe", recipe))
    if isinstance(exc, (UsageError, RunStopped)):  # said already (ampctl's checks, or a recipe that used them)
        return None
    if isinstance(exc, RuntimeError) and NOT_DETERMINISTIC in str(exc):  # any code's op: the config's choice
        op = str(exc).split(NOT_DETERMINISTIC)[0].strip()
        ctx = context()
        where = f" ({ctx.where})" if ctx is not None else ""
        return UsageError(f"train.deterministic=true: {op} has no deterministic implementation in torch{where}; "
                          f"run without train.deterministic, or replace {op} in recipe {recipe_name(recipe)}")
    if isinstance(exc, ValueError) and "more than 1 value per channel when training" in str(exc):
        # any recipe's (a built-in's too): its batch or input size, not its code
        return UsageError(f"recipe {recipe_name(recipe)}: a BatchNorm layer got one value per channel "
                          f"({first_line(exc)}), which it cannot normalize in training; raise recipe.batch_size "
                          f"(now {getattr(recipe, 'samples_per_batch', '?')} a batch) or the input size")
    if cls.__module__.startswith("ampctl."):
        return None
    try:
        source = inspect.getsourcefile(cls)
    except TypeError:
        return None
    extracted = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in extracted if f.filename == source]
    if not frames:
        return None
    member = next((f.name for f in frames if f.name in _MEMBERS), frames[-1].name)
    where = frames[-1]
    at = f"({Path(where.filename).name}:{where.lineno})"
    if isinstance(exc, TYPE_LEVEL):
        return UsageError(f"recipe {recipe_name(recipe)}: {member}() raised {type(exc).__name__}: {first_line(exc)} "
                          f"{at}; " + _MEMBERS.get(member, "see docs/models.md, 'Add your own recipe'"))
    ctx = context()
    when = "" if ctx is None else (f" {ctx.where}" + (f" on rank {ctx.rank}" if ctx.rank is not None else "")
                                   + f" under precision={ctx.precision}")
    hint = precision_hint(exc, where.line or "", ctx.half if ctx is not None else None)
    line = (f"recipe {recipe_name(recipe)}: {member}() raised {type(exc).__name__}{when}: {first_line(exc)} {at}"
            + (f"; {hint}" if hint else ""))
    own = [f for f in extracted if _users_own(f.filename)]
    return RecipeFailed(line, traceback.format_list(own), "".join(traceback.format_exception(exc)))


# torch's words for a Python number that does not fit the tensor's type, and for operands of two dtypes
_OVERFLOW = re.compile(r"value cannot be converted to type (?:c10::)?(\w+) without overflow")
_MISMATCH = re.compile(r"same dtype|expected scalar type \w+ but found \w+|dtype.* != |must have the same dtype")
_C10_TYPES = {"Half": torch.float16, "BFloat16": torch.bfloat16, "Float8_e4m3fn": torch.float8_e4m3fn,
              "Float8_e5m2": torch.float8_e5m2}
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?![\w.])")


def precision_hint(exc: BaseException, source_line: str, half: Optional[torch.dtype]) -> str:
    """What the error has to do with precision, in words; "" where it has nothing to do with it. source_line: the
    user's line that raised (its literals name the value that does not fit)."""
    text = str(exc)
    overflow = _OVERFLOW.search(text)
    if overflow and overflow.group(1) in _C10_TYPES:
        dtype = _C10_TYPES[overflow.group(1)]
        name, largest = str(dtype).removeprefix("torch."), torch.finfo(dtype).max
        too_large = [n for n in _NUMBER.findall(source_line) if abs(float(n)) > largest]
        value = f"{too_large[0]} does not fit" if too_large else "a value does not fit"
        return (f"{value} {name} (max {largest:g}): a tensor made like autocast's output (full_like, new_full, "
                "masked_fill) takes its dtype; use torch.finfo(x.dtype).min or .max, or make it in float32")
    if half is not None and _MISMATCH.search(text):
        name = str(half).removeprefix("torch.")
        return (f"a dtype mismatch: autocast runs the ops it lists (matmuls, convolutions) in {name} and leaves "
                "other tensors as they are; cast one operand with .to(other.dtype), or run the op inside autocast")
    return ""


_LIBRARY_ROOTS = tuple({os.path.dirname(os.path.dirname(__file__)), sysconfig.get_paths()["stdlib"],
                        sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], sys.prefix})


def _users_own(filename: str) -> bool:
    """A frame of the user's code: not ampctl's, not an installed library's, not Python's."""
    return not filename.startswith("<") and not os.path.abspath(filename).startswith(_LIBRARY_ROOTS)
