"""guard.on_trip=escalate: a guard's trip raises the precision of the layer(s) to blame, and the run goes on from its
newest good checkpoint instead of stopping.

Which layers: the tripped step is replayed (runner/guarding/diagnose.py). Where a value went non-finite or out of the
half
type's range, the layers it names, in the order they ran, the first that can go one step up (a layer a converter
computes in a format -> `unconverted`; a half one -> fp32: PrecisionPolicy.one_step_up, diff's repair's too), and
the layer where the gradient first went bad on its way back. Where nothing is non-finite (a finite loss spike), the
step's batch is measured as `ampctl diff` measures (runner/layer_error_log.Fp32Reference) at the replayed weights:
when fp32 on those weights spikes as well, the spike is the data's or the optimizer's, not precision's, and the run
stops saying so; otherwise the layer that adds the largest error of its own goes up.

Where from: the newest checkpoint before the tripped step that belongs to the run and whose weights are finite (none:
the start, which is seeded). What is past it (rows, later checkpoints) is set aside as a resume to an older
checkpoint sets it aside (runner/ownership.start_timeline_at); the run is built again with the rules and the
checkpoint restored, exactly as a run resumed from that checkpoint with those rules would be.

The record: a row of escalations.jsonl per escalation; its `step` is the checkpoint's, from which its rules hold
(`rules`: every escalation rule in force from there on). They are the run's scheduled changes: a resume at a step
applies the rules of the last row at or before it (resume_rules), and a resume before a row's step sets the row
aside with the rows after it. The rules go before the mode's own; a rule of the mode's that names only an escalated
layer is replaced by the escalation's (the first rule that matches decides; the earlier one would contradict it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from omegaconf import DictConfig, OmegaConf

from ampctl import io, run_files
from ampctl.conf.precision_schema import LayerRule
from ampctl.conf.schema import TripAction
from ampctl.conf.typed import typed_config
from ampctl.engine.precision.policy import PrecisionPolicy
from ampctl.errors import UsageError
from ampctl.recipes.base import Recipe
from ampctl.runner.checkpointing import checkpoint, checkpoint_files
from ampctl.runner.guarding.escalation_rules import recorded, rules_in, with_rules
from ampctl.runner.guarding.guards import GuardTrip
from ampctl.runner.identity import RunIdentity, resolved
from ampctl.runner.resume import Resume

if TYPE_CHECKING:  # annotations only: the replay is the run's to make (runner/guarding/diagnose.py), the plan's
    from ampctl.runner.guarding.diagnose import Diagnosis, Finding, Replayed
    from ampctl.runner.plan import RunPlan


@dataclass
class Escalation:
    """One escalation: the row escalations.jsonl records."""

    number: int  # the run's first, second, ... escalation
    step: int  # the checkpoint's step it went back to (0: the start): its rules hold from there on
    tripped_at: int  # the step the guard tripped at
    reason: str  # the guard's
    raised: dict[str, str]  # layer -> what it runs in from `step` on
    rules: list[LayerRule]  # every escalation rule in force from `step` on, earlier escalations' included
    evidence: str  # why these layers, in one line
    checkpoint: Optional[str]  # the checkpoint it went back to (None: the start)
    diagnosis: str = ""  # the replay's summary

    def to_json(self) -> dict[str, Any]:
        """Its row in escalations.jsonl."""
        return {**asdict(self), "rules": [rule.as_record() for rule in self.rules]}

    def line(self, most: int) -> str:
        """`escalation 1 of at most 3: amplifier -> fp32 (the replay finds ...); from step 4's checkpoint on`"""
        raised = ", ".join(f"{layer} -> {run_in}" for layer, run_in in self.raised.items())
        where = f"step {self.step}'s checkpoint" if self.checkpoint else "the start (no checkpoint before it)"
        return f"escalation {self.number} of at most {most}: {raised} ({self.evidence}); training again from {where}"


@dataclass
class Escalate:
    """A trip's escalation: its row, and the run's new plan, which the run is built from again as a resume is: its
    config with the raised rules, their policy (checked as any plan's), and the checkpoint it goes back to as its
    resume (none: the start)."""

    escalation: Escalation
    plan: RunPlan


@dataclass
class Stop:
    """A trip that stops the run: the replay's diagnosis, and why it was not escalated ('' where escalation is off)."""

    diagnosis: Diagnosis
    why_not: str = ""


Decision = Union[Escalate, Stop]


class Escalator:
    """The run's escalations: how many it made (the rows in force where it starts), and the decision at a trip."""

    def __init__(self, cfg: DictConfig, run_dir: Path, identity: Optional[RunIdentity],
                 check: Callable[[DictConfig], PrecisionPolicy]) -> None:
        self.check = check  # the plan's checks of a config (runner/plan.check_config): the raised rules' policy
        self.enabled = cfg.guard.on_trip is TripAction.escalate
        self.most = cfg.guard.max_escalations
        self.run_dir, self.identity = run_dir, identity
        rows = recorded(run_dir)  # read after the run set aside what lies past its resume step
        self.made = len(rows)
        self.rules = rules_in(rows[-1]) if rows else []

    def decide(self, trip: GuardTrip, diagnosis: Diagnosis, replayed: Replayed, plan: RunPlan,
               recipe: Recipe) -> Decision:
        """From the tripped step's replay (its diagnosis, and the state it replayed to) and the plan the run trains
        on: the layers and the new plan; or in words why not."""
        if not self.enabled:
            return Stop(diagnosis)
        if self.made >= self.most:
            return Stop(diagnosis, f"guard.max_escalations={self.most} escalations made already")
        raised, evidence = _from_the_replay(diagnosis, plan.policy)
        why_not = ""
        if not raised:
            raised, evidence, why_not = _from_the_error(trip, replayed, plan.policy, recipe)
        if not raised:
            return Stop(diagnosis, why_not or f"no layer it names can go higher than it runs ({evidence})")
        return self._plan(diagnosis, trip, plan, raised, evidence)

    def _plan(self, diagnosis: Diagnosis, trip: GuardTrip, plan: RunPlan, raised: dict[str, str],
              evidence: str) -> Decision:
        rules = list(self.rules)
        for layer, run_in in raised.items():
            rule = LayerRule.for_layer(layer, run_in)
            same = [i for i, earlier in enumerate(rules) if earlier.match == rule.match]
            if same:
                rules[same[0]] = rule
            else:
                rules.append(rule)
        try:
            cfg = typed_config(OmegaConf.create(with_rules(resolved(plan.cfg), rules)))
            policy = self.check(cfg)  # as any plan's
        except UsageError as exc:
            return Stop(diagnosis, f"the raised rules are refused: {exc}")
        path, payload = self.good_checkpoint(trip.step)
        escalation = Escalation(self.made + 1, payload["step"] if payload else 0, trip.step, trip.reason, raised,
                                rules, evidence, str(path) if path else None, diagnosis.summary)
        resume = Resume(self.run_dir, path, payload)
        return Escalate(escalation, dataclasses.replace(plan, cfg=cfg, policy=policy, resume=resume))

    def good_checkpoint(self, before: int) -> tuple[Optional[Path], Optional[dict[str, Any]]]:
        """The newest checkpoint before step `before` that passes its check, is the run's and holds finite weights."""
        for path in reversed(checkpoint_files.list_checkpoints(self.run_dir)):
            if checkpoint_files.checkpoint_step(path) >= before:
                continue
            try:
                payload = checkpoint.load(path, mmap=True)
            except UsageError:
                continue
            if self.identity is not None and self.identity.disowns(payload):
                continue
            sharded = checkpoint_files.is_sharded(path)  # its weights are in its shards, checked as they load
            if sharded or all(bool(torch.isfinite(t).all()) for t in io.tensors_in(payload["model"])
                              if t.is_floating_point()):
                return path, payload
        return None, None

    def record(self, escalation: Escalation) -> None:
        """Its row, after the rows past its step were set aside (its own step's are kept)."""
        with (self.run_dir / run_files.ESCALATIONS).open("a", encoding="utf-8") as f:
            f.write(io.dumps(escalation.to_json()) + "\n")
        self.made, self.rules = escalation.number, escalation.rules


def _from_the_replay(diagnosis: Diagnosis, policy: PrecisionPolicy) -> tuple[dict[str, str], str]:
    """The layers the replay found a value non-finite or out of range in that can go up, and what it found: the
    first forward one that can (a layer after it carries what an earlier one made; one already in fp32 hands a
    value its next layer's half type cannot hold on), and the one where the gradient first went bad on its way back;
    where neither, the first layer whose parameters' gradients are not finite."""
    backward = [diagnosis.backward] if diagnosis.backward else []
    raised: dict[str, str] = {}
    seen: list[Finding] = []
    for group in (diagnosis.forward_problems, backward):
        for finding in group:
            seen.append(finding)
            run_in = policy.one_step_up(finding.module)
            if run_in is not None:
                raised.setdefault(finding.module, run_in)
                break
    if raised:
        return raised, "the replay finds " + ", then ".join(_found(f) for f in seen)
    for name in diagnosis.parameters_with_nonfinite_grads:
        layer = name.rpartition(".")[0]
        if (run_in := policy.one_step_up(layer)) is not None:
            return {layer: run_in}, f"the replay finds the gradient of {name} non-finite"
    if seen:
        return {}, "the replay finds " + ", then ".join(_found(f) for f in seen)
    return {}, "the replay finds every value finite"


def _found(finding: Finding) -> str:
    return f"{finding.module!r} ({finding.type}, {finding.dtype}) {finding.problem}"


def _from_the_error(trip: GuardTrip, replayed: Replayed, policy: PrecisionPolicy,
                    recipe: Recipe) -> tuple[dict[str, str], str, str]:
    """Nothing non-finite: the tripped step's batch measured against fp32 at the replayed weights. (raised,
    evidence, why not)."""
    from ampctl.runner.layer_error_log import Fp32Reference

    replayed.state.model.zero_grad(set_to_none=True)  # the replay's backward left its gradients
    layers, whole, _ = Fp32Reference(recipe, policy).measure(replayed.state, replayed.bad_batches)
    ref = sum(r for r, _ in whole.losses) / len(whole.losses)
    cand = sum(c for _, c in whole.losses) / len(whole.losses)
    said = f"on the replayed weights and batch fp32's loss is {ref:.4g}, this mode's {cand:.4g}"
    if trip.spike_above is not None and (not math.isfinite(ref) or ref > trip.spike_above):
        return {}, said, (f"{said}: fp32 spikes as well (a spike is a loss above {trip.spike_above:.4g}), so the "
                          "spike is the data's or the optimizer's, not precision's")
    ranked = sorted(layers.values(), key=lambda layer: layer.local_error(), reverse=True)
    for layer in ranked:
        run_in = policy.one_step_up(layer.name)
        if run_in is not None and layer.local_error() > 0:
            return ({layer.name: run_in}, f"{said}; the largest error a layer adds itself: {layer.name!r} "
                    f"({layer.kind}) {layer.local_error():.2g}", "")
    return {}, said, f"{said}, and no layer that can go higher adds an error of its own"
