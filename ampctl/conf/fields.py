"""How a schema marks a field a resumed run may change: the one helper every schema module uses."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


def safe_to_change(default: Any = dataclasses.MISSING, **kwargs: Any) -> Any:
    """A field a resumed run may change (a node: any key under it), with its default. Every other difference
    from the checkpoint's config is refused, and left out of the hash that identifies a run (runner/identity.py);
    safe_to_change_keys() lists them."""
    return field(default=default, metadata={"safe_to_change": True}, **kwargs)
