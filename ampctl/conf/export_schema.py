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
    # a sharded (DCP) checkpoint's safetensors export (runner/checkpointing/export_sharded.py): HuggingFace's sharded
    # layout, each
    # file at most this many MiB of tensors (transformers' save_pretrained shards at 5 GB)
    max_file_mb: float = 5000.0
    # under torchrun, each rank writes its row block of every tensor; rank 0 then joins them into whole tensors
    # (false: the ranks' blocks are left as DCP wrote them, for DCP's HuggingFaceStorageReader)
    consolidate: bool = True

    def __post_init__(self) -> None:
        require(self.dir is None or bool(str(self.dir).strip()), "export.dir", self.dir, "a directory, or null")
        require(self.max_file_mb > 0, "export.max_file_mb", self.max_file_mb, "a number of MiB > 0")


@dataclass
class ExportAppConfig:
    """The primary config of `ampctl export PATH`: what to export, and how."""

    export: ExportConfig = field(default_factory=ExportConfig)
