"""The precision of the optimizer's states: torchao's AdamW with states in bf16 (and stochastic rounding of bf16
weights), in 8 bits, 4 bits or FP8 (optimizer=adamw_bf16_sr|adamw_8bit|adamw_4bit|adamw_fp8).

What each keeps, per parameter tensor of n elements (torchao.optim, as bitsandbytes does): a tensor of at least
4096 elements, divisible into blocks, keeps both moments quantized block-wise (one float32 scale per block, and a
float32 code map per tensor in 8 and 4 bits); a smaller one keeps them in the parameter's own dtype. Every update
is computed in fp32 from the dequantized moments. With bf16_stochastic_round the new bf16 weight is rounded up or
down with the probability of the bits it drops, so an update smaller than half a bf16 step is kept in expectation
instead of lost (pure-bf16 training, precision=bf16_true); its draws come from torch's global
generator, which every checkpoint saves. torchao compiles each parameter's update with torch.compile on its first
step (a few seconds per parameter shape on a CPU, excluded from timings as every compile is).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import DictConfig

from ampctl.errors import UnsupportedError, UsageError

MIN_QUANTIZED_SIZE = 4096  # torchao's (and bitsandbytes') threshold: smaller tensors keep unquantized states
INSTALL_HINT = "pip install 'ampctl[torchao]'"


@dataclass(frozen=True)
class StateLayout:
    """How one torchao optimizer stores a moment of a tensor large enough to be quantized."""

    bits: Optional[int]  # bits per element; None: unquantized (the parameter's dtype)
    default_block_size: int = 0
    code_map_entries: int = 0  # float32 entries of the per-tensor code map (none for FP8)

    def quantized_bytes(self, n: int, block_size: int) -> int:
        """One moment of an n-element tensor: codes, a float32 scale per block, the code map."""
        assert self.bits is not None
        return n * self.bits // 8 + 4 * (n // block_size) + 4 * self.code_map_entries


# _target_ -> its layout; Adam and AdamW alike (decoupled weight decay is the only difference)
LAYOUTS = {
    "torchao.optim._AdamW": StateLayout(None),
    **{f"torchao.optim.{name}": StateLayout(8, 256, 256) for name in ("AdamW8bit", "Adam8bit")},
    **{f"torchao.optim.{name}": StateLayout(4, 128, 16) for name in ("AdamW4bit", "Adam4bit")},
    **{f"torchao.optim.{name}": StateLayout(8, 256) for name in ("AdamWFp8", "AdamFp8")},
}


def is_torchao(optimizer_cfg: DictConfig) -> bool:
    """One of torchao's AdamW this module knows (its other optimizers, as CPUOffloadOptimizer, are not these)."""
    return layout_of(optimizer_cfg) is not None


def layout_of(optimizer_cfg: DictConfig) -> Optional[StateLayout]:
    return LAYOUTS.get(str(optimizer_cfg.get("_target_", "")))


def block_size_of(optimizer_cfg: DictConfig) -> int:
    layout = layout_of(optimizer_cfg)
    assert layout is not None and layout.bits is not None
    return int(optimizer_cfg.get("block_size", layout.default_block_size))


def is_quantized(optimizer_cfg: DictConfig, numel: int) -> bool:
    """Whether torchao keeps this tensor's moments quantized (torchao.optim.adam._AdamBase._new_buffer)."""
    layout = layout_of(optimizer_cfg)
    if layout is None or layout.bits is None:
        return False
    return numel >= MIN_QUANTIZED_SIZE and numel % block_size_of(optimizer_cfg) == 0


