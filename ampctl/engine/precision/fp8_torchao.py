"""Real FP8 training (precision=fp8): torchao's float8 training on GPUs with FP8 tensor cores.

torchao's convert_to_float8_training swaps the chosen nn.Linear layers for Float8Linear, whose three matmuls
(output, input gradient, weight gradient) run on FP8 tensor cores through torch._scaled_mm: e4m3 operands
forward, e5m2 gradients, scales computed from this step's amax per tensor ("tensorwise") or per row
("rowwise"). The weights stay fp32 and are the optimizer's masters; everything else runs under bfloat16
autocast (Float8Linear casts its input to the autocast dtype). torchao fuses the amax and cast kernels only
under torch.compile: run it with train.compile.enabled=true (an eager FP8 run is warned about).

Small layers are slower in FP8 (the casts cost more than the faster matmul saves), so by default only the
Linear layers that torchao's size heuristics (from H100 benchmarks) expect to gain are converted, as
torchtitan does; the rest stay bf16. This is the only module that imports torchao (an optional extra).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import torch
from torch import nn

from ampctl.engine import devices
from ampctl.engine.precision.converters import Converter, register_converter
from ampctl.errors import UsageError


class Float8RecipeName(Enum):
    tensorwise = "tensorwise"
    rowwise = "rowwise"


@dataclass
class Fp8TorchaoOptions:
    """Real FP8 through torchao's float8 training (ampctl/engine/precision/fp8_torchao.py)."""

    # tensorwise: one scale per tensor | rowwise: one per row (more accurate, slower)
    recipe_name: Float8RecipeName = Float8RecipeName.tensorwise
    auto_filter_small_kn: bool = True  # keep Linear layers too small to gain from FP8 in bf16 (torchao's heuristics)
    filter_fqns: list[str] = field(default_factory=list)  # keep Linear layers whose name contains one of these in bf16


MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell
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


def module_filter(config: Fp8TorchaoOptions) -> Callable[[nn.Module, str], bool]:
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


@register_converter
class TorchaoFp8Converter(Converter):
    """precision=fp8: torchao's Float8Linear for the Linear layers its size filter expects to gain."""

    name = "fp8_torchao"
    options_type = Fp8TorchaoOptions
    formats = ("fp8",)
    matmul_dtype = "float8"
    emulation = "fp8_emulated"
    runs_inside_autocast = "bfloat16"  # Float8Linear casts its input to the autocast dtype
    # under FSDP2 (tensorwise scaling) the weights are all-gathered in FP8, their scales computed once per step for
    # every layer (one all-reduce) after the optimizer step, as torchtitan does
    shards_with_fsdp = True
    _tied: frozenset[int] | set[int] = frozenset()  # ids of the weights two modules share (GPT's embedding and head)

    def unsupported_reason(self) -> str | None:
        return unsupported_reason(self.device)

    def shard_with_fsdp(self, model: nn.Module) -> None:
        super().shard_with_fsdp(model)
        names: dict[int, int] = {}
        for _, parameter in model.named_parameters(remove_duplicate=False):
            names[id(parameter)] = names.get(id(parameter), 0) + 1
        self._tied = {key for key, count in names.items() if count > 1}

    def wants(self, module: nn.Module, fqn: str) -> bool:
        if self.all_gathers_in_fp8 and id(getattr(module, "weight", None)) in self._tied:
            return False  # the FP8 all-gather wraps a weight in a parameter of its own: a tied one would come untied
        return module_filter(self.options)(module, fqn)

    def can_convert(self, module: nn.Module) -> bool:
        return isinstance(module, nn.Linear)

    def convert_model(self, model: nn.Module, chosen: dict[str, str]) -> None:
        """torchao's own entry point (it also applies its compile-time workarounds), for the chosen layers."""
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(self.options.recipe_name.value)
        if self.all_gathers_in_fp8:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda _module, fqn: fqn in chosen)

    @property
    def all_gathers_in_fp8(self) -> bool:
        """FSDP2 all-gathers the weights in FP8 (half the bytes of bf16): torchao does it for tensorwise scaling;
        rowwise scales each matmul's operand by its own rows, so its weights are all-gathered as they are."""
        return self.sharded and self.options.recipe_name is Float8RecipeName.tensorwise

    def weights_changed(self, model: nn.Module) -> None:
        if self.all_gathers_in_fp8:  # the next all-gathers' scales, from these weights, in one all-reduce
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)

    def check_converted(self, converted: list[str], linears: int) -> None:
        if not converted:  # a run labelled fp8 that computes nothing in FP8 would be bf16 under another name
            raise UsageError(nothing_converted_message(self.options, linears))

    def describe(self) -> str:
        f8 = self.options
        return (f"fp8=torchao recipe={f8.recipe_name.value} auto_filter_small_kn={f8.auto_filter_small_kn}"
                + (f" filter_fqns={list(f8.filter_fqns)}" if f8.filter_fqns else "")
                + (" fsdp_float8_all_gather=true" if self.all_gathers_in_fp8 else ""))

    def speed_warnings(self, compiled: bool) -> list[str]:
        if compiled:
            return []
        return ["without train.compile.enabled: torchao fuses FP8's scaling and casts only under torch.compile, so "
                "eager FP8 runs slower than bf16; add train.compile.enabled=true"]


def nothing_converted_message(config: Fp8TorchaoOptions, linears: int) -> str:
    name = config.recipe_name.value
    why = (f"torchao's {name} size filter keeps layers with {AUTO_FILTER_RULE[name]} in bf16, being slower in FP8"
           if config.auto_filter_small_kn
           else "none has dimensions that are multiples of 16, or all are named in precision.options.filter_fqns")
    return (f"precision=fp8 would convert none of this model's {linears} nn.Linear layers to FP8: {why}; "
            "use precision=bf16 for this model, or precision.options.auto_filter_small_kn=false to convert them "
            "anyway")
