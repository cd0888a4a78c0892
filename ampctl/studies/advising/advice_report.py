"""What `ampctl advise` writes from its advice: advice.json (the advice and its evidence), advice.md with its plot,
the config that runs the advice, and its lines on the console and in advise.log; `ampctl report` writes them again
from advice.json."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from ampctl import io, run_files
from ampctl.conf.composing import compose_job, loadable_config
from ampctl.reports import tables
from ampctl.studies.advising.advice import Advice, GradientEvidence, ModeEvidence

EVIDENCE_DIRS = ("calibration", "inspect", "compare")  # what the advice cites, where it exists
log = logging.getLogger("ampctl.studies.advising.advise")  # advise.log (Hydra's job logging)


@dataclass
class Findings:
    """The advice with what it stands on: each mode's evidence, the fp32 inspection's gradients, the machine and
    the model (facts), and why it is partial where it is."""

    advice: Advice
    evidence: list[ModeEvidence]
    gradients: Optional[GradientEvidence]
    facts: dict[str, str]
    partial: Optional[str] = None


def write_advice(out_dir: Path, cfg: DictConfig, findings: Findings, run_overrides: list[str], console: Any) -> None:
    """advice.json (the advice and its evidence), advice.md, and the experiment config that runs the advice."""
    advice, evidence, gradients, facts, partial = (findings.advice, findings.evidence, findings.gradients,
                                                   findings.facts, findings.partial)
    config = out_dir / f"{cfg.advise.name}.yaml"
    job = compose_job("train", [*run_overrides, *advice.overrides()], with_hydra=True)
    io.atomic_write_text(config, loadable_config("train", job))
    record = {"kind": "advise", "advice": advice.to_json(), "partial": partial,
              "evidence": [vars(e) for e in evidence],
              "gradients": None if gradients is None else vars(gradients),
              "overrides": run_overrides, "config": config.name, "facts": facts}
    io.write_json(out_dir / f"{run_files.ADVICE}.json", record)
    say_advice(out_dir, advice, evidence, partial, config, console, facts)


def say_advice(out_dir: Path, advice: Advice, evidence: list[ModeEvidence], partial: Optional[str], config: Path,
               console: Any, facts: dict[str, str]) -> None:
    """advice.md (the machine and the model, then the advice, with its plot where modes were compared), and the
    advice's lines on the console (which said the machine and the model as it measured them)."""
    image = speed_plot(out_dir, advice, evidence)
    lines = advice_lines(advice, partial, config, out_dir)
    header = "".join(f"{what}: {text}\n\n" for what, text in facts.items())
    io.atomic_write_text(out_dir / f"{run_files.ADVICE}.md", "# ampctl advise\n\n" + header + "\n".join(
        f"- {line}" if i else line for i, line in enumerate(lines)) + "\n"
        + (f"\n![{image.stem}]({image.name})\n" if image is not None else ""))
    for line in lines:
        tables.print_line(console, line)
        log.info(line)


def speed_plot(out_dir: Path, advice: Advice, evidence: list[ModeEvidence]) -> Optional[Path]:
    from ampctl.reports import plots

    points = [{"mode": e.mode, "speedup": e.speedup, "speedup_low": e.speedup_low, "speedup_high": e.speedup_high,
               "delta": e.eval_loss_delta, "delta_interval": e.eval_loss_delta_interval}
              for e in evidence if e.speedup is not None and e.skipped is None and e.failed is None]
    if len(points) < 2:
        return None
    return plots.speed_and_accuracy(points, advice.mode, out_dir / "advice.png",
                                    f"ampctl advise (goal={advice.goal}): {' '.join(advice.overrides())}")


def rerender(out_dir: Path, console: Any) -> None:
    """`ampctl report` on an advice's directory: advice.md, its plot and its lines again, from advice.json."""
    record = json.loads((out_dir / f"{run_files.ADVICE}.json").read_text())
    evidence = [ModeEvidence(**e) for e in record["evidence"]]
    say_advice(out_dir, Advice(**record["advice"]), evidence, record.get("partial"), out_dir / record["config"],
               console, record.get("facts", {}))


def advice_lines(advice: Advice, partial: Optional[str], config: Path, out_dir: Path) -> list[str]:
    lines = [f"advice (goal={advice.goal}): precision={advice.precision}"
             + (f" with {' '.join(advice.overrides()[1:])}" if len(advice.overrides()) > 1 else "")]
    if partial:
        lines.append(f"partial: {partial}")
    lines += [f"why: {reason}" for reason in advice.reasons]
    modes_of: dict[str, list[str]] = {}  # each reason once, with every mode it rules out (fp16 and O2 share one)
    for mode, why in advice.rejected.items():
        modes_of.setdefault(why, []).append(mode)
    lines += [f"not {', '.join(modes)}: {why}" for why, modes in modes_of.items()]
    lines += [f"note: {note}" for note in advice.notes]
    evidence = [name + "/" for name in EVIDENCE_DIRS if (out_dir / name).is_dir()] + sorted(
        p.name + "/" for p in out_dir.glob("inspect_*") if p.is_dir()) + [
        name for name in (f"{run_files.ADVICE}.json", "advice.png") if (out_dir / name).is_file()]
    lines += [f"run it (the evidence: {', '.join(evidence)}):", f"ampctl train -cd {out_dir} -cn {config.stem}"]
    return lines
