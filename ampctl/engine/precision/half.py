"""O2 and O3's model converter: the model cast to half the way Apex did (the layers a rule keeps in fp32, O2's
normalization layers by default, kept and run in fp32), and the weight layout the optimizer steps on (fp32
masters under O2)."""

from __future__ import annotations

import copy
import re
from typing import Any, Optional

import torch
from torch import nn

from ampctl import io

# Normalization layers (a rule's type=norm; kept and run in fp32 under O2 by its default rule): their statistics
# are where half precision loses the most (Apex kept BatchNorm; transformers need LayerNorm too).
NORM_LAYERS: tuple[type[nn.Module], ...] = tuple(
    t
    for t in (
        nn.modules.batchnorm._BatchNorm,
        nn.LayerNorm,
        nn.GroupNorm,
        nn.modules.instancenorm._InstanceNorm,
        getattr(nn, "RMSNorm", None),
    )
    if t is not None
)
# The norms libraries write themselves (transformers' LlamaRMSNorm, T5LayerNorm; many models' own RMSNorm), by
# the names they share: leaf modules only, so that a block named ...LayerNorm... is not taken whole.
NORM_CLASS_NAME = re.compile(r"(rms|layer|group|batch|instance)norm(\dd)?$", re.IGNORECASE)


def is_norm_layer(module: nn.Module) -> bool:
    return isinstance(module, NORM_LAYERS) or (NORM_CLASS_NAME.search(type(module).__name__) is not None
                                               and next(module.children(), None) is None)


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """Cast the floating-point tensors in (nested tuples/lists/dicts of) value; leave everything else."""
    return io.map_tensors(value, lambda t: t.to(dtype) if t.is_floating_point() else t)


