"""The memory model of a mixed-precision training step: model states from the parameters, the precision
mode's weight layout and the optimizer's kind; activations counted from what autograd saves.

Model states follow the textbook accounting (ZeRO, Rajbhandari et al. 2020): for mixed-precision Adam,
2 bytes of half weights + 2 of half gradients + 4 of fp32 master weights + 8 of Adam moments = 16 bytes
per parameter (18 under O2 as it runs: its fp32 master gradients, 4 bytes, replace the 2-byte half ones
rather than joining them). Here each part is computed from the real parameters (their count, shape and dtype after
the precision mode has prepared the model), so norm layers kept in fp32 under O2, O3's half optimizer
states, Adafactor's factored moments and 8-bit Adam's block-wise quantized states are all counted as
they are.

Activations are not estimated from a formula but counted: the bytes of the distinct tensors autograd
saves for backward during one forward (torch.autograd.graph.saved_tensors_hooks), parameters excluded.
Counted at two batch sizes, they give the per-sample slope that sizes the largest batch under a budget.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Iterable, Iterator, Optional

import torch
from omegaconf import DictConfig
from torch import nn

from ampctl.engine import optimizer_states
from ampctl.errors import UsageError

# bitsandbytes' 8-bit optimizers keep a parameter's states in 32 bits below this many elements
# (min_8bit_size) and quantize block-wise, one float32 absmax per block, with a 256-entry float32 code map.
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCK_SIZE = 256
BNB_QMAP_ENTRIES = 256
STEP_TENSOR_BYTES = 4  # torch's Adam/AdamW/Adafactor keep `step` as a float32 scalar tensor per parameter


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of each model-state part. optimizer_states is None for an optimizer the model does not know.

    gradients is the most gradient memory alive at once: under O2 the half gradients that backward produces
    are replaced, one by one, by the fp32 master gradients the optimizer steps on, so the larger of the two
    sets counts, not both (mixed-precision Adam under O2: 2 weights + 4 masters + 4 gradients + 8 moments =
    18 bytes per parameter)."""

    weights: int
    gradients: int
    master_weights: int
    optimizer_states: Optional[int]
    weight_average: int = 0  # train.ema.decay's fp32 copy of the trainable weights (4 bytes per parameter)
    # precision.grad_accum_dtype=float32's fp32 gradient buffers of half weights without masters (4 bytes each)
    grad_accumulators: int = 0

    @property
    def total(self) -> Optional[int]:
        if self.optimizer_states is None:
            return None
        return (self.weights + self.gradients + self.master_weights + self.optimizer_states + self.weight_average
                + self.grad_accumulators)

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def optimizer_kind(optimizer_cfg: DictConfig) -> str:
    """adam | sgd | adafactor | adam8bit (bitsandbytes') | torchao | unknown, from the optimizer config's
    _target_."""
    if optimizer_states.is_torchao(optimizer_cfg):
        return "torchao"
    name = str(optimizer_cfg.get("_target_", "")).rsplit(".", 1)[-1].lower()
    if name in ("adam", "adamw"):
        return "adam"
    if name in ("sgd", "adafactor"):
        return name
    if name in ("adam8bit", "adamw8bit"):
        return "adam8bit"
    return "unknown"


