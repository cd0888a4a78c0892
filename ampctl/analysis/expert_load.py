"""The tokens each expert gets, over training (a mixture of experts' load): every MoE layer (a module whose class sets
`ampctl_experts = True` and holds `tokens_per_expert`, the tokens its experts were sent since it was last read, added
up on the device by its training forwards) read every N steps of `ampctl train` (telemetry.experts_every; by default
on every log step), in one transfer, then set to zero: per layer, each expert's share of the tokens routed in those
steps and the busiest expert's load over the mean (1 when balanced), to experts.jsonl, the trackers (experts/...) and
the live line (`load 1.42x`: the worst layer's). A layer with a capacity (`dropped_per_expert`, its pairs dropped past
it, read in the same transfer) adds the share of its interval's (token, k) pairs it dropped. Shares and ratios, not
counts: activation checkpointing runs a forward twice, which doubles every count alike."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from ampctl import io


def moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if getattr(type(m), "ampctl_experts", False)]


def load_row(step: int, counts: dict[str, list[float]],
             dropped: Optional[dict[str, list[float]]] = None) -> dict[str, Any]:
    """experts.jsonl's row of the counts read at `step` (layer -> tokens per expert; dropped: layer -> pairs each
    expert dropped, for the layers with a capacity). `dropped` at the top: the worst layer's share."""
    layers = {}
    dropped = dropped or {}
    for name, tokens in counts.items():
        total = sum(tokens)
        mean = total / len(tokens)
        layers[name] = {"shares": [t / total if total else 0.0 for t in tokens],
                        "max_over_mean": max(tokens) / mean if mean else None}
        if name in dropped:
            layers[name]["dropped"] = sum(dropped[name]) / total if total else 0.0
    ratios = [layer["max_over_mean"] for layer in layers.values() if layer["max_over_mean"] is not None]
    row = {"step": step, "max_over_mean": max(ratios) if ratios else None, "layers": layers}
    if dropped:
        row["dropped"] = max(layer["dropped"] for layer in layers.values() if "dropped" in layer)
    return row


def _dropped(layer: nn.Module) -> Optional[torch.Tensor]:
    return getattr(layer, "dropped_per_expert", None)


class ExpertLoadLog:
    """Reads the MoE layers' load after every N-th step (around it: before the step's records are written, so that
    the live line that shows them shows its load) and writes its row; the other steps read nothing."""

    def __init__(self, model: nn.Module, every: int, path: Path, written: Callable[[dict[str, Any]], None],
                 shown: Callable[[str], None]) -> None:
        self._layers = moe_layers(model)
        self._every, self._path, self._written, self._shown = every, path, written, shown
        for _, layer in self._layers:  # what an earlier timeline (a resume, an escalation) left uncounted
            layer.tokens_per_expert.zero_()
            if _dropped(layer) is not None:
                _dropped(layer).zero_()

    def __bool__(self) -> bool:
        return bool(self._layers)

    @contextlib.contextmanager
    def around(self, step: int) -> Iterator[None]:
        yield
        if step % self._every or not self._layers:
            return
        capped = [(name, layer) for name, layer in self._layers if _dropped(layer) is not None]
        stacked = torch.stack([layer.tokens_per_expert for _, layer in self._layers]
                              + [_dropped(layer) for _, layer in capped]).tolist()  # one transfer
        counts = dict(zip((name for name, _ in self._layers), stacked))
        dropped = dict(zip((name for name, _ in capped), stacked[len(self._layers):]))
        for _, layer in self._layers:
            layer.tokens_per_expert.zero_()
        for _, layer in capped:
            _dropped(layer).zero_()
        row = load_row(step, counts, dropped)
        with self._path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        self._written(row)
        if row["max_over_mean"] is not None:
            dropped = f", {row['dropped']:.1%} dropped" if "dropped" in row else ""
            self._shown(f"load {row['max_over_mean']:.2f}x{dropped}")


def expert_load_values(row: dict[str, Any]) -> dict[str, Any]:
    """An experts.jsonl row as a tracker's scalars: experts/max_over_mean and experts/<layer>/max_over_mean (with a
    capacity, experts/dropped and experts/<layer>/dropped too)."""
    values: dict[str, Any] = {"step": row["step"], "experts/max_over_mean": row["max_over_mean"]}
    if "dropped" in row:
        values["experts/dropped"] = row["dropped"]
    for layer, figures in row["layers"].items():
        values[f"experts/{layer}/max_over_mean"] = figures["max_over_mean"]
        if "dropped" in figures:
            values[f"experts/{layer}/dropped"] = figures["dropped"]
    return values


def over_the_run(path: Path, figure: str = "max_over_mean") -> Optional[float]:
    """summary.json's expert_load (figure max_over_mean: the worst layer's busiest-over-mean load) or expert_dropped
    (figure dropped: the worst layer's share of pairs dropped), the mean over the run's rows (None: no mixture of
    experts, no capacity, or no row); each row weighs its interval alike."""
    values = [row[figure] for row in io.read_jsonl(path) if row.get(figure) is not None]
    return sum(values) / len(values) if values else None
