"""What `ampctl advise` recommends from what it measured: the decision alone, a pure function of the evidence
(studies/advising/advise.py measures it), so that each rule is tested on recorded figures.

The rules, for goal=speed (the default): a mode is recommended over fp32 only where the comparison measured it
faster (its speedup's interval above 1, from alternating rounds) *and* its held-out loss matches fp32's within
seed noise (reports/parity.py); the fastest such mode wins. goal=memory: the smallest measured peak among the
modes that match. goal=accuracy: fp32, with what the others would give. A mode whose parity the seeds did not
decide is not recommended: the advice says so, and that a longer budget decides it.

Each mode is compared as it would be advised (prepare(), before the comparison): a mode that scales its loss
(fp16, O1, O2, O3) with an initial scale from the largest gradient measured (the largest power of two that keeps
it finite in fp16 with a factor 2 to spare) and fp32 for every layer whose activations exceed fp16's range; a mode
that converts Linear layers (FP8, MX) with the layers whose operands the format loses too much of left
unconverted. So the speed and the parity that decide are those of the config advise writes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from ampctl import io
from ampctl.analysis.numerics import FP16, largest_safe_scale
from ampctl.conf import precision_schedule
from ampctl.conf.precision_schema import GRADSCALER_GROWTH_INTERVAL, GRADSCALER_INIT_SCALE, UNCONVERTED, LayerRule
from ampctl.io import scale_label
from ampctl.studies import row_labels

BASELINE = "fp32"
SCALED_MODES = ("fp16", "O1", "O2", "O3")  # fp16 compute: a loss scaler, and fp16's range, matter
SAME_PEAK = 0.02  # goal=memory: peaks within 2% of each other are the same to a user (the faster wins)
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
    eval_loss_delta_interval: Optional[float] = None  # its 95% half-width over the seeds
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


@dataclass(frozen=True)
class LayerLoss:
    """What a low-precision format loses of one layer's operand (inspect: block scales, or FP8's tensorwise)."""

    layer: str
    operand: str  # activation | weight | gradient: the layer's operand that loses the most
    share: float  # of that operand's values, saturated or flushed to zero


@dataclass
class Preparation:
    """What advise sets for a mode before comparing it, so that the comparison measures the mode as it is advised:
    the loss scaler's settings, the per-layer rules (the advised ones first, then the mode's own), and why."""

    scaler: dict[str, Any] = field(default_factory=dict)
    rules: list[LayerRule] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    refused: Optional[str] = None  # why the mode is not worth comparing at all
    summary: str = ""  # the settings in a few words: "scaler.init_scale=2^13, head in fp32"

    def overrides(self) -> list[str]:
        out = [f"scaler.{k}={v!r}" for k, v in self.scaler.items()]
        if self.rules:
            out.append("precision.rules=[" + ",".join(rule.override() for rule in self.rules) + "]")
        return out


def prepare(mode: str, gradients: Optional[GradientEvidence], losses: Optional[list[LayerLoss]] = None,
            own_rules: Sequence[LayerRule] = (), limit: float = 0.01, measured_by: str = "") -> Preparation:
    """The settings of a mode before it is compared. A mode that scales its loss: an initial scale from the largest
    gradient measured and fp32 for the layers whose activations exceed fp16's range. A mode that converts Linear
    layers (FP8, MX): the layers whose worst operand the format loses more than `limit` of stay unconverted."""
    prepared = Preparation()
    added: list[LayerRule] = []
    if mode in SCALED_MODES and gradients is not None:
        _scaler(prepared, gradients)
        added = [LayerRule.for_layer(layer, "fp32") for layer in gradients.overflowing_layers]
        init = prepared.scaler.get("init_scale")
        prepared.summary = ", ".join([*([f"scaler.init_scale={scale_label(init)}"] if init else []),
                                      *([f"{', '.join(gradients.overflowing_layers)} in fp32"] if added else [])])
        if added:
            prepared.reasons.append(f"{', '.join(gradients.overflowing_layers)} kept in fp32 (precision.rules): their "
                                    "activations exceed fp16's range")
    if losses:
        beyond = sorted((loss for loss in losses if loss.share > limit), key=lambda loss: -loss.share)
        if len(beyond) == len(losses):
            prepared.refused = (f"{measured_by} loses more than {limit:.2%} of an operand in every one of its "
                                f"{len(losses)} converted layers (least: {min(loss.share for loss in losses):.2%}): "
                                "nothing would be left to run in it")
            return prepared
        added = [LayerRule.for_layer(loss.layer, UNCONVERTED) for loss in beyond]
        if beyond:
            prepared.summary = f"{io.count_of(len(beyond), 'layer')} of {len(losses)} unconverted"
            worst = ", ".join(f"{loss.layer} ({loss.share:.2%} of its {loss.operand}s)" for loss in beyond[:3])
            more = f" and {len(beyond) - 3} more" if len(beyond) > 3 else ""
            prepared.reasons.append(
                f"{io.count_of(len(beyond), 'layer')} of {len(losses)} kept unconverted (precision.rules), as "
                f"{measured_by} loses more than advise.layer_loss_limit={limit:g} of an operand there: {worst}{more}")
    prepared.rules = [*added, *own_rules] if added else []
    return prepared


@dataclass
class Advice:
    mode: str  # a comparison's row: "bf16", or "bf16+compile" where compile was compared both ways (see .precision)
    goal: str
    reasons: list[str]
    rejected: dict[str, str]
    scaler: dict[str, Any] = field(default_factory=dict)  # scaler.<key> -> value for the chosen mode
    rules: list[LayerRule] = field(default_factory=list)  # precision.rules for the chosen mode
    notes: list[str] = field(default_factory=list)  # what was not measured, and why

    def __post_init__(self) -> None:  # from advice.json: the rules as records hold them
        self.rules = [rule if isinstance(rule, LayerRule) else LayerRule.of(rule) for rule in self.rules]

    @property
    def precision(self) -> str:
        return row_labels.parse(self.mode).mode

    def overrides(self) -> list[str]:
        """The command line that runs the advice."""
        variant = row_labels.parse(self.mode)
        return [*precision_schedule.row_overrides(variant.mode), *variant.overrides(),
                *Preparation(self.scaler, self.rules).overrides()]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "rules": [rule.as_record() for rule in self.rules]}


def decide(modes: list[ModeEvidence], prepared: Optional[dict[str, Preparation]] = None,
           goal: str = "speed", notes: Sequence[str] = ()) -> Advice:
    """The advice from the comparison's rows; prepared: what advise set for each mode (by mode name) before the
    comparison measured it, adopted with the mode chosen."""
    prepared = prepared or {}
    # fp32's row: "fp32", or "fp32+adamw" where optimizers were compared too (the comparison's baseline)
    reference = next((m for m in modes if is_reference(m.mode)), None)
    reference_label = reference.mode if reference is not None else BASELINE
    rejected: dict[str, str] = {}
    matching: list[ModeEvidence] = []
    for m in modes:
        if m.mode == reference_label:
            continue
        why = _why_not(m)
        if why is None:
            matching.append(m)
        else:
            rejected[m.mode] = why
    if not matching and all(m.skipped is not None for m in modes if m.mode != reference_label):
        chosen, reasons = reference_label, ["no other mode was compared with fp32 here (each one's reason below): "
                                            "fp32, the reference, by default"]
    else:
        chosen, reasons = _choose(goal, reference, matching, rejected)
        chosen = reference_label if chosen == BASELINE else chosen
    for label in rejected:
        summary = getattr(_preparation(prepared, label), "summary", "")
        if summary and label not in {m.mode for m in modes if m.skipped is not None}:
            rejected[label] += f" (as advise would set it: {summary})"
    advice = Advice(chosen, goal, reasons, rejected, notes=list(notes))
    preparation = _preparation(prepared, chosen)
    if preparation is not None:
        advice.scaler, advice.rules = dict(preparation.scaler), list(preparation.rules)
        advice.reasons += preparation.reasons
    return advice


def _preparation(prepared: dict[str, Preparation], label: str) -> Optional[Preparation]:
    """A row's settings: its label's own (a repaired mode's), else its mode's."""
    return prepared.get(label) or prepared.get(row_labels.parse(label).mode)


def is_reference(label: str) -> bool:
    variant = row_labels.parse(label)
    return variant.mode == BASELINE and not variant.compiled and not variant.checkpointed


def _why_not(m: ModeEvidence) -> Optional[str]:
    """Why a mode cannot be recommended whatever the goal, or None when it matches fp32's accuracy."""
    if m.skipped is not None:
        return m.skipped
    if m.failed is not None:
        return f"its run did not finish ({m.failed})" if m.failed == "interrupted" else f"its run failed: {m.failed}"
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
        fp32_peak = baseline.peak_mib if baseline is not None else None
        lower = [m for m in matching if m.peak_mib is not None and fp32_peak
                 and m.peak_mib < fp32_peak * (1 - SAME_PEAK)]
        for m in matching:
            if m not in lower:
                rejected[m.mode] = (f"matches fp32, but its peak ({_mib(m.peak_mib)}) is not below fp32's "
                                    f"({_mib(fp32_peak)}) by more than {SAME_PEAK:.0%}")
        if not lower:
            return BASELINE, [f"no mode that matches fp32's accuracy measured a peak more than {SAME_PEAK:.0%} below "
                              f"fp32's ({_mib(fp32_peak)})"]
        smallest = min(m.peak_mib for m in lower)
        # peaks within SAME_PEAK of the smallest are the same to a user: the fastest of them
        best = max((m for m in lower if m.peak_mib <= smallest * (1 + SAME_PEAK)), key=lambda m: m.speedup or 0.0)
        for m in lower:
            if m is best:
                continue
            if m.peak_mib <= smallest * (1 + SAME_PEAK):
                rejected[m.mode] = (f"peak {_mib(m.peak_mib)}, within {SAME_PEAK:.0%} of {best.mode}'s "
                                    f"{_mib(best.peak_mib)}, and {best.mode} runs faster ({m.speed_words()})")
            else:
                rejected[m.mode] = f"peak {_mib(m.peak_mib)}, above {best.mode}'s {_mib(best.peak_mib)}"
        return best.mode, [f"the smallest peak of the modes that match fp32's accuracy: {_mib(best.peak_mib)} against "
                           f"fp32's {_mib(fp32_peak)}; {best.speed_words()}"]
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


def _scaler(prepared: Preparation, gradients: GradientEvidence) -> None:
    safe = largest_safe_scale(gradients.max_gradient)
    if math.isfinite(safe):
        init = min(safe, MAX_INIT_SCALE)
        prepared.scaler["init_scale"] = init
        if init < GRADSCALER_INIT_SCALE:
            at_default = gradients.max_gradient * GRADSCALER_INIT_SCALE
            what = ("overflows fp16" if at_default > FP16.max else
                    f"leaves less than a factor 2 below fp16's max ({at_default:.4g} of {FP16.max:g})")
            prepared.reasons.append(
                f"scaler.init_scale={scale_label(init)}: the largest gradient measured ({gradients.max_gradient:.3g}) "
                f"{what} at GradScaler's {scale_label(GRADSCALER_INIT_SCALE)}; {scale_label(init)} keeps it finite "
                "with a factor 2 to spare")
        elif init > GRADSCALER_INIT_SCALE:
            prepared.reasons.append(
                f"scaler.init_scale={scale_label(init)}: at GradScaler's {scale_label(GRADSCALER_INIT_SCALE)}, fp16 "
                f"flushes "
                f"{gradients.flushed_in_fp16:.2%} of the activation gradients to zero; {scale_label(init)} still "
                f"keeps the largest ({gradients.max_gradient:.3g}) finite with a factor 2 to spare")
    prepared.scaler["growth_interval"] = GRADSCALER_GROWTH_INTERVAL
    prepared.reasons.append("scaler.growth_interval=2000 (GradScaler's): from a start the gradients measured allow, "
                            "growth only probes upward, and each probe that overflows costs a skipped step")


def _mib(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f} MiB"