class FP32GradAccumulation:
    """precision.grad_accum_dtype=float32 with train.grad_accum_steps > 1 where weights are half: each micro-batch's
    half gradient, as backward makes it, is added into an fp32 gradient of its own and freed (a post-accumulate-grad
    hook, as Megatron's `main_grad`), so that the small contributions are not rounded away at every addition in the
    half type. O2: the fp32 gradient is its master's (the optimizer steps from it); otherwise a buffer kept from step
    to step (4 bytes a parameter), rounded once into the half gradient the optimizer steps from, and zeroed."""

    def __init__(self, params: list[nn.Parameter], masters: Optional[dict[nn.Parameter, nn.Parameter]] = None) -> None:
        self.masters = masters
        self.buffers = {} if masters is not None else {p: torch.zeros_like(p, dtype=torch.float32) for p in params}
        self._handles = [p.register_post_accumulate_grad_hook(self._add) for p in params]

    @torch.no_grad()
    def _add(self, param: nn.Parameter) -> None:
        if self.masters is not None:
            master = self.masters[param]
            if master.grad is None:
                master.grad = param.grad.float()
            else:
                master.grad.add_(param.grad)
        else:
            self.buffers[param].add_(param.grad)
        param.grad = None

    @torch.no_grad()
    def hand_over(self) -> None:
        """After the step's last backward: the sums, rounded once, as the half parameters' gradients."""
        for param, buffer in self.buffers.items():
            param.grad = buffer.to(param.dtype)
            buffer.zero_()

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class WeightLayout:
    """The weights the optimizer steps on are the model's own (every mode but O2). accumulate_in_fp32: the half
    ones' micro-batch gradients add up in fp32 (FP32GradAccumulation)."""

    def __init__(self, model: nn.Module, accumulate_in_fp32: bool = False) -> None:
        self.optimizer_params = [p for p in model.parameters() if p.requires_grad]
        half = [p for p in self.optimizer_params if p.dtype != torch.float32]
        self.accumulation = FP32GradAccumulation(half) if accumulate_in_fp32 and half else None

    def grads_to_masters(self) -> None:
        """Called after the last backward of a step, before unscale_."""
        if self.accumulation is not None:
            self.accumulation.hand_over()

    def masters_to_model(self) -> None:
        """Called after the optimizer step."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class FP32MasterWeights(WeightLayout):
    """O2: the optimizer steps on fp32 copies of the half weights.

    Half gradients are copied into fp32 master gradients before unscale_ (torch's GradScaler refuses to
    unscale fp16 gradients, and the update must be computed in fp32 to not lose small steps). After the
    step the masters are copied back into the half model. Weights that are already fp32 (norm layers)
    are their own masters. A skipped step leaves the masters, and so the model, untouched. accumulate_in_fp32:
    each micro-batch's half gradient goes straight into its master's fp32 gradient (FP32GradAccumulation).
    """

    def __init__(self, model: nn.Module, accumulate_in_fp32: bool = False) -> None:
        self._pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        self.optimizer_params = []
        for p in model.parameters():
            if not p.requires_grad:
                continue
            if p.dtype == torch.float32:
                self.optimizer_params.append(p)
                continue
            master = nn.Parameter(p.detach().float())
            self._pairs.append((p, master))
            self.optimizer_params.append(master)
        self.accumulation = (FP32GradAccumulation([p for p, _ in self._pairs], dict(self._pairs))
                             if accumulate_in_fp32 and self._pairs else None)

    def grads_to_masters(self) -> None:
        if self.accumulation is not None:
            return  # every micro-batch's gradient is in its master's already
        for model_param, master in self._pairs:
            master.grad = None if model_param.grad is None else model_param.grad.float()
            model_param.grad = None

    @torch.no_grad()
    def masters_to_model(self) -> None:
        for model_param, master in self._pairs:
            model_param.copy_(master)

    def state_dict(self) -> dict[str, Any]:
        return {"masters": [master.detach() for _, master in self._pairs]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["masters"]
        if len(saved) != len(self._pairs):
            raise ValueError(f"{len(saved)} fp32 master weights saved, {len(self._pairs)} in this model")
        for (_, master), value in zip(self._pairs, saved):
            master.copy_(value)


def cast_model_to_half(model: nn.Module, half: torch.dtype, fp32_layers: list[str], device: torch.device) -> None:
    """Cast the model's weights to `half` in place, except the named layers (a rule's run_in=fp32: O2's norms),
    which keep fp32 weights and run on fp32 inputs. Inputs are cast to half and outputs back to fp32, so the loss
    is computed in fp32."""
    model.to(half)
    for name in fp32_layers:
        module = model.get_submodule(name)
        module.float()
        if device.type == "cuda" and isinstance(module, nn.modules.batchnorm._BatchNorm):
            # cuDNN's batch norm takes half input with fp32 parameters and statistics and computes in
            # fp32 (what Apex O2 relied on): casting around it would only add two memory-bound passes.
            continue
        _cast_hook(module, "pre_hook", lambda _m, args: cast_floats(args, torch.float32))
        _cast_hook(module, "hook", lambda _m, _args, out: cast_floats(out, half))
    _cast_hook(model, "pre_hook", lambda _m, args: cast_floats(args, half))
    _cast_hook(model, "hook", lambda _m, _args, out: cast_floats(out, torch.float32))


_CAST_HOOKS = "_ampctl_cast_hooks"  # (kind, handle id) of the hooks above, on the module they cast around


def _cast_hook(module: nn.Module, kind: str, hook: Any) -> None:
    handle = getattr(module, f"register_forward_{kind}")(hook)
    module.__dict__.setdefault(_CAST_HOOKS, []).append((kind, handle.id))


def fp32_copy(model: nn.Module) -> nn.Module:
    """A copy of a model cast by cast_model_to_half, in fp32 and without the casts around it and its norms: the
    model as fp32 would compute it, from its half weights upcast. The model itself is untouched."""
    clone = copy.deepcopy(model)
    for module in clone.modules():
        for kind, handle_id in module.__dict__.pop(_CAST_HOOKS, []):
            (module._forward_pre_hooks if kind == "pre_hook" else module._forward_hooks).pop(handle_id, None)
    return clone.float()
