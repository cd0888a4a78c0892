"""Real FP8 training (precision=fp8): torchao's float8 training on GPUs with FP8 tensor cores.

torchao's convert_to_float8_training swaps the chosen nn.Linear layers for Float8Linear, whose three matmuls
(output, input gradient, weight gradient) run on FP8 tensor cores through torch._scaled_mm: e4m3 operands
forward, e5m2 gradients, scales computed from this step's amax per tensor ("tensorwise") or per row
("rowwise"). The weights stay fp32 and are the optimizer's masters; everything else runs under bfloat16
autocast (Float8Linear casts its input to the autocast dtype). torchao fuses the amax and cast kernels only
under torch.compile: run it with train.compile=true (an eager FP8 run is warned about).

Small layers are slower in FP8 (the casts cost more than the faster matmul saves), so by default only the
Linear layers that torchao's size heuristics (from H100 benchmarks) expect to gain are converted, as
torchtitan does; the rest stay bf16. This is the only module that imports torchao (an optional extra).
"""

from __future__ import annotations

import importlib.util
from typing import Callable

import torch
from torch import nn

from ampctl.conf.schema import Fp8TorchaoConfig
from ampctl.engine import devices

MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell
RECIPES = ("tensorwise", "rowwise")
# torchao's auto filter skips a Linear (weight N x K) in these cases; said to the user when nothing is left.
AUTO_FILTER_RULE = {
    "tensorwise": "K <= 4096 and N <= 1024",
    "rowwise": "N <= 2048, K <= 1024, or N <= 4096 and K <= 2048",
}


def torchao_available() -> bool:
    return importlib.util.find_spec("torchao") is not None


def unsupported_reason(device: torch.device) -> str | None:
    """Why precision=fp8 cannot run here (None when it can): the first line of a refusal."""
    if device.type != "cuda":
        return (f"needs FP8 tensor cores (a CUDA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+, "
                f"as Ada, Hopper and Blackwell); this run is on a CPU ({devices.device_name(device)})")
    capability = devices.cuda_capability(device)
    if capability < MIN_CAPABILITY:
        return (f"needs FP8 tensor cores (compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+); "
                f"{devices.device_name(device)} is {capability[0]}.{capability[1]}")
    if not torchao_available():
        return "needs torchao, an optional extra: pip install 'ampctl[fp8]'"
    return None


def module_filter(config: Fp8TorchaoConfig) -> Callable[[nn.Module, str], bool]:
    """Which nn.Linear layers become Float8Linear: torchao's own size heuristics, or every layer whose
    dimensions the FP8 matmul accepts (multiples of 16), less the named ones either way."""
    if config.auto_filter_small_kn:
        from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

        return _auto_filter_for_recipe(config.recipe_name.value, list(config.filter_fqns))

    def fits(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or any(name in fqn for name in config.filter_fqns):
            return False
        n, k = module.weight.shape
        return n % 16 == 0 and k % 16 == 0

    return fits


def convert_linears(model: nn.Module, config: Fp8TorchaoConfig) -> list[str]:
    """Swap the chosen Linear layers for torchao's Float8Linear in place; returns their names."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    chosen = module_filter(config)
    names = [fqn for fqn, module in model.named_modules() if chosen(module, fqn)]
    if names:
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(config.recipe_name.value),
                                   module_filter_fn=chosen)
    return names


def nothing_converted_message(config: Fp8TorchaoConfig, linears: int) -> str:
    name = config.recipe_name.value
    why = (f"torchao's {name} size filter keeps layers with {AUTO_FILTER_RULE[name]} in bf16, being slower in FP8"
           if config.auto_filter_small_kn
           else "none has dimensions that are multiples of 16, or all are named in precision.fp8_torchao.filter_fqns")
    return (f"precision=fp8 would convert none of this model's {linears} nn.Linear layers to FP8: {why}; "
            "use precision=bf16 for this model, or precision.fp8_torchao.auto_filter_small_kn=false to convert them "
            "anyway")
