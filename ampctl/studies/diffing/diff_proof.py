"""`ampctl diff diff.prove=true`: whether the repaired mode trains as the reference does, decided by training, not
by the diff's measurement at one set of weights. The reference, the candidate and the repaired candidate are
trained side by side from a fresh init over compare.seeds seeds (ampctl compare's rounds, held-out evaluation and
seed parity: studies/compare.py), within diff.budget; the repair is claimed to restore the reference's accuracy
only where the repaired mode's held-out loss matches the reference's and the candidate's alone does not. What the
seeds do not decide, or the budget cut short, is said as such."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from ampctl import run_files
from ampctl.conf.composing import compose_job
from ampctl.conf.value_checks import budget_seconds
from ampctl.runner.plan import check_config
from ampctl.studies.advising.advice import Preparation
from ampctl.studies.compare import CompareInterrupted, ModePlan, run_compare
from ampctl.studies.diffing.diff_repair import Repair, own_rules
from ampctl.studies.diffing.findings import Proof

PROOF_DIR = "proof"  # <diff dir>/proof/: the comparison, one training run per mode and seed
REPAIRED_SUFFIX = "_repaired"
_CANDIDATES_OWN = ("precision", "scaler")
_NOT_FOR_TRAINING = ("diff.", "compare.")


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def plans(cfg: DictConfig, overrides: list[str], repair: Optional[Repair]) -> list[ModePlan]:
    """The reference, the candidate (its own precision and scaler settings) and, where the repair raised layers,
    the candidate with the repair's rules before its own."""
    common = [o for o in overrides if not _key(o).startswith((*_CANDIDATES_OWN, *_NOT_FOR_TRAINING))
              and _key(o) != "train.seed"]  # each run's seed is the comparison's (compare.seeds)
    own = [o for o in overrides if _key(o).startswith(_CANDIDATES_OWN) and _key(o) != "precision"]
    candidate, against = cfg.precision.name, cfg.diff.against
    rows = [(against, [f"precision={against}", *common]), (candidate, [f"precision={candidate}", *own, *common])]
    if repair is not None and repair.chosen is not None and repair.chosen.rules:
        rules = Preparation({}, [*repair.chosen.rules, *own_rules(cfg)]).overrides()
        rows.append((candidate + REPAIRED_SUFFIX, [f"precision={candidate}", *own, *common, *rules]))
    planned = []
    for label, row in rows:
        policy = check_config(compose_job("train", row))
        half = str(policy.dtype).removeprefix("torch.") if policy.uses_half else None
        planned.append(ModePlan(label, row, cfg.train.steps, policy.device.type, half))
    return planned


def prove(cfg: DictConfig, out_dir: Path, overrides: list[str], repair: Optional[Repair], started: float,
          config_dir: Optional[str] = None) -> Proof:
    """The comparison in <out_dir>/proof within what is left of diff.budget (started: time.monotonic() at the
    diff's start), and its verdict."""
    deadline = started + (budget_seconds(cfg.diff.budget) or 0.0)
    partial = False
    try:
        run_compare(cfg, out_dir / PROOF_DIR, overrides, config_dir, planned=(plans(cfg, overrides, repair), {}),
                    deadline=deadline)
    except CompareInterrupted as exc:
        if not exc.out_of_time:
            raise  # a stop signal: the study says it (what was measured is in proof/)
        partial = True
    rows = {row["precision"]: row for row in
            json.loads((out_dir / PROOF_DIR / f"{run_files.COMPARISON}.json").read_text())["rows"]}
    return verdict(cfg.precision.name, cfg.diff.against, {m: r.get("parity") for m, r in rows.items()}, partial)


def verdict(candidate: str, against: str, parity: dict[str, Optional[str]], partial: bool) -> Proof:
    """What the seeds decided: the repair proved where the repaired mode matches the reference and the candidate
    alone does not."""
    repaired = candidate + REPAIRED_SUFFIX
    alone, fixed = parity.get(candidate), parity.get(repaired)
    cut = " (diff.budget ran out: the seeds trained until then)" if partial else ""
    if partial and alone is None and fixed is None:
        return Proof("partial", "diff.budget ran out before the runs reached their held-out evaluation: nothing "
                                "decided; a longer diff.budget or fewer train.steps", parity)
    if repaired not in parity:
        words = f"{candidate} alone: {alone or 'not trained'} against {against}'s held-out loss{cut}"
        return Proof("not needed" if alone == "matches" else "not decided", words, parity)
    if fixed == "matches" and alone == "differs":
        return Proof("proved", f"{repaired} matches {against}'s held-out loss and {candidate} alone differs: the "
                               f"repair restores what {candidate} lost{cut}", parity)
    if fixed == "matches" and alone == "matches":
        return Proof("not needed", f"{candidate} alone already matches {against}'s held-out loss at this length "
                                   f"of training; the repair is not needed for it{cut}", parity)
    if fixed == "matches":
        return Proof("repaired matches", f"{repaired} matches {against}'s held-out loss; whether {candidate} alone "
                                         f"does is not decided by these seeds{cut}", parity)
    if fixed == "differs":
        return Proof("not proved", f"{repaired} differs from {against}'s held-out loss: the repair is not "
                                   f"enough{cut}", parity)
    return Proof("partial" if partial else "not decided",
                 f"{repaired}: {fixed or 'not trained'} against {against}'s held-out loss, {candidate} alone: "
                 f"{alone or 'not trained'}: not decided by these seeds (more seeds or steps, a longer "
                 f"diff.budget){cut}", parity)
