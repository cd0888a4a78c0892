"""`ampctl advise`: a mode the goal would choose but for its accuracy is repaired before it is ruled out.

Where the comparison measured a mode faster than fp32 (goal=speed) or with a smaller peak (goal=memory) and its
held-out loss differs from fp32's beyond the seeds' noise, `ampctl diff`'s repair (studies/diffing/diff_repair.py) is
run on
it as it was compared (its prepared settings), at a fresh init: the fewest layers whose precision, raised one step,
bring its gradient's error under the yardstick. The mode with those rules before its own, `<mode>+repaired`, is then
trained against fp32 again in rounds over the same seeds (advise's comparison of the repaired modes, in what is left
of advise.budget), and the decision weighs it beside the others: it is advised only where it matches fp32 and is
faster (or smaller), as any mode is. What the budget leaves no room for is a note, and the mode stays ruled out with
its reason.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any, Optional

from ampctl import run_files
from ampctl.conf import precision_schedule
from ampctl.conf.composing import compose_job
from ampctl.conf.precision_schema import LayerRule
from ampctl.studies import row_labels
from ampctl.studies.advising.advice import ModeEvidence, Preparation, is_reference
from ampctl.studies.diffing.diff_repair import Repair, own_rules

if TYPE_CHECKING:  # annotations only: advise compares the plans (studies/compare.py)
    from ampctl.studies.compare import ModePlan

DIFF_BATCH_COST = 15.0  # one diff batch, both sides layer by layer, against a training step (benchmarks/diff_cost.py)
REPAIR_SET_COST = 4.0  # one repair set's batch (two forwards and backwards, whole model only) against a step


def worth_repairing(evidence: list[ModeEvidence], goal: str) -> list[ModeEvidence]:
    """The rows the goal would weigh but for their accuracy: measured to differ from fp32, and faster (speed) or with
    a peak below fp32's (memory); of a mode compared several ways (compiled, with another optimizer), its best such
    row (the fastest, or the smallest), once: the repair is the mode's, whatever the way."""
    reference = next((m for m in evidence if is_reference(m.mode)), None)
    fp32_peak = reference.peak_mib if reference is not None else None

    def gains(m: ModeEvidence) -> bool:
        if goal == "speed":
            return m.faster
        return goal == "memory" and m.peak_mib is not None and fp32_peak is not None and m.peak_mib < fp32_peak

    worth = [m for m in evidence if m.parity == "differs" and m.skipped is None and m.failed is None and gains(m)
             and not row_labels.parse(m.mode).repaired]
    best: dict[str, ModeEvidence] = {}
    for m in sorted(worth, key=lambda m: -(m.speedup or 0.0) if goal == "speed" else m.peak_mib):
        best.setdefault(row_labels.parse(m.mode).mode, m)
    return list(best.values())


def repaired_plans(advising: Any, evidence: list[ModeEvidence], plans: list[ModePlan],
                   prepared: dict[str, Preparation]) -> tuple[list[ModePlan], list[ModeEvidence]]:
    """Each mode worth repairing, repaired: the plans `<mode>+repaired` to compare with fp32 again (their
    preparations put into `prepared` under their labels), and the rows of those the repair could not help.
    advising: studies/advising/advise.Advising, which compares the plans."""
    by_label = {p.mode: p for p in plans}
    worth = [m for m in worth_repairing(evidence, advising.cfg.advise.goal.value) if m.mode in by_label]
    repaired, rows = [], []
    for m in worth if any(is_reference(p.mode) for p in plans) else []:
        label, mode = m.mode + row_labels.REPAIRED, row_labels.parse(m.mode).mode
        base = prepared.get(mode, Preparation())
        found = _repair(advising, mode, base)
        if found is None:
            continue
        raised, rules = found
        if not raised:
            rows.append(ModeEvidence(label, skipped="the diff's repair found no set of layers that brings its "
                                                    "gradient's error under the yardstick"))
            continue
        said = ", ".join(f"{r.match} -> {r.run_in}" for r in raised)
        prepared[label] = dataclasses.replace(
            base, rules=rules, summary=f"{base.summary + '; ' if base.summary else ''}repaired: {said}",
            reasons=[*base.reasons, f"repaired by ampctl diff's repair ({said}, precision.rules), as {mode} alone "
                                    f"differs from fp32 ({m.eval_loss_delta:+.4f} held-out loss)"])
        overrides = [*by_label[m.mode].overrides, *Preparation({}, rules).overrides()]
        repaired.append(dataclasses.replace(by_label[m.mode], mode=label, overrides=overrides))
    return repaired, rows


def _repair(advising: Any, mode: str, preparation: Preparation
            ) -> Optional[tuple[list[LayerRule], list[LayerRule]]]:
    """(the layers the repair raised, as rules; every rule the repaired mode runs with: those first, then the mode's
    own as compared); no layers where none brings it under the yardstick; None where the diff does not fit what
    is left of the budget (a note says so)."""
    cfg = compose_job("diff", [*advising.run_overrides, *precision_schedule.row_overrides(mode),
                               *preparation.overrides(),
                               "diff.repair=true"])
    cost_s = advising.step_s * cfg.diff.batches * (DIFF_BATCH_COST + 2 * REPAIR_SET_COST * cfg.diff.repair_layers)
    if cost_s > 0.5 * advising.clock.left():
        advising.notes.append(f"{mode}: differs from fp32; its repair (ampctl diff, ~{cost_s:.0f} s here) did not "
                              f"fit what was left of advise.budget={advising.cfg.advise.budget}: "
                              f"ampctl diff precision={mode} diff.repair=true diff.prove=true tries it")
        return None
    advising.say(f"diff in {mode}: it differs from fp32; the fewest layers to raise (ampctl diff's repair)")
    out_dir = advising.out_dir / f"diff_{precision_schedule.dir_name(mode)}"
    advising.run_diff(cfg, out_dir, [*advising.run_overrides, *precision_schedule.row_overrides(mode),
                                     *preparation.overrides(), "diff.repair=true"])
    repair = json.loads((out_dir / f"{run_files.DIFF}.json").read_text()).get("repair")
    chosen = Repair.of(repair).chosen if repair else None
    raised = chosen.rules if chosen else []
    return raised, [*raised, *own_rules(cfg)]