def check(optimizer_cfg: DictConfig, precision_dtype: str, weights_in_half: bool, fsdp_with_whole_checkpoints: bool
          ) -> None:
    """Refuse what torchao's optimizers cannot do here, or would silently not do, before anything is built.
    precision_dtype, weights_in_half: the precision mode's half type and whether the weights the optimizer steps
    on are stored in it (O3; O2 steps on fp32 masters); fsdp_with_whole_checkpoints: distributed.kind=fsdp with
    distributed.checkpoint_format=full."""
    if not is_torchao(optimizer_cfg):
        return
    target = str(optimizer_cfg.get("_target_"))
    if importlib.util.find_spec("torchao") is None:
        raise UnsupportedError(f"optimizer._target_={target}: torchao is not installed; {INSTALL_HINT}")
    if optimizer_cfg.get("bf16_stochastic_round") and not (weights_in_half and precision_dtype == "bfloat16"):
        # torchao rounds only bf16 weights, and says nothing for others: the choice would do nothing
        raise UsageError(
            "optimizer.bf16_stochastic_round=true rounds the bfloat16 weights the optimizer steps on, and this "
            "precision mode steps on " + (f"{precision_dtype} weights" if weights_in_half else "fp32 weights")
            + ": use precision=bf16_true (pure bf16; or set optimizer.bf16_stochastic_round=false)")
    layout = layout_of(optimizer_cfg)
    if layout is not None and layout.bits is not None:
        block = optimizer_cfg.get("block_size", layout.default_block_size)
        if not isinstance(block, int) or block < 1 or block & (block - 1):
            raise UsageError(f"optimizer.block_size={block!r} is not allowed: a power of two (torchao's default "
                             f"for {target.rsplit('.', 1)[-1]} is {layout.default_block_size})")
        if optimizer_cfg.get("amsgrad"):
            # found by running it: torchao's quantized states implement no aten.maximum (a traceback at step 1)
            raise UnsupportedError(f"optimizer.amsgrad=true with {target}: torchao's quantized states cannot keep "
                                   "amsgrad's running maximum; set optimizer.amsgrad=false (or use optimizer=adamw)")
        if fsdp_with_whole_checkpoints:
            # torchao's quantized states cannot be split (aten.split): a whole checkpoint would be written but
            # could not be sharded again to resume
            raise UnsupportedError(
                f"optimizer._target_={target} with distributed.kind=fsdp and distributed.checkpoint_format=full: "
                "its quantized states cannot be sharded again from a whole checkpoint to resume; use "
                "distributed.checkpoint_format=sharded (fsdp's default)")


# --- in a checkpoint: plain tensors --------------------------------------------------------------------------------
# A checkpoint holds plain containers and tensors only (it loads with torch.load(weights_only=True), without torchao
# imported first): a quantized state is kept as the tensors it is made of and rebuilt from them, bit for bit.

_STATE_CLASSES = {"OptimState8bit": "torchao.optim.subclass_8bit", "OptimState4bit": "torchao.optim.subclass_4bit",
                  "OptimStateFp8": "torchao.optim.subclass_fp8"}
_PLAIN = "torchao_optim_state"  # the key that marks a quantized state kept as plain tensors


def plain_states(optimizer_state: dict) -> dict:
    """An optimizer's state dict with each torchao quantized state as plain tensors (others as they are; an empty
    one, a rank's other than 0 under FSDP, as it is)."""
    if "state" not in optimizer_state:
        return optimizer_state
    return {**optimizer_state, "state": {key: {name: _plain(value) for name, value in state.items()}
                                         for key, state in optimizer_state["state"].items()}}


def quantized_states(optimizer_state: dict, into_shards: bool) -> dict:
    """plain_states undone: each quantized state rebuilt as torchao's tensor subclass. into_shards: loaded into a
    sharded (FSDP) optimizer, which would split them, and torchao's quantized states cannot be split."""
    if "state" not in optimizer_state:
        return optimizer_state
    if into_shards and any(_is_plain(value) for state in optimizer_state["state"].values() for value in state.values()):
        raise UnsupportedError("this checkpoint holds torchao's quantized optimizer states whole, which cannot be "
                               "sharded again: resume it without distributed.kind=fsdp")
    return {**optimizer_state, "state": {key: {name: _rebuilt(value) for name, value in state.items()}
                                         for key, state in optimizer_state["state"].items()}}


def _plain(value: Any) -> Any:
    kind = type(value).__name__
    if kind not in _STATE_CLASSES:
        return value
    names, attributes = value.__tensor_flatten__()
    return {_PLAIN: kind, "tensors": {name: _waited(getattr(value, name)) for name in names},
            "attributes": list(attributes), "size": list(value.shape), "stride": list(value.stride())}


def _waited(tensor: Any) -> Any:
    """The tensor itself: gathered under FSDP, a quantized state's parts are the pending results of collectives
    (torch's AsyncCollectiveTensor, which a checkpoint cannot hold as plain tensors)."""
    wait = getattr(tensor, "trigger_wait", None)
    return wait() if wait is not None else tensor


def _is_plain(value: Any) -> bool:
    return isinstance(value, dict) and value.get(_PLAIN) in _STATE_CLASSES


def _rebuilt(value: Any) -> Any:
    if not _is_plain(value):
        return value
    cls = getattr(importlib.import_module(_STATE_CLASSES[value[_PLAIN]]), value[_PLAIN])
    return cls.__tensor_unflatten__(value["tensors"], value["attributes"], tuple(value["size"]),
                                    tuple(value["stride"]))
