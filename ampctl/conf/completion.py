"""Shell completion's answers where Hydra's are not the command's: a key whose value is a list.

Hydra completes any list-typed key as a node to descend into (`compare.precisions.`, for its indices), and a list
that is null has none: the completed word ended in a dot that led nowhere. Such a key is a value to set as a whole
(`compare.precisions=[fp32,bf16]`), so its completion ends in `=`; the schema's types say which keys these are.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Optional


def _field_type(schema: Any, dotted: str) -> Optional[Any]:
    """The annotated type of a dotted key in a schema dataclass, Optional unwrapped; None where the path leaves
    what the schema types (an open node: recipe.*, optimizer.*)."""
    node: Any = schema
    annotation: Any = None
    for part in dotted.split("."):
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
            return None
        hints = typing.get_type_hints(node)
        if part not in hints:
            return None
        annotation = _without_optional(hints[part])
        node = annotation
    return annotation


def _without_optional(annotation: Any) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if typing.get_origin(annotation) is typing.Union and len(args) == 1 else annotation


def is_a_list(schema: Any, dotted: str) -> bool:
    annotation = _field_type(schema, dotted)
    return typing.get_origin(annotation) in (list, tuple) or annotation in (list, tuple)


def set_lists_whole(words: list[str], schema: Any) -> list[str]:
    """Hydra's completed words with each list-typed key's trailing dot made `=`."""
    return [f"{w[:-1]}=" if w.endswith(".") and is_a_list(schema, w[:-1].lstrip("+~")) else w for w in words]
