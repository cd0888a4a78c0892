"""What `ampctl advise` recommends from what it measured: the decision alone, a pure function of the evidence
(studies/advise.py measures it), so that each rule is tested on recorded figures.

The rules, for goal=speed (the default): a mode is recommended over fp32 only where the comparison measured it
faster (its speedup's interval above 1, from alternating rounds) *and* its held-out loss matches fp32's within
seed noise (reports/parity.py); the fastest such mode wins. goal=memory: the smallest measured peak among the
modes that match. goal=accuracy: fp32, with what the others would give. A mode whose parity the seeds did not
decide is not recommended: the advice says so, and that a longer budget decides it. A mode that scales its loss
(fp16, O1, O2, O3) gets an initial scale from the largest gradient measured (the largest power of two that keeps
it finite in fp16 with a factor 2 to spare) and a rule keeping in fp32 every layer whose activations exceed fp16's
range.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from ampctl.analysis.numerics import largest_safe_scale
from ampctl.io import scale_label

BASELINE = "fp32"
SCALED_MODES = ("fp16", "O1", "O2", "O3")  # fp16 compute: a loss scaler, and fp16's range, matter
GRADSCALER_INIT = 2.0**16
MAX_INIT_SCALE = 2.0**24  # a start above this buys nothing the scaler's growth would not


@dataclass(frozen=True)
class ModeEvidence:
    """One mode as the comparison saw it (speedup and memory against fp32's, measured in the same rounds)."""

    mode: str
    speedup: Optional[float] = None  # median of the round-by-round ratios of fp32's step time to this mode's
    speedup_low: Optional[float] = None
    speedup_high: Optional[float] = None
    parity: Optional[str] = None  # matches | differs | undecided | one seed
    eval_loss_delta: Optional[float] = None  # mean over seeds of (mode - fp32) held-out loss
    seeds: int = 0
    peak_mib: Optional[float] = None
    skipped: Optional[str] = None  # why it did not run here
    failed: Optional[str] = None  # why its run failed

    @property
    def faster(self) -> bool:
        return self.speedup_low is not None and self.speedup_low > 1.0

    @property
    def slower(self) -> bool:
        return self.speedup_high is not None and self.speedup_high < 1.0

    def speed_words(self) -> str:
        if self.speedup is None:
            return "no speed measured"
        interval = f"{self.speedup_low:.2f}-{self.speedup_high:.2f}x" if self.speedup_low is not None else "one round"
        if self.faster:
            return f"{self.speedup:.2f}x fp32's speed ({interval})"
        if self.slower:
            return f"{1 / self.speedup:.2f}x slower than fp32 ({interval} of its speed)"
        return f"no measurable difference in speed from fp32 ({interval})"


@dataclass(frozen=True)
class GradientEvidence:
    """What inspect measured in fp32 (true values) over a few steps."""

    max_gradient: float  # max |gradient| (activation and weight gradients)
    flushed_in_fp16: float  # share of activation gradients fp16 flushes to zero at GradScaler's 2^16
    overflowing_layers: tuple[str, ...] = ()  # layers whose activations exceed fp16's range


@dataclass
class Advice:
    mode: str
    goal: str
    reasons: list[str]
    rejected: dict[str, str]
    scaler: dict[str, Any] = field(default_factory=dict)  # scaler.<key> -> value for the chosen mode
    rules: list[dict[str, str]] = field(default_factory=list)  # precision.rules for the chosen mode

    def overrides(self) -> list[str]:
        """The command line that runs the advice."""
        out = [f"precision={self.mode}", *(f"scaler.{k}={v!r}" for k, v in self.scaler.items())]
        if self.rules:
            out.append("precision.rules=[" + ",".join("{" + ",".join(f"{k}:'{v}'" for k, v in rule.items()) + "}"
                                                      for rule in self.rules) + "]")
        return out

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def decide(modes: list[ModeEvidence], gradients: Optional[GradientEvidence], goal: str = "speed") -> Advice:
    baseline = next((m for m in modes if m.mode == BASELINE), None)
    rejected: dict[str, str] = {}
    matching: list[ModeEvidence] = []
    for m in modes:
        if m.mode == BASELINE:
            continue
        why = _why_not(m)
        if why is None:
            matching.append(m)
        else:
            rejected[m.mode] = why
    chosen, reasons = _choose(goal, baseline, matching, rejected)
    advice = Advice(chosen, goal, reasons, rejected)
    if chosen in SCALED_MODES and gradients is not None:
        _scaler_and_rules(advice, gradients)
    return advice


def _why_not(m: ModeEvidence) -> Optional[str]:
    """Why a mode cannot be recommended whatever the goal, or None when it matches fp32's accuracy."""
    if m.skipped is not None:
        return m.skipped
    if m.failed is not None:
        return f"its run failed: {m.failed}"
    delta = "" if m.eval_loss_delta is None else f"held-out loss {m.eval_loss_delta:+.4f} against fp32"
    if m.parity == "differs":
        return f"{delta}, beyond the seed-to-seed noise of {m.seeds} seeds; {m.speed_words()}"
    if m.parity == "matches":
        return None
    decided = "with one seed no verdict" if m.parity in (None, "one seed") else f"not decided by {m.seeds} seeds"
    return (f"{m.speed_words()}, but its accuracy is not shown to match fp32's ({delta or 'no held-out loss'}, "
            f"{decided}): a longer advise.budget trains longer and decides it")


def _choose(goal: str, baseline: Optional[ModeEvidence], matching: list[ModeEvidence],
            rejected: dict[str, str]) -> tuple[str, list[str]]:
    if goal == "accuracy":
        alternatives = "; ".join(f"{m.mode}: {m.speed_words()}, matches within seed noise" for m in matching)
        return BASELINE, ["goal=accuracy: fp32 is the reference every other mode is measured against"
                          + (f"; alternatives that matched it: {alternatives}" if alternatives else "")]
    if goal == "memory":
        lower = [m for m in matching if m.peak_mib is not None and baseline is not None and baseline.peak_mib
                 and m.peak_mib < baseline.peak_mib]
        for m in matching:
            if m not in lower:
                rejected[m.mode] = f"matches fp32, but its peak is not below fp32's ({_mib(m.peak_mib)})"
        if not lower:
            return BASELINE, ["no mode that matches fp32's accuracy measured a smaller peak than fp32's "
                              f"({_mib(baseline.peak_mib if baseline else None)})"]
        best = min(lower, key=lambda m: (m.peak_mib, -(m.speedup or 0.0)))
        for m in lower:
            if m is not best:
                rejected[m.mode] = f"peak {_mib(m.peak_mib)}, above {best.mode}'s {_mib(best.peak_mib)}"
        return best.mode, [f"the smallest peak of the modes that match fp32's accuracy: {_mib(best.peak_mib)} against "
                           f"fp32's {_mib(baseline.peak_mib if baseline else None)}; {best.speed_words()}"]
    faster = [m for m in matching if m.faster]
    for m in matching:
        if not m.faster:
            rejected[m.mode] = f"matches fp32's accuracy, but {m.speed_words()}"
    if not faster:
        return BASELINE, ["no mode was measured faster than fp32 with fp32's accuracy on this machine"]
    best = max(faster, key=lambda m: m.speedup or 0.0)
    for m in faster:
        if m is not best:
            rejected[m.mode] = f"{m.speed_words()}, below {best.mode}'s {best.speedup:.2f}x"
    return best.mode, [f"the fastest mode here that keeps fp32's accuracy: {best.speed_words()}; held-out loss "
                       f"{best.eval_loss_delta:+.4f} against fp32, within the seed-to-seed noise of {best.seeds} seeds"]


def _scaler_and_rules(advice: Advice, gradients: GradientEvidence) -> None:
    safe = largest_safe_scale(gradients.max_gradient)
    if math.isfinite(safe):
        init = min(safe, MAX_INIT_SCALE)
        advice.scaler["init_scale"] = init
        if init < GRADSCALER_INIT:
            advice.reasons.append(
                f"scaler.init_scale={scale_label(init)}: the largest gradient measured ({gradients.max_gradient:.3g}) "
                f"overflows fp16 at GradScaler's 2^16; {scale_label(init)} keeps it finite with a factor 2 to spare")
        elif init > GRADSCALER_INIT:
            advice.reasons.append(
                f"scaler.init_scale={scale_label(init)}: at GradScaler's 2^16, fp16 flushes "
                f"{gradients.flushed_in_fp16:.2%} of the activation gradients to zero; {scale_label(init)} still "
                f"keeps the largest ({gradients.max_gradient:.3g}) finite with a factor 2 to spare")
    advice.scaler["growth_interval"] = 2000
    advice.reasons.append("scaler.growth_interval=2000 (GradScaler's): from a start the gradients measured allow, growth "
                          "only probes upward, and each probe that overflows costs a skipped step")
    for layer in gradients.overflowing_layers:
        advice.rules.append({"match": layer, "run_in": "fp32"})
    if gradients.overflowing_layers:
        advice.reasons.append(f"{', '.join(gradients.overflowing_layers)} kept in fp32 (precision.rules): their "
                              "activations exceed fp16's range")


def _mib(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f} MiB"
