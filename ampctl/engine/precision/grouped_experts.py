"""Grouped experts as converters see them (recipes/moe.py's GroupedExperts; a user's own alike): a module whose class
sets `ampctl_grouped_experts = True` and runs each of its grouped matmuls through its method `grouped(x, weight,
counts)`: x's rows sorted by expert, counts[e] of them expert e's, weight (experts, out, in); x_e @ weight[e]ᵀ for each
expert. A converter converts one by mixing a class of its own into the module's class (its parameters, their names and
the state_dict unchanged: as a dtype rule's scope is mixed in, engine/precision/layers.py), whose `grouped` computes
each expert's slice as the converter's Linear computes it: each GEMM's operands in blocks along its reduction
dimension within the expert, so the weight gradient's along the expert's own tokens (its group padded to whole blocks,
as torchao's pad_token_groups_for_grouped_mm pads it). Its forward is called as torchtitan's is, (x, counts), and
returns one row per row of x, in x's order: what `ampctl inspect` splits by expert (expert_rows)."""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn


def is_grouped_experts(module: nn.Module) -> bool:
    return bool(getattr(type(module), "ampctl_grouped_experts", False))


def expert_rows(args: tuple, output: object) -> list[int] | None:
    """The rows of a grouped experts forward's output each expert computed (a host read of its counts), or None
    where the call is not (x, counts) with an output of x's rows."""
    if len(args) < 2 or not isinstance(args[1], torch.Tensor) or not isinstance(output, torch.Tensor):
        return None
    x, counts = args[0], args[1]
    if counts.dim() != 1 or counts.is_floating_point() or not isinstance(x, torch.Tensor):
        return None
    sizes = counts.tolist()
    return sizes if sum(sizes) == x.shape[0] == output.shape[0] else None


def per_expert(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
               linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """linear(x_e, weight[e]) for each expert's rows, in order; an expert no token chose adds no rows (and its weight
    no gradient). The groups' sizes are read on the host: an emulation studies numerics, its speed is not a kernel's."""
    sizes = counts.tolist()
    outs = [linear(part, weight[e]) if sizes[e] else part.new_zeros(0, weight.shape[1])
            for e, part in enumerate(torch.split(x, sizes))]
    return torch.cat(outs)


def mix_into(module: nn.Module, mixin: type) -> nn.Module:
    """The module, its class now `mixin` over its own (named after the mixin's prefix: MXGroupedExperts)."""
    module.__class__ = _mixed(mixin, type(module))
    return module


@functools.lru_cache(maxsize=None)
def _mixed(mixin: type, cls: type) -> type:
    prefix = getattr(mixin, "class_prefix", "")
    return type(f"{prefix}{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})


class PerExpertLinear:
    """The base of a converter's mixin: each expert's slice of each grouped matmul through `expert_linear(x_e, w_e)`
    (its Linear's autograd function, with its state), in fp32 under any mode, the output in the input's dtype."""

    class_prefix = ""

    def expert_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def grouped(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            out = per_expert(x.float(), weight, counts, self.expert_linear)
        return out.to(x.dtype)
