"""The records of a run's evaluations. train.eval.every: the model evaluated on the recipe's held-out batches
after every N-th step and after the last (engine/evaluation.py does the evaluating), and each evaluation recorded:
a row in evals.jsonl, the trackers (eval/<metric>), a line on the console. Evaluation is no step's time: the rows
before it are written and the step timer starts again after it. A compiled model compiles again for evaluation
(no grad, eval mode): those compilations are not counted as the training step's recompilations.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from ampctl import io, run_files
from ampctl.conf.train_schema import EMA_METRIC
from ampctl.engine.compilation import CompileWatch
from ampctl.engine.evaluation import Evaluator
from ampctl.engine.precision.half import fp32_copy
from ampctl.engine.precision.policy import PrecisionPolicy
from ampctl.engine.telemetry import Telemetry
from ampctl.engine.weight_average import WeightAverage
from ampctl.errors import UsageError

PREFIX, FP32_PREFIX = "eval", "eval_fp32"


def eval_line(step: int, row: dict[str, Any]) -> str:
    """`eval step 100: loss 1.2345 | accuracy 56.2% | perplexity 3.44 (fp32: loss 1.2340 | ...) (ema: loss 1.2001
    | ...) | 0.4 s`"""
    def metrics(prefix: str, ema: bool = False) -> str:
        start = f"{prefix}/{EMA_METRIC}" if ema else f"{prefix}/"
        return " | ".join(f"{name[len(start):]} {format_metric(name, value)}" for name, value in row.items()
                          if name.startswith(start) and (ema or not name.startswith(f"{prefix}/{EMA_METRIC}")))

    fp32, ema = metrics(FP32_PREFIX), metrics(PREFIX, ema=True)
    seconds = row["seconds"]
    return (f"eval step {step}: {metrics(PREFIX)}" + (f" (fp32: {fp32})" if fp32 else "")
            + (f" (ema: {ema})" if ema else "")
            + (f" | {seconds:.1f} s" if seconds >= 1 else f" | {seconds * 1e3:.0f} ms"))


def format_metric(name: str, value: Optional[float]) -> str:
    if value is None:
        return "nan"
    return f"{value:.2%}" if name.endswith("accuracy") else f"{value:.4f}" if abs(value) < 1e4 else f"{value:.4g}"


class RunEvaluation:
    """When to evaluate, and each evaluation of the run recorded."""

    def __init__(self, cfg: DictConfig, recipe: Any, policy: PrecisionPolicy) -> None:
        train = cfg.train
        self.every, self.steps, self.fp32 = train.eval.every, train.steps, train.eval.fp32
        self.ema = train.ema.decay is not None  # the weight average evaluated too, as eval/ema_<metric>
        self.policy = policy
        self.evaluator = Evaluator(recipe, policy.device, train.eval.batches)  # the plan refused what it cannot

    def check_monitor(self, model: torch.nn.Module, monitor: str) -> None:
        """train.checkpoint.monitor is among the recipe's metrics (or the weight average's: ema_<metric>): one held-out
        batch evaluated at start (the model is not changed by it), so that a wrong name is refused before the run
        records anything."""
        one = Evaluator(self.evaluator.recipe, self.policy.device, batches=1)
        names = list(one.evaluate(model, self.policy.forward_context()))
        if self.ema:
            names += [EMA_METRIC + name for name in names]
        if monitor not in names:
            raise UsageError(f"train.checkpoint.monitor={monitor}: the recipe's evaluation gives no such metric; "
                             f"it gives {', '.join(sorted(names))}")

    def due(self, step: int, last: bool) -> bool:
        return step % self.every == 0 or (last and step == self.steps)

    def __call__(self, step: int, model: torch.nn.Module, telemetry: Telemetry, compiling: CompileWatch,
                 recorder: Any, ema: Optional[WeightAverage] = None) -> dict[str, Any]:
        """Evaluate after `step`; record and return the row (`eval/loss`, `eval_fp32/loss`, `eval/ema_loss`, ...,
        `seconds`). The weight average is evaluated in the model's parameters, under the same autocast."""
        telemetry.flush()  # the rows up to this step first: the timer is drained before it restarts
        began = time.perf_counter()
        with compiling.outside_steps():
            row: dict[str, Any] = {"step": step}
            row.update(_prefixed(PREFIX, self.evaluator.evaluate(model, self.policy.forward_context())))
            if ema is not None:
                averaged = self._evaluated_average(model, ema)
                row.update(_prefixed(PREFIX, {EMA_METRIC + name: value for name, value in averaged.items()}))
            if self.fp32:
                fp32_model = fp32_copy(model) if self.policy.precision.cast_model else model
                row.update(_prefixed(FP32_PREFIX, self.evaluator.evaluate(
                    fp32_model, torch.autocast(self.policy.device.type, enabled=False))))
        row["seconds"] = round(time.perf_counter() - began, 4)
        recorder.record_eval(row, eval_line(step, row))
        telemetry.timer.restart()  # the evaluation is no step's time
        return row


    def _evaluated_average(self, model: torch.nn.Module, ema: WeightAverage) -> dict[str, float]:
        """The average's metrics, in the model's parameters; a converter that derives state from the weights (FP8's
        all-gather scales under FSDP) is told as they change, and again as the model's own come back."""
        converter = self.policy.converter
        try:
            with ema.swapped_in():
                if converter is not None:
                    converter.weights_changed(model)
                return self.evaluator.evaluate(model, self.policy.forward_context())
        finally:
            if converter is not None:
                converter.weights_changed(model)


def _prefixed(prefix: str, metrics: dict[str, float]) -> dict[str, float]:
    return {f"{prefix}/{name}": value for name, value in metrics.items()}


def read_evals(run_dir: Path) -> list[dict[str, Any]]:
    """evals.jsonl's rows (a line cut short by a kill passed over); non-finite values are null there."""
    return io.read_jsonl(run_dir / run_files.EVALS)


def summary_of(run_dir: Path) -> dict[str, Any]:
    """The summary's `eval`: the run's last evaluation (its step and metrics), from evals.jsonl, which holds the
    evaluations of the run's one timeline (a resumed run's included)."""
    rows = read_evals(run_dir)
    return {"eval": {k: v for k, v in rows[-1].items() if k != "seconds"}} if rows else {}
