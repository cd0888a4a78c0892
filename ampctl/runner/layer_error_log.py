"""train.diff.every: every N steps, each layer's error against fp32 at the run's current weights, recorded in
diffs.jsonl (one row a measurement: the step, the whole gradient's error and its ratio to the gradient's noise, and
per layer its local output, dgrad and wgrad error and the share of its output flushed or saturated). It is `ampctl
diff`'s measurement (analysis/layer_errors.py) with the training model as the candidate, as it computes now (its
loss scale included), and an fp32 copy of its current weights as the reference, on the first train.diff.batches
batches of train.seed, the same batches each time, so that a layer's drift is the weights', not the data's. A mixture
of experts adds, per router, the share of tokens sent to other experts (end to end and by the router alone) and its
scores' error, and per grouped experts layer each expert's own output error (analysis/routing.py, as `ampctl diff`).

The measurement leaves training as it was: it is taken between steps (no gradient is pending then), every buffer a
forward updates (BatchNorm's statistics, FP8's amax history) and the modules' train/eval modes are restored, the
global random generators are forked, and its time is no step's (the step timer restarts after it, the hang watch
pauses). It runs in one process on an eager model: with torch.compile or several ranks it is refused at the start.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from omegaconf import DictConfig
from torch import nn

from ampctl import run_files
from ampctl.analysis.layer_errors import LayerErrors, ModelErrors, Side, measure
from ampctl.analysis.routing import RoutingWatch
from ampctl.engine.loop import TrainState, batch_stream
from ampctl.engine.precision import fp32_math
from ampctl.engine.precision.policy import PrecisionPolicy
from ampctl.errors import UsageError
from ampctl.recipes.base import Recipe, building_model


def refuse_what_it_cannot_watch(cfg: DictConfig, world_size: int) -> None:
    if cfg.train.diff.every is None:
        return
    if cfg.train.compile.enabled:
        raise UsageError("train.diff.every with train.compile.enabled=true: the per-layer measurement re-runs each "
                         "layer eagerly; measure a compiled run's weights with ampctl diff diff.weights=<its run>")
    if world_size > 1:
        raise UsageError("train.diff.every in a distributed run: the measurement runs in one process; measure a "
                         "checkpoint with ampctl diff diff.weights=<its run>")


class Fp32Reference:
    """An fp32 copy of the recipe's model, no mode applied, given a training model's current weights to measure that
    model against (diff's measurement: analysis/layer_errors.py), leaving the model as it was."""

    def __init__(self, recipe: Recipe, policy: PrecisionPolicy) -> None:
        self.recipe, self.policy = recipe, policy
        with building_model(recipe):
            self.model = recipe.build_model().to(policy.device)  # the weights come with each measurement
        self.trainable = {name for name, p in self.model.named_parameters() if p.requires_grad}

    def measure(self, state: TrainState,
                batches: list[Any]) -> tuple[dict[str, LayerErrors], ModelErrors, list[dict[str, Any]]]:
        """state's model, as it computes now (its loss scale included), against the reference at its weights; and
        its routers' flips (RoutingWatch.results: none without routers)."""
        model = state.model
        self._load_weights(model)
        reference = Side(self.model, _true_fp32, lambda: torch.autocast(self.policy.device.type, enabled=False))
        scale = float(state.scaler.current_scale()) if state.scaler.can_skip else 1.0
        # the run's policy is entered around its steps already: its flags are in effect
        candidate = Side(model, contextlib.nullcontext, self.policy.forward_context, scale)
        routing = RoutingWatch(self.model, model)
        with _left_as_it_was(model):
            layers, whole = measure(reference, candidate, self.recipe.loss, batches,
                                    routing=routing if routing.flips else None)
        return layers, whole, routing.results()

    def _load_weights(self, model: nn.Module) -> None:
        """The training model's weights now, in fp32 (O2's half copies as they are: the reference computes on the
        weights the candidate computes on)."""
        state = {k: v.detach().float() if v.is_floating_point() else v for k, v in model.state_dict().items()}
        loaded = self.model.load_state_dict(state, strict=False)
        missing = [name for name in loaded.missing_keys if name in self.trainable]
        if missing:
            raise UsageError(f"precision={self.policy.precision.name}'s model names its weights otherwise than the "
                             f"recipe's ({', '.join(missing[:3])}): measure it with ampctl diff")


class LayerErrorLog:
    def __init__(self, cfg: DictConfig, state: TrainState, policy: PrecisionPolicy, recipe: Recipe,
                 run_dir: Path) -> None:
        self.every, self.state = cfg.train.diff.every, state
        self.path = run_dir / run_files.LAYER_ERRORS
        self.batches = list(itertools.islice(batch_stream(recipe, policy.device, cfg.train.seed),
                                             cfg.train.diff.batches))
        self.reference = Fp32Reference(recipe, policy)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def between_steps(self, step: int, telemetry: Any, pause: Callable[[], Any], recorder: Any) -> None:
        """The measurement after `step`, no step's time: the rows up to it written first (the step timer is
        drained), the hang watch paused while it runs, the timer restarted after it; said, and handed to the
        recorder's trackers."""
        telemetry.flush()
        with pause():
            row = self(step)
            recorder.echo(self.line(row))
            recorder.record_layer_errors(row)
        telemetry.timer.restart()

    def __call__(self, step: int) -> dict[str, Any]:
        """Measure at the current weights; append the row to diffs.jsonl and return it."""
        layers, whole, routing = self.reference.measure(self.state, self.batches)
        noise = whole.noise()
        row = {"step": step, "gradient_error": _finite(whole.gradient.rel_rms),
               "error_over_noise": _finite(whole.gradient.rel_rms / noise) if noise else None,
               "layers": {name: {"type": layer.kind, "out_local": _finite(layer.local["out"].rel_rms),
                                 "dgrad_local": _finite(layer.local["dgrad"].rel_rms) if layer.local["dgrad"].values
                                 else None,
                                 "wgrad_local": _finite(layer.local["wgrad"].rel_rms) if layer.local["wgrad"].values
                                 else None,
                                 "flushed": layer.total["out"].share(layer.total["out"].flushed),
                                 "saturated": layer.total["out"].share(layer.total["out"].saturated)}
                          for name, layer in layers.items()}}
        for name, layer in layers.items():
            if layer.per_expert:  # grouped experts: each expert's own output error (None: it got no token)
                row["layers"][name]["per_expert_out"] = [_finite(sums.rel_rms) if sums.values else None
                                                        for sums in layer.per_expert]
        if routing:
            row["routing"] = routing
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        return row

    def line(self, row: dict[str, Any]) -> str:
        """`layer errors at step 10: gradient 3.1e-03 (0.0059x its noise); largest local: blocks.1.mlp.0 3.0e-03`"""
        worst = max(row["layers"].items(), key=lambda item: _rank(item[1]), default=None)
        ratio = row["error_over_noise"]
        noise = f" ({ratio:.2g}x its noise)" if isinstance(ratio, float) else ""
        largest = f"; largest local: {worst[0]} ({worst[1]['type']}) {_said(_rank(worst[1]))}" if worst else ""
        flips = max(row.get("routing", []), key=lambda router: router["flipped"], default=None)
        routed = (f"; {flips['flipped']:.1%} of {flips['router']}'s tokens to other experts" if flips is not None
                  else "")
        return (f"layer errors at step {row['step']}: gradient {_said(row['gradient_error'])}{noise}{largest}"
                f"{routed}")


def _rank(layer: dict[str, Any]) -> float:
    values = [v for k, v in layer.items() if k.endswith("_local") and v is not None]
    return max((math.inf if v == "inf" else v for v in values), default=0.0)


def _said(value: Any) -> str:
    return "inf" if value in ("inf", math.inf) else f"{value:.1e}"


def _finite(value: float) -> Any:
    return value if math.isfinite(value) else "inf"  # JSON has no infinity


@contextlib.contextmanager
def _true_fp32() -> Iterator[None]:
    saved = fp32_math.snapshot()
    fp32_math.set_tf32(False)
    try:
        yield
    finally:
        fp32_math.restore(saved)


@contextlib.contextmanager
def _left_as_it_was(model: nn.Module) -> Iterator[None]:
    """The model's buffers, its modules' train/eval modes and the global random generators as they were."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    modes = [(m, m.training) for m in model.modules()]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for module, training in modes:
            module.training = training
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        model.zero_grad(set_to_none=True)
