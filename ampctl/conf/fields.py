"""How a schema marks a field: one a resumed run may change, one whose value is one of a few (shell completion offers
them). The helpers every schema module uses."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


def safe_to_change(default: Any = dataclasses.MISSING, choices: Any = None, **kwargs: Any) -> Any:
    """A field a resumed run may change (a node: any key under it), with its default. Every other difference
    from the checkpoint's config is refused, and left out of the hash that identifies a run (runner/identity.py);
    safe_to_change_keys() lists them. choices: as one_of's."""
    return field(default=default, metadata={"safe_to_change": True, **_choices(choices)}, **kwargs)


@dataclasses.dataclass(frozen=True)
class OptionsOf:
    """The options of a config group (precision: fp32, bf16, ... and a -cd directory's own), as a value's choices."""

    group: str


def one_of(default: Any, choices: Any) -> Any:
    """A string field whose value is one of `choices`: a tuple of them, or OptionsOf(group) (the schema's own
    __post_init__ checks the value; this says what completion offers). An Enum field needs none: its members are
    its choices."""
    return field(default=default, metadata=_choices(choices))


def _choices(choices: Any) -> dict[str, Any]:
    return {"choices": choices} if choices is not None else {}