def optimizer_state_bytes(kind: str, optimizer_cfg: DictConfig, params: Iterable[torch.Tensor]) -> Optional[int]:
    """The bytes torch (or bitsandbytes, or torchao) allocates for the optimizer's state of these parameters, in the
    parameters' own dtype (fp32 masters under O2, half under O3)."""
    total = 0
    for p in params:
        n, size = p.numel(), p.element_size()
        if kind == "adam":
            moments = 3 if optimizer_cfg.get("amsgrad", False) else 2  # exp_avg, exp_avg_sq (, max_exp_avg_sq)
            total += moments * n * size + STEP_TENSOR_BYTES
        elif kind == "sgd":
            total += n * size if optimizer_cfg.get("momentum", 0) else 0  # momentum_buffer
        elif kind == "adafactor":
            # Factored second moment (Shazeer & Stern 2018): a row and a column mean for a matrix (the
            # last two dims), the full variance for a vector; no first moment.
            if p.dim() >= 2:
                total += (n // p.shape[-1] + n // p.shape[-2]) * size
            else:
                total += n * size
            total += STEP_TENSOR_BYTES
        elif kind == "torchao":
            # torchao's AdamW: both moments quantized where the tensor is large enough, else in the parameter's
            # dtype (amsgrad's maximum too: with quantized states it is refused); a float32 `step` as torch's
            moments = 3 if optimizer_cfg.get("amsgrad", False) else 2
            if optimizer_states.is_quantized(optimizer_cfg, n):
                layout = optimizer_states.layout_of(optimizer_cfg)
                total += moments * layout.quantized_bytes(n, optimizer_states.block_size_of(optimizer_cfg))
            else:
                total += moments * n * size
            total += STEP_TENSOR_BYTES
        elif kind == "adam8bit":
            if n >= BNB_MIN_8BIT_SIZE:
                blocks = math.ceil(n / BNB_BLOCK_SIZE)
                total += 2 * (n + 4 * blocks + 4 * BNB_QMAP_ENTRIES)  # uint8 states, absmax, code map
            else:
                total += 2 * n * 4
        else:
            return None
    return total


def estimate_model_states(model: nn.Module, optimizer_params: list[nn.Parameter],
                          optimizer_cfg: DictConfig, weight_average: bool = False,
                          grad_accumulators: int = 0) -> ModelStateBytes:
    """Model states of a model prepared by its precision mode, with the parameters its optimizer steps on
    (the model's own, or the fp32 masters of O2), an fp32 average of them where train.ema.decay keeps one, and the
    bytes of fp32 gradient buffers where precision.grad_accum_dtype keeps them (O2's are its master gradients)."""
    return _states(list(model.parameters()), optimizer_params, optimizer_cfg, weight_average, grad_accumulators)


def _states(params: list[nn.Parameter], optimizer_params: list[nn.Parameter], optimizer_cfg: DictConfig,
            weight_average: bool, grad_accumulators: int) -> ModelStateBytes:
    trainable = [p for p in params if p.requires_grad]
    model_ids = {id(p) for p in trainable}
    masters = [p for p in optimizer_params if id(p) not in model_ids]
    # Backward fills the model's gradients; O2 then frees each half gradient as it makes its master's fp32
    # one (precision.FP32MasterWeights.grads_to_masters): the two sets are never alive together.
    return ModelStateBytes(
        weights=sum(_nbytes(p) for p in params),
        gradients=max(sum(_nbytes(p) for p in trainable), sum(_nbytes(p) for p in optimizer_params)),
        master_weights=sum(_nbytes(p) for p in masters),
        optimizer_states=optimizer_state_bytes(optimizer_kind(optimizer_cfg), optimizer_cfg, optimizer_params),
        weight_average=4 * sum(p.numel() for p in optimizer_params) if weight_average else 0,
        grad_accumulators=grad_accumulators,
    )


# A mixture of experts' parts, in the order the memory table lists them; the rest of the model is OTHER_PART.
EXPERTS_PART, ROUTERS_PART, OTHER_PART = "experts", "routers", "the rest"


def part_of(module: nn.Module) -> Optional[str]:
    """A module's part of a mixture of experts: grouped experts (ampctl's protocol; transformers' fused `*Experts`,
    MixtralExperts, Qwen3MoeExperts: (experts, ...) weights) or a router (analysis/routing.is_router)."""
    from ampctl.analysis.routing import is_router
    from ampctl.engine.precision.grouped_experts import is_grouped_experts

    if is_grouped_experts(module) or type(module).__name__.endswith("Experts"):
        return EXPERTS_PART
    return ROUTERS_PART if is_router(module) else None


@dataclass(frozen=True)
class ModelPart:
    name: str  # EXPERTS_PART, ROUTERS_PART or OTHER_PART
    parameters: int  # elements
    states: ModelStateBytes

    def as_dict(self) -> dict:
        return {"part": self.name, "parameters": self.parameters, **self.states.as_dict()}

    @classmethod
    def from_dict(cls, record: dict) -> "ModelPart":
        states = {k: v for k, v in record.items() if k not in ("part", "parameters", "total")}
        return cls(record["part"], record["parameters"], ModelStateBytes(**states))


def states_by_part(model: nn.Module, optimizer_params: list[nn.Parameter], optimizer_cfg: DictConfig,
                   weight_average: bool = False,
                   accumulators: Optional[dict[nn.Parameter, torch.Tensor]] = None) -> list[ModelPart]:
    """A mixture of experts' model states per part (experts, routers, the rest), each counted as the whole model's
    are, from its own parameters and their optimizer's (their fp32 masters under O2): the parts add up to the whole.
    Empty for a model without experts or routers. accumulators: precision.grad_accum_dtype's fp32 buffer of each half
    parameter (FP32GradAccumulation.buffers)."""
    parts: dict[int, str] = {}
    for module in model.modules():
        part = part_of(module)
        if part is not None:
            for p in module.parameters():
                parts.setdefault(id(p), part)
    if not parts:
        return []
    params = list(model.parameters())  # a tied weight once
    trainable = [p for p in params if p.requires_grad]
    if len(trainable) != len(optimizer_params):
        return []  # an optimizer that does not step one tensor per trainable parameter, in order: no split
    stepped = {id(p): o for p, o in zip(trainable, optimizer_params)}  # the model's, or O2's master of it
    buffers = {id(p): b for p, b in (accumulators or {}).items()}
    result = []
    for part in (EXPERTS_PART, ROUTERS_PART, OTHER_PART):
        mine = [p for p in params if parts.get(id(p), OTHER_PART) == part]
        if mine:
            states = _states(mine, [stepped[id(p)] for p in mine if id(p) in stepped], optimizer_cfg, weight_average,
                             sum(_nbytes(buffers[id(p)]) for p in mine if id(p) in buffers))
            result.append(ModelPart(part, sum(p.numel() for p in mine), states))
    return result


class SavedTensorCounter:
    """Counts the bytes autograd saves for backward: distinct storages, parameters left out (they are
    weights, counted as such). Autocast's half copies of the weights are saved too and counted: they live
    as long as the forward's activations do."""

    def __init__(self, model: nn.Module) -> None:
        self._parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._seen: dict[int, int] = {}
        self.recompute = 0  # checkpointed: the largest block's saved tensors, recomputed in backward

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._parameter_storages and tensor.device.type != "meta":
            self._seen[ptr] = storage.nbytes()
        return tensor

    @contextmanager
    def counting(self, checkpointed_blocks: Iterable[nn.Module] = ()) -> Iterator["SavedTensorCounter"]:
        """Counts while inside. Checkpointed blocks keep their inputs outside autograd's saved tensors
        (torch.utils.checkpoint holds them itself), so their inputs are counted by a pre-hook."""
        handles = [block.register_forward_pre_hook(self._count_inputs) for block in checkpointed_blocks]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
                yield self
        finally:
            for handle in handles:
                handle.remove()

    def _count_inputs(self, block: nn.Module, args: tuple) -> None:
        for arg in args:
            if isinstance(arg, torch.Tensor):
                self._pack(arg)
        self.recompute = max(self.recompute, _saved_by_one_recompute(block, args))

    @property
    def bytes(self) -> int:
        """Saved tensors, plus the largest checkpointed block's while backward recomputes it."""
        return sum(self._seen.values()) + self.recompute


def _saved_by_one_recompute(block: nn.Module, args: tuple) -> int:
    """What backward holds while it recomputes this checkpointed block: its saved tensors, counted by
    running its forward once more, without checkpointing, under the caller's autocast state."""
    from ampctl.engine.activation_checkpointing import original_forward

    inner = SavedTensorCounter(block)
    with inner.counting():
        out = original_forward(block)(*args)
    del out
    return inner.bytes


@dataclass(frozen=True)
class ActivationLine:
    """Activation bytes as a function of the batch size: fixed + per_sample * batch."""

    fixed: float
    per_sample: float

    @classmethod
    def through(cls, batch_a: int, bytes_a: int, batch_b: int, bytes_b: int) -> "ActivationLine":
        if batch_a == batch_b:
            return cls(0.0, bytes_a / batch_a)
        slope = (bytes_b - bytes_a) / (batch_b - batch_a)
        return cls(bytes_a - slope * batch_a, slope)

    def at(self, batch: int) -> float:
        return self.fixed + self.per_sample * batch


def largest_batch(budget: int, model_states: int, activations: ActivationLine) -> int:
    """The largest batch whose model states plus activations fit the budget (0 if none does)."""
    room = budget - model_states - activations.fixed
    if room <= 0 or activations.per_sample <= 0:
        return 0
    return int(room // activations.per_sample)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str, key: str = "memory.budget") -> int:
    """'80GB' (SI, 10^9), '16GiB' (IEC, 2^30), '512MiB', '1.5TB', or a plain byte count."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise UsageError(f"{key}={text!r} is not allowed: expected a size such as 80GB, 16GiB or 512MiB "
                         "(GB = 10^9 bytes, GiB = 2^30)")
    return int(float(match.group(1)) * _UNITS[unit])
