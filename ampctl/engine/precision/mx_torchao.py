"""precision.options.kernels=torchao|auto for precision=mxfp8: torchao's own MXFP8 training layer
(torchao.prototype.moe_training.mxfp8_linear.MXFP8Linear, the module torchtitan builds its MXFP8 models from) in
place of ampctl's emulated one. On a GPU with MXFP8 tensor cores (compute capability 10.0+: B200, GB200) it runs
torchao's kernels (KernelPreference.AUTO); elsewhere torchao's emulated reference (KernelPreference.EMULATED: the
same quantization in torch ops), which runs on any machine, so that the path a B200 runs is tested on a CPU:
in fp32 it equals ampctl's emulation bit for bit (tests/unit/test_mx_torchao.py).

torchao's layer is used as a module, not through quantize_(MXFP8TrainingOpConfig), whose weight wrapper (torchao
0.18) drops the bias of F.linear (pytorch/ao#4846) and makes the parameters a tensor subclass that a weights-only
checkpoint does not load."""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, Optional

import torch

from ampctl.engine import devices

MXFP8_KERNELS_CAPABILITY = (10, 0)
BLOCK = 32  # MXFP8's block
_LAYER = "torchao.prototype.moe_training.mxfp8_linear"


def missing() -> Optional[str]:
    """Why torchao's MXFP8 layer cannot be imported here (None when it can)."""
    if importlib.util.find_spec("torchao") is None:
        return "needs torchao, an optional extra: pip install 'ampctl[fp8]'"
    try:
        importlib.import_module(_LAYER)
    except Exception as exc:  # an older torchao, or one built for another torch
        return f"needs torchao's MXFP8 training layer ({_LAYER}.MXFP8Linear, torchao 0.18+): {type(exc).__name__}"
    return None


def has_kernels(device: torch.device) -> bool:
    """Whether the device has MXFP8 tensor cores, which torchao's kernels need."""
    return device.type == "cuda" and devices.cuda_capability(device) >= MXFP8_KERNELS_CAPABILITY


@functools.lru_cache(maxsize=None)
def layer_class() -> type:
    """torchao's MXFP8Linear as a ConvertedLinear (made on first use: torchao is optional and slow to import)."""
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

    from ampctl.engine.precision.converters import ConvertedLinear

    class TorchaoMXFP8Linear(ConvertedLinear, MXFP8Linear):
        """An nn.Linear computed by torchao's MXFP8 training layer. torchao quantizes whole blocks of 32 only: the
        tokens are zero-padded to a multiple of 32 (a zero row adds nothing to the weight gradient's blocks along the
        tokens, and its output is dropped), as ampctl's emulation pads."""

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            x = input.reshape(-1, input.shape[-1])
            pad = (-x.shape[0]) % BLOCK
            out = MXFP8Linear.forward(self, torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x)
            return out[:x.shape[0]].reshape(*input.shape[:-1], out.shape[-1])

    return TorchaoMXFP8Linear


def fits(linear: torch.nn.Linear) -> bool:
    """Whether torchao's layer computes this Linear: both its dimensions in whole blocks of 32 (the others stay in
    ampctl's emulation, which pads them; the layer table names each layer's class)."""
    return linear.in_features % BLOCK == 0 and linear.out_features % BLOCK == 0


def convert(linear: torch.nn.Linear, real_kernels: bool, scale_mode: str) -> Any:
    """The Linear as torchao's MXFP8 layer, sharing its parameters: its kernels, or its emulated reference."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    preference = KernelPreference.AUTO if real_kernels else KernelPreference.EMULATED
    return layer_class().from_linear(linear, kernel_preference=preference,
                                     scale_calculation_mode=ScaleCalculationMode[scale_mode.upper()])
