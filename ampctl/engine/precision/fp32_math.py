"""The global switches deciding whether fp32 matmuls and convolutions may run in reduced precision (TF32 on
CUDA, bf16 via oneDNN on CPU): read, set for a run, and restore.

torch >= 2.9 has per-backend ``fp32_precision`` settings ("ieee" | "tf32" | "none" = inherit) and raises if
they are read after being mixed with the legacy ``allow_tf32`` / ``set_float32_matmul_precision`` API, so
only one of the two APIs is ever touched: the new one where it exists, the legacy one otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

# The leaves that decide the math of fp32 matmuls/convolutions/RNNs on CUDA (cuBLAS, cuDNN) and CPU (oneDNN).
_LEAVES = ("cuda.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")


def _has_new_api() -> bool:
    return hasattr(torch.backends, "fp32_precision") and hasattr(torch.backends.cuda.matmul, "fp32_precision")


def _leaf(path: str) -> Any:
    obj: Any = torch.backends
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _leaves() -> list[str]:
    return [path for path in _LEAVES if hasattr(_leaf(path), "fp32_precision")]


def snapshot() -> dict[str, Any]:
    """The current settings, to hand back to restore()."""
    if _has_new_api():
        return {path: _leaf(path).fp32_precision for path in _leaves()}
    return {
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
    }


def restore(saved: dict[str, Any]) -> None:
    if _has_new_api():
        for path, value in saved.items():
            _leaf(path).fp32_precision = value
        return
    torch.set_float32_matmul_precision(saved["float32_matmul_precision"])
    torch.backends.cuda.matmul.allow_tf32 = saved["cuda_matmul_allow_tf32"]
    torch.backends.cudnn.allow_tf32 = saved["cudnn_allow_tf32"]


def set_tf32(enabled: bool) -> None:
    """TF32 for CUDA matmuls and cuDNN when enabled; otherwise IEEE fp32 everywhere. cuDNN allows TF32 by
    default and oneDNN may be told to use bf16, so "off" is set explicitly on every backend: true fp32."""
    if _has_new_api():
        cuda_mode = "tf32" if enabled else "ieee"
        for path in _leaves():
            _leaf(path).fp32_precision = cuda_mode if path.startswith("cud") else "ieee"
        return
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def describe() -> str:
    """The current settings in one line, for the run's log."""
    return ", ".join(f"{k}={v}" for k, v in snapshot().items())
