"""Routing that `ampctl diff` can see: for each router of a mixture of experts, the share of tokens whose top-k
experts differ between the reference and the candidate (a top-k is discontinuous: a small error in the scores sends
a token to another expert, and its whole output changes), end to end and by the router alone (the candidate's router
on the reference's own input: what its own precision does), and its scores' error.

A router is a module whose class sets `ampctl_router = True` and whose forward(x) returns (scores, weights, chosen):
every expert's score per token, the top-k weights and the experts chosen (recipes/moe.py's Router; a user's alike);
transformers' `*TopKRouter` classes return theirs in the same places."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ampctl.analysis.error_sums import ErrorSums


def is_router(module: nn.Module) -> bool:
    """ampctl's protocol, or transformers' routers (MixtralTopKRouter, Qwen3MoeTopKRouter: their forward returns
    (logits, top-k weights, top-k experts), the scores compared then being the logits)."""
    return bool(getattr(type(module), "ampctl_router", False)) or type(module).__name__.endswith("TopKRouter")


def routers(model: nn.Module) -> list[str]:
    """The model's routers, by name, in the order they run."""
    return [name for name, module in model.named_modules() if is_router(module)]


def differing(chosen: torch.Tensor, other: torch.Tensor) -> int:
    """The tokens whose sets of experts differ (the order of a token's k choices aside)."""
    return int((chosen.sort(dim=-1).values != other.sort(dim=-1).values).any(dim=-1).sum())


@dataclass
class RouterFlips:
    """One router's counts over the diff's batches."""

    name: str
    tokens: int = 0
    flipped: int = 0  # end to end: the candidate's router on the candidate's own input
    own_flipped: int = 0  # by the router alone: the candidate's router on the reference's input
    scores: ErrorSums = field(default_factory=ErrorSums)  # of every expert's score, end to end

    def to_json(self) -> dict[str, Any]:
        return {"router": self.name, "tokens": self.tokens, "flipped": self.flipped / max(self.tokens, 1),
                "own_flipped": self.own_flipped / max(self.tokens, 1),
                "scores_error": self.scores.rel_rms if self.scores.values else None}


class RoutingWatch:
    """The routers both models have, watched through each batch's two passes (capturing), then compared."""

    def __init__(self, reference: nn.Module, candidate: nn.Module) -> None:
        theirs = set(routers(candidate))
        self.flips = {name: RouterFlips(name) for name in routers(reference) if name in theirs}
        self._seen: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    @contextlib.contextmanager
    def capturing(self, side: str, model: nn.Module) -> Iterator[None]:
        """Each router's (input, scores, chosen) of this side's forward."""
        seen = self._seen[side] = {}

        def hook(name: str) -> Callable:
            def keep(_module: nn.Module, args: tuple, output: tuple) -> None:
                seen[name] = (args[0].detach(), output[0].detach(), output[2].detach())
            return keep

        handles = [model.get_submodule(name).register_forward_hook(hook(name)) for name in self.flips]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def compare(self, candidate: nn.Module, enter: Callable[[], Any], forward_context: Callable[[], Any]) -> None:
        """The batch's two passes compared; the candidate's routers run again on the reference's inputs, in the
        candidate's precision (its policy and autocast, as its forward ran)."""
        reference, theirs = self._seen.get("reference", {}), self._seen.get("candidate", {})
        for name, flips in self.flips.items():
            if name not in reference or name not in theirs:
                continue
            x, ref_scores, ref_chosen = reference[name]
            _, scores, chosen = theirs[name]
            flips.tokens += ref_chosen.shape[0]
            flips.flipped += differing(ref_chosen, chosen)
            flips.scores.add(scores.double(), ref_scores.double())
            with torch.no_grad(), enter(), forward_context():
                own = candidate.get_submodule(name)(x)[2]
            flips.own_flipped += differing(ref_chosen, own)

    def results(self) -> list[dict[str, Any]]:
        return [flips.to_json() for flips in self.flips.values()]
