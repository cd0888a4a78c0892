"""What torch.autocast does to a layer's math on a device type, asked of torch itself.

Autocast keeps per device type a list of ops it runs in its low-precision dtype (linear, conv, matmul, ...) and a
list it runs in fp32; an op on neither runs in the dtype of its input. The lists differ by device: on a CUDA GPU
layer_norm and group_norm are fp32 ops, on a CPU no norm is on either list, so a norm after a bf16 Linear runs in
bf16 there. torch has no public API for the lists, so each layer type's op is asked, once per device type and
dtype, on tiny tensors under autocast: what it makes of an fp32 input (the low dtype: cast down), and of a half
input (fp32: cast up; half: left as its input). A layer of another type (a library's own module) runs whatever
ops its forward calls, each as autocast decides: said as "per op".
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Optional

import torch
from torch import nn

LOWER, FP32, AS_INPUT, PER_OP = "lower", "fp32", "as input", "per op"

Probe = Callable[[], tuple[nn.Module, Callable[[torch.dtype], tuple]]]


def _shaped(*shape: int) -> Callable[[torch.dtype], tuple]:
    return lambda dtype: (torch.randn(*shape, dtype=dtype),)


# the layer types whose op is asked (a subclass is asked as its base: timm's Linear is an nn.Linear)
PROBES: dict[type, Probe] = {
    nn.Linear: lambda: (nn.Linear(4, 4), _shaped(2, 4)),
    nn.Bilinear: lambda: (nn.Bilinear(4, 4, 4), lambda dtype: (torch.randn(2, 4, dtype=dtype),) * 2),
    nn.Conv1d: lambda: (nn.Conv1d(4, 4, 3), _shaped(1, 4, 6)),
    nn.Conv2d: lambda: (nn.Conv2d(4, 4, 3), _shaped(1, 4, 6, 6)),
    nn.Conv3d: lambda: (nn.Conv3d(4, 4, 3), _shaped(1, 4, 4, 4, 4)),
    nn.ConvTranspose1d: lambda: (nn.ConvTranspose1d(4, 4, 3), _shaped(1, 4, 6)),
    nn.ConvTranspose2d: lambda: (nn.ConvTranspose2d(4, 4, 3), _shaped(1, 4, 6, 6)),
    nn.ConvTranspose3d: lambda: (nn.ConvTranspose3d(4, 4, 3), _shaped(1, 4, 4, 4, 4)),
    nn.MultiheadAttention: lambda: (nn.MultiheadAttention(4, 2, batch_first=True),
                                    lambda dtype: (torch.randn(1, 3, 4, dtype=dtype),) * 3),
    nn.LSTM: lambda: (nn.LSTM(4, 4, batch_first=True), _shaped(1, 3, 4)),
    nn.GRU: lambda: (nn.GRU(4, 4, batch_first=True), _shaped(1, 3, 4)),
    nn.RNN: lambda: (nn.RNN(4, 4, batch_first=True), _shaped(1, 3, 4)),
    nn.PReLU: lambda: (nn.PReLU(), _shaped(2, 4)),
    nn.LayerNorm: lambda: (nn.LayerNorm(4), _shaped(2, 4)),
    nn.GroupNorm: lambda: (nn.GroupNorm(2, 4), _shaped(2, 4, 3)),
    nn.BatchNorm1d: lambda: (nn.BatchNorm1d(4), _shaped(2, 4)),
    nn.BatchNorm2d: lambda: (nn.BatchNorm2d(4), _shaped(2, 4, 3, 3)),
    nn.BatchNorm3d: lambda: (nn.BatchNorm3d(4), _shaped(2, 4, 2, 2, 2)),
    nn.InstanceNorm1d: lambda: (nn.InstanceNorm1d(4, affine=True), _shaped(2, 4, 5)),
    nn.InstanceNorm2d: lambda: (nn.InstanceNorm2d(4, affine=True), _shaped(2, 4, 3, 3)),
    nn.InstanceNorm3d: lambda: (nn.InstanceNorm3d(4, affine=True), _shaped(2, 4, 2, 2, 2)),
    **({nn.RMSNorm: lambda: (nn.RMSNorm(4), _shaped(2, 4))} if hasattr(nn, "RMSNorm") else {}),
}
# a lookup: the output is the weight's dtype, whatever autocast does
WEIGHTS_DTYPE = (nn.Embedding, nn.EmbeddingBag)


def probed_type(module: nn.Module) -> Optional[type]:
    """The type whose op decides the module's math: its own class or the nearest base that is probed."""
    return next((cls for cls in type(module).__mro__ if cls in PROBES), None)


def under_autocast(module: nn.Module, device_type: str, dtype: torch.dtype) -> str:
    """What autocast(device_type, dtype) does to the module's math: LOWER, FP32, AS_INPUT, or PER_OP (a type of
    its own: its forward's ops decide). An embedding's lookup is FP32 with fp32 weights (their dtype)."""
    if isinstance(module, WEIGHTS_DTYPE):
        return FP32
    if getattr(module, "ampctl_under_autocast", None) in (LOWER, FP32, AS_INPUT):
        return module.ampctl_under_autocast  # a module that casts for autocast itself says what it does
    cls = probed_type(module)
    return PER_OP if cls is None else _asked(cls, device_type, dtype)


@functools.lru_cache(maxsize=None)
def _asked(cls: type, device_type: str, dtype: torch.dtype) -> str:
    def output_dtype(input_dtype: torch.dtype) -> Optional[torch.dtype]:
        # the run's random streams untouched (its first batch and weights are a hand-written loop's), and a
        # library's warning about mixed dtypes not shown for a probe
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module, inputs = PROBES[cls]()
            try:
                module = module.to(device_type)
                with torch.no_grad(), torch.autocast(device_type, dtype=dtype):
                    out = module(*(t.to(device_type) for t in inputs(input_dtype)))
            except (RuntimeError, TypeError, ValueError):  # a kernel this device lacks for that combination
                return None
        return (out[0] if isinstance(out, tuple) else out).dtype

    from_fp32 = output_dtype(torch.float32)
    if from_fp32 == dtype:
        return LOWER
    from_half = output_dtype(dtype)
    if from_fp32 is None:  # cast down to a kernel the device lacks (oneDNN's bf16 LSTM without AVX512)
        return LOWER if from_half == dtype else AS_INPUT
    return FP32 if from_half == torch.float32 else AS_INPUT
