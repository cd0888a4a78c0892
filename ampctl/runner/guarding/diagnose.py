"""Why did a step overflow? Replay it with hooks on every layer and name the first one whose output, or
gradient, stopped being finite or left the half dtype's range.

The replay is exact: it restores the newest checkpoint before the bad step (or rebuilds the initial state,
which is seeded), trains up to the step before it exactly as the run did, then runs the bad step's
forward and backward with forward and backward hooks on every leaf module.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from omegaconf import DictConfig
from torch import nn

from ampctl import io
from ampctl.engine.build import build_state
from ampctl.engine.loop import StepSettings, TrainState, batch_stream, run_steps
from ampctl.engine.precision.policy import PrecisionPolicy
from ampctl.recipes.base import Recipe
from ampctl.runner.checkpointing import checkpoint, checkpoint_files


@dataclass
class Finding:
    """A layer where a value was non-finite or beyond the half type's range."""

    module: str
    type: str
    dtype: str
    max_abs: float
    problem: str


def _float_tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in io.tensors_in(value) if t.is_floating_point()]


def _problem(tensors: list[torch.Tensor], half_max: Optional[float]) -> Optional[tuple[str, float, str]]:
    """(problem, max |x|, dtype) of the first tensor that is non-finite or beyond the half dtype's range."""
    for t in tensors:
        max_abs = float(t.detach().abs().max()) if t.numel() else 0.0
        if not bool(torch.isfinite(t.detach()).all()):
            return "non-finite", max_abs, str(t.dtype).removeprefix("torch.")
        if half_max is not None and t.dtype == torch.float32 and max_abs > half_max:
            return f"beyond float16's max {half_max:g} (overflows when cast to float16)", max_abs, "float32"
    return None


MAX_FORWARD_PROBLEMS = 16  # the layers a problem passes through after the first, in order (escalation reads them)


class LayerWatch:
    """Forward and backward hooks on every leaf module; keeps the first problem found in each direction, and the
    first forward problems in the order the layers ran (the first layer may already compute in fp32, the next not)."""

    def __init__(self, model: nn.Module, half_max: Optional[float]) -> None:
        self.half_max = half_max
        self.forward: Optional[Finding] = None
        self.forward_problems: list[Finding] = []
        self.backward: Optional[Finding] = None
        self._backward_seen = False
        self._handles = []
        for name, module in model.named_modules():
            if next(module.children(), None) is not None:
                continue
            self._handles.append(module.register_forward_hook(self._on_forward(name or "<model>")))
            self._handles.append(module.register_full_backward_hook(self._on_backward(name or "<model>")))

    def _on_forward(self, name: str):
        def hook(module: nn.Module, _args: Any, output: Any) -> None:
            if len(self.forward_problems) >= MAX_FORWARD_PROBLEMS:
                return
            if found := _problem(_float_tensors(output), self.half_max):
                self.forward_problems.append(Finding(name, type(module).__name__, found[2], found[1], found[0]))
                self.forward = self.forward or self.forward_problems[0]
        return hook

    def _on_backward(self, name: str):
        def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            # where the gradient first goes bad on its way back: finite coming in, not finite going out
            if self.backward is not None:
                return
            first_call = not self._backward_seen
            self._backward_seen = True
            if arriving := _problem(_float_tensors(grad_output), None):
                if first_call:  # bad before any layer touched it: the scaled loss's own gradient
                    self.backward = Finding(name, type(module).__name__, arriving[2], arriving[1],
                                            "the scaled loss's gradient is already beyond the dtype's range "
                                            "(loss scale too large)")
                return
            if found := _problem(_float_tensors(grad_input), None):
                self.backward = Finding(name, type(module).__name__, found[2], found[1], f"gradient {found[0]}")
        return hook

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass
class Replayed:
    """A run replayed up to the step before a bad one: its state there, its batches from there on, and the checkpoint
    it started from (None: the initial state)."""

    state: TrainState
    batches: Iterator[Any]
    checkpoint: Optional[Path]
    bad_batches: list[Any] = field(default_factory=list)  # the bad step's (micro-)batches, once watched


