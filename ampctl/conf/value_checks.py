"""The primitives of the schemas' range checks: one refusal format, the loss-scale range, durations."""

from __future__ import annotations

import math
import re
from typing import Any, Optional

from ampctl.errors import ConfigError


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, value, allowed)


def positive_finite(x: float) -> bool:
    return x > 0 and math.isfinite(x)


# A loss scale lives in an fp32 tensor and the gradients are unscaled by its reciprocal, so both must be
# finite in fp32: 2^-126 (fp32's smallest normal) up to fp32's max.
LOSS_SCALE_RANGE = (2.0**-126, 3.4028234663852886e38)
LOSS_SCALE_ALLOWED = ("a number in [2^-126, 3.4e38] (the scale is an fp32 tensor and the gradients are "
                      "unscaled by its reciprocal: both must be finite)")


def loss_scale_ok(x: float) -> bool:
    return LOSS_SCALE_RANGE[0] <= x <= LOSS_SCALE_RANGE[1]


def yaml_text(value: Any) -> str:
    return "null" if value is None else f"{value:g}"


def budget_seconds(text: str) -> Optional[float]:
    """'1h30m' -> 5400.0; None when it is no duration (a positive one of h, min or m, s)."""
    number = r"(\d+(?:\.\d+)?)"
    match = re.fullmatch(rf"\s*(?:{number}\s*h)?\s*(?:{number}\s*(?:min|m))?\s*(?:{number}\s*s)?\s*", str(text))
    if match is None or not any(match.groups()):
        return None
    hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    return total if total > 0 else None
