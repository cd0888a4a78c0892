"""The training step and fit(). Written out in order, like nanoGPT's; no precision branches.

Per optimizer step: forward under autocast -> scale -> backward (x grad_accum_steps micro-batches) ->
half grads into fp32 masters (O2; a no-op otherwise) -> unscale_ once -> clip (a non-finite norm skips the
step) -> step -> record -> update -> lr schedule -> masters back into the model -> weight average (when asked)
-> zero grads. Nothing here reads from the device: the only reads are the telemetry's, on log steps.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
from torch import nn

from ampctl.engine.optim import LRSchedule
from ampctl.engine.parallel import Parallel
from ampctl.engine.precision.half import WeightLayout
from ampctl.engine.precision.policy import PrecisionPolicy
from ampctl.engine.scaler import LossScaler
from ampctl.engine.telemetry import Telemetry
from ampctl.engine.thread_clock import ThreadClock
from ampctl.engine.weight_average import WeightAverage
from ampctl.errors import UsageError
from ampctl.recipes.base import Recipe, checked_batches, checked_loss, recipe_name, starts_anywhere
from ampctl.recipes.failures import recipe_errors


def grad_norm_(params: list[nn.Parameter], max_norm: Optional[float]) -> torch.Tensor:
    """Total norm of the (unscaled) gradients; clips them to max_norm when given. Stays on the device."""
    grads = [p.grad for p in params if p.grad is not None]
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6: clip_grad_norm_'s own two halves
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if hasattr(norm, "full_tensor"):  # FSDP: the norm over every rank's shard (a collective, no sync)
            norm = norm.full_tensor()
        if max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return norm
    if max_norm is not None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


@dataclass
class TrainState:
    """Everything the step mutates."""

    model: nn.Module
    weights: WeightLayout
    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    schedule: LRSchedule
    step: int = 0
    parallel: Parallel = field(default_factory=Parallel)  # DDP's hooks; identities in one process
    ema: Optional[WeightAverage] = None  # train.ema.decay's fp32 average of the weights
    # the modules that update themselves after each optimizer step (`ampctl_after_step()`: a mixture of experts'
    # expert bias), found once when the state is built
    after_step: list[nn.Module] = field(init=False)

    def __post_init__(self) -> None:
        self.after_step = [m for m in self.model.modules() if callable(getattr(m, "ampctl_after_step", None))]


@dataclass(frozen=True)
class StepSettings:
    """How each optimizer step is taken: micro-batches per step, and the norm gradients are clipped to (None:
    measured, not clipped)."""

    grad_accum_steps: int = 1
    clip_grad_norm: Optional[float] = None

    @classmethod
    def of(cls, train: Any) -> "StepSettings":
        """From the config's train node (train.grad_accum_steps, train.clip_grad_norm)."""
        return cls(train.grad_accum_steps, train.clip_grad_norm)


@dataclass
class FitHooks:
    """What a training run does around fit()'s steps: after_step(last) after every step (checkpoints,
    evaluations); stop_requested(), a host-side flag checked between steps; around_step(step), a context around
    a step (the range hooks on the steps telemetry.ranges_every picks)."""

    after_step: Callable[[bool], None] = lambda last: None
    stop_requested: Callable[[], bool] = lambda: False
    around_step: Callable[[int], ContextManager] = lambda step: contextlib.nullcontext()


_END = object()  # what next() returns when a recipe's batches run out
DATA_RANGE = "ampctl.data"  # the profiler range around each fetch of a batch (analysis/step_time.py reads it)


class BatchStream:
    """The recipe's batches, and how long the loop waited for them: host time in next(), which is the whole
    making of a batch when the recipe makes it in the loop's thread, and the wait for a DataLoader's workers
    when they are behind; and, of that, the time the loop's thread was idle: blocked on workers, a disk or the
    network (engine/thread_clock.py), rather than making the batch itself or waiting for a CPU that other
    processes held (a busy machine is not a wait on data). Reading the clocks costs nothing on the device;
    inside a torch.profiler window each fetch is also a range named DATA_RANGE (a range costs ~20 us, too much
    for every step of a run)."""

    def __init__(self, batches: Iterator[Any]) -> None:
        self._batches = batches
        self._wait_s = self._idle_s = 0.0
        self._clock = ThreadClock()

    def __iter__(self) -> "BatchStream":
        return self

    def __next__(self) -> Any:
        start = self._clock.mark()
        if torch._C._autograd._profiler_enabled():
            with torch.profiler.record_function(DATA_RANGE):
                batch = next(self._batches)
        else:
            batch = next(self._batches)
        wall, blocked = self._clock.since(start)
        self._wait_s += wall
        self._idle_s += blocked
        return batch

    def take_wait_s(self) -> tuple[float, float]:
        """Seconds spent in next() since the last call, and of them the seconds the loop's thread was idle."""
        wait, idle, self._wait_s, self._idle_s = self._wait_s, self._idle_s, 0.0, 0.0
        return wait, idle


