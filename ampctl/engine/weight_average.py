"""train.ema.decay: an exponential moving average of the weights, kept in fp32 whatever the training precision.

It averages the weights the optimizer steps on (the fp32 masters under O2, the half weights themselves under O3,
the model's fp32 weights otherwise), with torch's own EMA rule (torch.optim.swa_utils.get_ema_multi_avg_fn:
`ema <- lerp(ema, w, 1 - decay)`). torch's AveragedModel is not used: its update reads `n_averaged == 0` back
from the device on every call, and the step never waits for the device. Here whether a step updates is decided
on the host from the step count: the average is the weights at `start_step` (the initial weights for 0), then
updated after every `every`-th step past it. A step the loss scaler skipped left the weights as they were; the
average still moves toward them (as torch's and timm's EMAs do: the rule counts steps, not updates).

Parameters only: buffers (BatchNorm's running statistics) are the model's when the average is evaluated. Under
FSDP2 each rank averages its own shards (DTensors), with no communication; a whole checkpoint gathers them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn
from torch.optim.swa_utils import get_ema_multi_avg_fn

# the sources cast to fp32 for one update at most this many elements at a time (half weights: the cast copies
# are transient, and bounded, not a second copy of the model)
_CAST_CHUNK_ELEMENTS = 1 << 26


class WeightAverage:
    """The fp32 EMA of `sources` (the weights the optimizer steps on, in the order of the model's trainable
    parameters, whose names key it)."""

    def __init__(self, model: nn.Module, sources: list[torch.Tensor], decay: float, start_step: int = 0,
                 every: int = 1) -> None:
        trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if len(trainable) != len(sources):
            raise ValueError(f"{len(sources)} weights to average, {len(trainable)} trainable parameters")
        self.names = [name for name, _ in trainable]
        self._params = [p for _, p in trainable]  # the model's own: the average is evaluated in them
        self._sources = list(sources)
        self.decay, self.start_step, self.every = decay, start_step, every
        self._update = get_ema_multi_avg_fn(decay)
        with torch.no_grad():
            self.averages = [s.detach().to(torch.float32, copy=True) for s in self._sources]
        # what the updates work on: each rank's own shards under FSDP2 (DTensor has no foreach copy), which share
        # their storage with the DTensors above
        self._local_averages = [_local(a) for a in self.averages]
        self._local_sources = [_local(s) for s in self._sources]
        self._local_params = [_local(p) for p in self._params]
        # grouped once, not at every update: fp32 sources as they are, half ones in chunks cast to fp32
        pairs = list(zip(self._local_averages, self._local_sources))
        fp32 = [(a, s) for a, s in pairs if s.dtype == torch.float32]
        self._fp32 = ([a for a, _ in fp32], [s for _, s in fp32])
        self._half_chunks: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        chunk: list[tuple[torch.Tensor, torch.Tensor]] = []
        for average, source in ((a, s) for a, s in pairs if s.dtype != torch.float32):
            chunk.append((average, source))
            if sum(s.numel() for _, s in chunk) >= _CAST_CHUNK_ELEMENTS:
                self._half_chunks.append(([a for a, _ in chunk], [s for _, s in chunk]))
                chunk = []
        if chunk:
            self._half_chunks.append(([a for a, _ in chunk], [s for _, s in chunk]))

    def after_step(self, step: int) -> None:
        """After optimizer step `step` (the weights stepped): at start_step the average becomes the weights; past
        it, every `every`-th step moves it toward them. Nothing is read from the device."""
        if step == self.start_step:
            with torch.no_grad():
                torch._foreach_copy_(self._local_averages, self._local_sources)
        elif step > self.start_step and (step - self.start_step) % self.every == 0:
            self._average()

    @torch.no_grad()
    def _average(self) -> None:
        if self._fp32[0]:
            self._update(*self._fp32, None)
        for averages, sources in self._half_chunks:  # cast copies of a chunk at a time, freed after it
            self._update(averages, [s.float() for s in sources], None)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The average in the model's parameters (cast to their dtype, as the model would serve it), the model's
        own weights back afterwards, bit for bit."""
        with torch.no_grad():
            own = [p.clone() for p in self._local_params]
            torch._foreach_copy_(self._local_params, self._local_averages)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self._local_params, own)

    def state_dict(self, whole: bool = False) -> dict[str, Any]:
        """{name: fp32 average}: as held (DTensor shards under FSDP2, for a sharded checkpoint), or whole on the
        CPU (gathering shards is a collective: every rank calls it)."""
        return {name: (_whole(a) if whole else a) for name, a in zip(self.names, self.averages)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Whole tensors (each rank keeps its own shard of them) or tensors as held."""
        missing = sorted(set(self.names) - set(state))
        if missing or len(state) != len(self.names):
            raise ValueError(f"the checkpoint's weight average holds {len(state)} tensors, this model "
                             f"{len(self.names)} trainable parameters"
                             + (f" (missing: {missing[:3]})" if missing else ""))
        for name, average in zip(self.names, self.averages):
            average.copy_(_as_held(state[name], average))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (its storage), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor.detach()


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().cpu()


def _as_held(saved: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """A saved tensor in the form `held` has: a whole tensor becomes this rank's shard of a DTensor."""
    if hasattr(held, "device_mesh") and not hasattr(saved, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(saved.to(held.device), held.device_mesh, held.placements, src_data_rank=None)
    return saved.to(held.device)
