"""The primitives of the schema's range checks: one refusal format, the loss-scale range."""

from __future__ import annotations

import math
from typing import Any

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
