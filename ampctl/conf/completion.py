"""Shell completion's answers where Hydra's are not the command's: a key whose value is a list, and a key whose
value is one of a few.

Hydra completes any list-typed key as a node to descend into (`compare.precisions.`, for its indices), and a list
that is null has none: the completed word ended in a dot that led nowhere. Such a key is a value to set as a whole
(`compare.precisions=[fp32,bf16]`), so its completion ends in `=`; the schema's types say which keys these are.
For a value, Hydra offers the current one as OmegaConf prints it (`guard.on_trip=TripAction.stop`, which is no
value to type): an Enum key's members are offered by their values (stop, escalate), and a key the schema marks
with its choices (conf/fields.one_of: `diff.against=` a precision mode) offers those.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any, Callable, Optional

from ampctl.conf.fields import OptionsOf


def _field(schema: Any, dotted: str) -> tuple[Optional[Any], dict]:
    """The annotated type of a dotted key in a schema dataclass, Optional unwrapped, and its field's metadata; None
    where the path leaves what the schema types (an open node: recipe.*, optimizer.*)."""
    node: Any = schema
    annotation: Any = None
    metadata: dict = {}
    for part in dotted.split("."):
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
            return None, {}
        hints = typing.get_type_hints(node)
        if part not in hints:
            return None, {}
        annotation = _without_optional(hints[part])
        metadata = dict(next(f.metadata for f in dataclasses.fields(node) if f.name == part))
        node = annotation
    return annotation, metadata


def _field_type(schema: Any, dotted: str) -> Optional[Any]:
    return _field(schema, dotted)[0]


def _without_optional(annotation: Any) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if typing.get_origin(annotation) is typing.Union and len(args) == 1 else annotation


def is_a_list(schema: Any, dotted: str) -> bool:
    annotation = _field_type(schema, dotted)
    return typing.get_origin(annotation) in (list, tuple) or annotation in (list, tuple)


def value_choices(schema: Any, dotted: str, group_options: Callable[[str], list[str]]) -> Optional[list[str]]:
    """What a key's value may be, where the schema says: an Enum's member values, or its field's choices (a group's
    options through group_options). None where it says nothing (any number, any path)."""
    annotation, metadata = _field(schema, dotted)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [str(member.value) for member in annotation]
    choices = metadata.get("choices")
    if isinstance(choices, OptionsOf):
        return group_options(choices.group)
    return list(choices) if choices is not None else None


def set_lists_whole(words: list[str], schema: Any) -> list[str]:
    """Hydra's completed words with each list-typed key's trailing dot made `=`."""
    return [f"{w[:-1]}=" if w.endswith(".") and is_a_list(schema, w[:-1].lstrip("+~")) else w for w in words]