def train_step(
    state: TrainState,
    batches: Iterator[Any],
    recipe: Recipe,
    policy: PrecisionPolicy,
    settings: StepSettings,
    telemetry: Telemetry,
) -> None:
    opt, scaler = state.optimizer, state.scaler
    grad_accum_steps = settings.grad_accum_steps
    losses = []
    model = state.parallel.training_model(state.model)
    if policy.converter is not None:
        policy.converter.at_step(state.step + 1)
    for micro in range(grad_accum_steps):
        batch = next(batches, _END)
        if batch is _END:
            raise UsageError(f"recipe {recipe_name(recipe)}: batches(device, seed) ended after step {state.step}; "
                             "the protocol needs an endless iterator (loop over the data again: epochs)")
        with state.parallel.grad_sync(last_micro_batch=micro == grad_accum_steps - 1):
            with policy.forward_context():
                loss = checked_loss(recipe.loss(model, batch), recipe)
            # backward outside autocast, as torch.amp recommends; the loss is averaged over micro-batches (a
            # division by 1 would cost two kernels a step for nothing)
            scaler.scale(loss / grad_accum_steps if grad_accum_steps > 1 else loss).backward()
        losses.append(loss.detach())
    state.weights.grads_to_masters()
    # One unscale_ after the last micro-batch: clipping and the grad norm must see true gradients.
    scaler.unscale_(opt)
    grad_norm = grad_norm_(state.weights.optimizer_params, settings.clip_grad_norm)
    scaler.skip_if_not_finite(opt, grad_norm)
    # A fused optimizer's step() runs even when the scaler skips (the kernel reads found_inf), so
    # "skipped" comes from found_inf itself, never from whether step() was called.
    scaler.step(opt)
    found_inf = scaler.found_inf(opt)
    state.step += 1
    loss = state.parallel.mean_(losses[0] if len(losses) == 1 else torch.stack(losses).mean())
    # Recorded before update(): the scale logged is the one that multiplied this step's loss.
    telemetry.record(state.step, loss, scaler.current_scale(), found_inf, grad_norm, state.schedule.current_lr())
    scaler.update()
    state.schedule.step(found_inf, scaler.can_skip)  # a skipped step does not advance the schedule
    state.weights.masters_to_model()
    for module in state.after_step:
        module.ampctl_after_step()
    if policy.converter is not None:
        policy.converter.weights_changed(state.model)
    if state.ema is not None:
        state.ema.after_step(state.step)
    opt.zero_grad(set_to_none=True)


def fit(
    state: TrainState,
    recipe: Recipe,
    policy: PrecisionPolicy,
    settings: StepSettings,
    telemetry: Telemetry,
    steps: int,
    seed: int,
    hooks: FitHooks = FitHooks(),
) -> bool:
    """Train from state.step to steps, on the batches of `seed`. Returns False when stopped early (hooks)."""
    # A resumed run continues the same batch stream: the data position is the number of batches consumed.
    batches = batch_stream(recipe, policy.device, seed, state.step * settings.grad_accum_steps)
    state.model.train()
    while state.step < steps:
        with hooks.around_step(state.step + 1):
            train_step(state, batches, recipe, policy, settings, telemetry)
        stopping = hooks.stop_requested()
        last = state.step == steps or stopping
        data_s, idle_s = batches.take_wait_s()
        telemetry.end_step(last=last, data_s=data_s, data_idle_s=idle_s)
        hooks.after_step(last)
        if stopping:
            return False
    return True


def batch_stream(recipe: Recipe, device: torch.device, seed: int, position: int = 0) -> BatchStream:
    """The recipe's batches for `seed`, past the first `position` (a resumed run continues the same stream): from
    the recipe's batches_from where it has one (it starts there without producing the batches before: a
    DataLoader recipe's resume reads no image twice), else drawn and discarded."""
    if position and starts_anywhere(recipe):
        return BatchStream(checked_batches(recipe.batches_from(device, seed, position), recipe))
    batches = checked_batches(recipe.batches(device, seed), recipe)
    for _ in range(position):
        next(batches)
    return BatchStream(batches)


@dataclass
class StepsHooks:
    """What a study does around run_steps' steps: before_step() before each; after_step(k) after the k-th
    (progress for the commands that wait on these steps); enough(), asked before every step but the first, ends
    them early (a deadline); records, a telemetry each step is recorded into and ended on, as fit() does (its
    sinks get the records; none: they stay on the device where nobody reads them)."""

    before_step: Callable[[], None] = lambda: None
    after_step: Callable[[int], None] = lambda done: None
    enough: Callable[[], bool] = lambda: False
    records: Optional[Telemetry] = None


def run_steps(state: TrainState, batches: Iterator[Any], n: int, recipe: Recipe, policy: PrecisionPolicy,
              settings: StepSettings = StepSettings(), hooks: StepsHooks = StepsHooks(), timed: bool = False,
              ) -> list[float]:
    """n optimizer steps outside a training run (inspect, memory, the memory probe, diagnose, tests): the step
    fit() takes, recorded where hooks.records says. With timed, each step's wall time in ms (synchronized with
    the device: these are measurements, not a training run)."""
    telemetry = hooks.records or Telemetry(policy.device, max(n, 1), recipe.samples_per_batch, None, [])
    state.model.train()
    times = []
    for done in range(1, n + 1):
        if done > 1 and hooks.enough():
            break
        hooks.before_step()
        start = time.perf_counter()
        with recipe_errors(recipe):
            train_step(state, batches, recipe, policy, settings, telemetry)
        if timed:
            if policy.device.type == "cuda":
                torch.cuda.synchronize(policy.device)
            times.append((time.perf_counter() - start) * 1e3)
        if hooks.records is not None:
            telemetry.end_step(last=done == n)
        hooks.after_step(done)
    return times
