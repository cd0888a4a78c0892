"""Evaluation on held-out batches: the recipe's metrics, under the run's autocast as the model would be used
(and, where asked, in fp32 too), without changing training.

A recipe that can be evaluated gives `eval_batches(device)`: held-out batches, the same on every call and for
every seed, so that every run of a comparison is measured on the same data; ampctl takes the first
train.eval.batches of them. `eval_metrics(model, batch)` (optional) returns, for one batch, the *sums* over its
examples (or tokens) of each metric and `count`, the number summed over: the means over all batches are exact
whatever the batch sizes (the last batch of a folder may be short). Without it the metric is the recipe's own
loss, one batch counting one. A language model (tokens_per_batch set) also gets perplexity = exp(mean loss).

Evaluation never changes training: the model runs in eval mode under torch.no_grad() (dropout off, BatchNorm
reads its running statistics and does not update them), the global RNGs are forked and restored, every buffer
the forward may update (FP8 amax histories) is restored, and the training batch stream is not touched (the
held-out batches are a stream of their own). The metrics stay on the device until one read at the end.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Any, ContextManager, Iterator, Mapping, Optional

import torch
from torch import nn

from ampctl.errors import UsageError

COUNT = "count"


def can_evaluate(recipe: Any) -> bool:
    return callable(getattr(recipe, "eval_batches", None))


def held_out_unavailable(recipe: Any) -> Optional[str]:
    """Why the recipe cannot be evaluated, or None: it has no eval_batches, or they refuse (a folder of images
    without its held-out folder). Asking costs nothing: the built-in recipes' held-out batches are lazy."""
    if not can_evaluate(recipe):
        return f"recipe {type(recipe).__name__} gives no held-out batches (eval_batches(device))"
    try:
        recipe.eval_batches(torch.device("cpu"))
    except UsageError as exc:
        return str(exc)
    return None


def default_metrics(recipe: Any, model: nn.Module, batch: Any) -> Mapping[str, torch.Tensor]:
    """The recipe's loss on the batch, counting one: the metric of a recipe that names none."""
    loss = recipe.loss(model, batch)
    return {"loss": loss.detach().float(), COUNT: torch.ones((), device=loss.device)}


class Evaluator:
    """The held-out metrics of one model: evaluate() after a step, as often as asked."""

    def __init__(self, recipe: Any, device: torch.device, batches: int) -> None:
        if not can_evaluate(recipe):
            raise UsageError(f"train.eval.every: recipe {type(recipe).__name__} gives no held-out batches "
                             "(eval_batches(device)); see docs/models.md, 'Add your own recipe'")
        refused = held_out_unavailable(recipe)  # e.g. a folder of images without its held-out folder
        if refused:
            raise UsageError(refused)
        self.recipe, self.device, self.batches = recipe, device, batches
        self.language_model = getattr(recipe, "tokens_per_batch", None) is not None

    def held_out(self) -> Iterator[Any]:
        return itertools.islice(iter(self.recipe.eval_batches(self.device)), self.batches)

    def evaluate(self, model: nn.Module, autocast: ContextManager) -> dict[str, float]:
        """The means of the recipe's metrics over the held-out batches, model as it is now, under autocast."""
        metrics = getattr(self.recipe, "eval_metrics", None)
        sums: dict[str, torch.Tensor] = {}
        with untouched(model), torch.no_grad():
            for batch in self.held_out():
                with autocast:
                    values = metrics(model, batch) if metrics is not None else default_metrics(self.recipe, model,
                                                                                               batch)
                for name, value in values.items():
                    value = value.detach().double()  # sums of many batches: exact enough in any mode
                    sums[name] = sums[name] + value if name in sums else value
        if not sums:
            raise UsageError(f"recipe {type(self.recipe).__name__}: eval_batches(device) gave no batch")
        if COUNT not in sums:
            raise UsageError(f"recipe {type(self.recipe).__name__}: eval_metrics(model, batch) returned "
                             f"{sorted(sums)}; it must include {COUNT!r}, the examples its sums are over")
        names = list(sums)  # the recipe's order: loss first, as its metrics name it
        values = dict(zip(names, torch.stack([sums[n] for n in names]).tolist()))  # the one device read
        count = values.pop(COUNT)
        means = {name: value / count for name, value in values.items()}
        if self.language_model and "loss" in means:
            means["perplexity"] = math.exp(means["loss"]) if means["loss"] < 700 else math.inf
        return means


@contextlib.contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """model in eval mode, the global RNGs forked and the buffers saved; all restored afterwards."""
    training = model.training
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    model.eval()
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        model.train(training)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
