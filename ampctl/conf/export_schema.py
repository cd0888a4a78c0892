"""`ampctl export`'s settings (export.*): types, defaults and range checks, one place for each."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from ampctl.conf.value_checks import require
from ampctl.errors import UsageError

DTYPES = ("float32", "bfloat16", "float16")
FORMATS = ("safetensors", "pt", "hf")  # hf: transformers' save_pretrained directory (recipe=hf_causal_lm)
WEIGHTS = ("model", "ema")  # ema: the run's fp32 weight average (train.ema_decay)


@dataclass
class ExportConfig:
    dtype: str = "float32"  # the dtype the weights are written in (floating tensors; integer buffers as they are)
    format: str = "safetensors"
    weights: str = "model"
    # the directory the export is written to, which must not exist; null: <run dir>/exports/step_<N>-<weights>-<dtype>
    dir: Optional[str] = None

    def __post_init__(self) -> None:
        require(self.dtype in DTYPES, "export.dtype", self.dtype, " | ".join(DTYPES))
        require(self.format in FORMATS, "export.format", self.format,
                " | ".join(FORMATS) + " (hf: a transformers directory, for recipe=hf_causal_lm)")
        require(self.weights in WEIGHTS, "export.weights", self.weights,
                "model | ema (the weight average a run with train.ema_decay keeps)")
        require(self.dir is None or bool(str(self.dir).strip()), "export.dir", self.dir, "a directory, or null")

    @classmethod
    def from_overrides(cls, overrides: list[str]) -> "ExportConfig":
        """`export.dtype=bfloat16 ...` as the command line gives them; one line naming a bad key or value."""
        names = [f.name for f in fields(cls)]
        given: dict[str, Any] = {}
        for override in overrides:
            key, sep, value = override.partition("=")
            name = key.removeprefix("export.")
            if not sep or not key.startswith("export."):
                raise UsageError(f"{override!r}: expected export.KEY=VALUE ({', '.join(names)})")
            if name not in names:
                from ampctl.conf.messages import did_you_mean

                raise UsageError(f"{key}: no such key{did_you_mean(name, names)}; allowed: {', '.join(names)}")
            given[name] = None if value in ("null", "~") and name == "dir" else value
        return cls(**given)
