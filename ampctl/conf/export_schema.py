"""`ampctl export`'s settings (export.*): types, defaults and range checks, one place for each. Composed from
conf/export.yaml as every command's config is (shell/command.py), its values typed by these Enums."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from ampctl.conf.value_checks import require


class ExportDtype(enum.Enum):
    """The dtype the weights are written in (floating tensors; integer buffers as they are)."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class ExportFormat(enum.Enum):
    safetensors = "safetensors"
    pt = "pt"
    hf = "hf"  # transformers' save_pretrained directory (recipe=hf_causal_lm)


class ExportWeights(enum.Enum):
    model = "model"
    ema = "ema"  # the run's fp32 weight average (train.ema.decay)


@dataclass
class ExportConfig:
    dtype: ExportDtype = ExportDtype.float32
    format: ExportFormat = ExportFormat.safetensors
    weights: ExportWeights = ExportWeights.model
    # the directory the export is written to, which must not exist; null: <run dir>/exports/step_<N>-<weights>-<dtype>
    dir: Optional[str] = None

    def __post_init__(self) -> None:
        require(self.dir is None or bool(str(self.dir).strip()), "export.dir", self.dir, "a directory, or null")


@dataclass
class ExportAppConfig:
    """The primary config of `ampctl export PATH`: what to export, and how."""

    export: ExportConfig = field(default_factory=ExportConfig)