def replay_to(cfg: DictConfig, policy: PrecisionPolicy, recipe: Recipe, run_dir: Path, bad_step: int) -> Replayed:
    """The state before bad_step: the newest checkpoint before it restored (or the initial state, which is seeded),
    then the steps up to it trained exactly as the run trained them."""
    state: TrainState = build_state(cfg, policy, recipe)
    earlier = [p for p in checkpoint_files.list_checkpoints(run_dir) if checkpoint_files.checkpoint_step(p) < bad_step]
    if earlier:
        checkpoint.restore(checkpoint.load(earlier[-1]), state, earlier[-1])
    batches = batch_stream(recipe, policy.device, cfg.train.seed, state.step * cfg.train.grad_accum_steps)
    run_steps(state, batches, bad_step - 1 - state.step, recipe, policy, StepSettings.of(cfg.train))
    return Replayed(state, batches, earlier[-1] if earlier else None)


def replay(cfg: DictConfig, policy: PrecisionPolicy, recipe: Recipe, run_dir: Path, bad_step: int, reason: str,
           replayed: Optional[Replayed] = None) -> "Diagnosis":
    """Replay bad_step under hooks (from `replayed`, else replayed to it here); return the diagnosis. Its
    forward and backward leave the weights as they were (no optimizer step); its batches are kept in replayed."""
    replayed = replayed or replay_to(cfg, policy, recipe, run_dir, bad_step)
    state, accum = replayed.state, cfg.train.grad_accum_steps
    half_max = float(torch.finfo(torch.float16).max) if policy.uses_half and policy.dtype == torch.float16 else None
    watch = LayerWatch(state.model, half_max)
    losses = []
    try:
        with warnings.catch_warnings():
            # full backward hooks warn on a first layer whose input needs no grad: expected here
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(accum):
                replayed.bad_batches.append(batch := next(replayed.batches))
                with policy.forward_context():
                    loss = recipe.loss(state.model, batch)
                losses.append(float(loss.detach()))
                state.scaler.scale(loss / accum).backward()
    finally:
        watch.close()
    scale = float(state.scaler.current_scale())  # after scale(): a GradScaler creates its scale lazily
    bad_grads = [name for name, p in state.model.named_parameters()
                 if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
    if not all(math.isfinite(v) for v in losses):
        watch.backward = None  # every gradient of a non-finite loss is non-finite: nothing to locate backward
    return Diagnosis(bad_step, reason, losses, scale, watch.forward, watch.backward, list(watch.forward_problems),
                     bad_grads, str(replayed.checkpoint) if replayed.checkpoint else None)


@dataclass
class Diagnosis:
    """What the replay of a tripped step found (diagnosis.json: to_json(), with its summary in words)."""

    step: int
    reason: str
    losses: list[float]  # one per micro-batch
    loss_scale: float
    forward: Optional[Finding]  # the first layer whose output went bad
    backward: Optional[Finding]  # the first layer where the gradient went bad on its way back
    forward_problems: list[Finding]  # every layer the forward's problem passed through, in order
    parameters_with_nonfinite_grads: list[str]
    checkpoint_replayed_from: Optional[str]

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        losses = record.pop("losses")
        return {"step": self.step, "reason": self.reason, "loss": losses[0] if len(losses) == 1 else losses,
                **{k: v for k, v in record.items() if k not in ("step", "reason")}, "summary": self.summary}

    @property
    def summary(self) -> str:
        named = "loss" if len(self.losses) == 1 else "micro-batch losses"
        parts = [f"replayed step {self.step} ({named} {', '.join(f'{v:.4g}' for v in self.losses)}, loss scale "
                 f"{self.loss_scale:g})"]
        if self.forward:
            f = self.forward
            parts.append(f"forward: first problem at '{f.module}' ({f.type}, {f.dtype} output): {f.problem}, "
                         f"max |x| = {f.max_abs:.4g}")
        else:
            parts.append("forward: every layer's output finite and in range")
        if not all(math.isfinite(v) for v in self.losses):
            parts.append("backward: not located (the loss itself is non-finite)")
        elif self.backward:
            b = self.backward
            parts.append(f"backward: {b.problem}, first seen at '{b.module}' ({b.type}), max |grad| = {b.max_abs:.4g}")
        elif self.parameters_with_nonfinite_grads:
            parts.append("backward: activation gradients finite; non-finite parameter gradients in "
                         + ", ".join(self.parameters_with_nonfinite_grads[:5]))
        else:
            parts.append("backward: every gradient finite in the replay")
        return "; ".join(parts)
