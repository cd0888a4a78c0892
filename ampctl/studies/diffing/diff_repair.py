"""`ampctl diff diff.repair=true`: the fewest layers whose precision, raised one step, brings the candidate's
gradient error under the yardstick (diff.noise_share of the gradient's batch-to-batch noise), measured, not guessed.

One step up (PrecisionPolicy.one_step_up, as escalation takes it): a layer the mode converts to a format (FP8, MX)
runs `unconverted`, as the rest of the model does; a half one runs in fp32; one in fp32 already is not tried. The
layers are tried in the diff's ranking (the error each adds itself), one more at a time, each set measured again on
the same weights and batches (the whole model's error only: two forwards and backwards a batch), until the error is
under the yardstick or diff.repair_layers layers are raised; then each chosen layer whose removal keeps the error
under it is dropped, so that the set is the fewest that does it in that order. The rules go before the mode's own
(the first rule that matches a layer decides it), which are kept; repaired.yaml is the run's config with them, as
`ampctl train -cd DIR -cn repaired` runs it. Whether the repaired mode then trains as the reference does is decided
by training, not by this measurement (diff.prove, studies/diffing/diff_proof.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf

from ampctl import io
from ampctl.analysis.layer_errors import ModelErrors
from ampctl.conf.composing import compose_job, loadable_config
from ampctl.conf.precision_schema import LayerRule, rules_of
from ampctl.studies.advising.advice import Preparation
from ampctl.studies.diffing.findings import ModelSummary

REPAIRED = "repaired"  # <diff dir>/repaired.yaml


@dataclass
class Tried:
    """One set of raised layers, measured: the whole gradient's error and its ratio to the noise."""

    rules: list[LayerRule]
    gradient_error: float
    error_over_noise: Optional[float]

    def __post_init__(self) -> None:  # from diff.json: the rules as records hold them
        self.rules = [rule if isinstance(rule, LayerRule) else LayerRule.of(rule) for rule in self.rules]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "rules": [rule.as_record() for rule in self.rules]}


@dataclass
class Repair:
    """What the search found: every set it measured, in order, and the one it chose (None: none was enough)."""

    tried: list[Tried] = field(default_factory=list)
    chosen: Optional[Tried] = None
    config: Optional[str] = None  # repaired.yaml's name in the diff's directory
    interrupted: bool = False  # stopped by a signal before it chose (the ranking stands, written first)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tried": [t.to_json() for t in self.tried],
                "chosen": self.chosen.to_json() if self.chosen else None}

    @classmethod
    def of(cls, data: dict[str, Any]) -> "Repair":
        """From to_json()'s dict (diff.json)."""
        chosen = data.get("chosen")
        return cls([Tried(**t) for t in data.get("tried", [])], Tried(**chosen) if chosen else None,
                   data.get("config"), bool(data.get("interrupted")))


def search(ranked: list[str], step_up: Callable[[str], Optional[str]], limit: int, noise_share: float,
           measure_with: Callable[[list[LayerRule]], ModelErrors], noise: float,
           said: Callable[[Tried], None] = lambda tried: None) -> Repair:
    """The fewest layers of `ranked` (tried in its order, at most `limit`, those that can go up: step_up(layer) is
    what a layer runs in one step up, None where it cannot) whose raised precision brings the gradient's error under
    noise_share of the noise; measure_with(rules) measures the candidate with those rules before its own;
    said(tried) after each set is measured (the repair's progress)."""
    repair = Repair()
    ranked = [name for name in ranked if step_up(name) is not None]

    def tried(layers: list[str]) -> Tried:
        rules = [LayerRule.for_layer(name, step_up(name)) for name in layers]
        error = measure_with(rules).gradient.rel_rms
        result = Tried(rules, error, error / noise if noise else None)
        repair.tried.append(result)
        said(result)
        return result

    def enough(result: Tried) -> bool:
        return result.error_over_noise is not None and result.error_over_noise <= noise_share

    chosen: list[str] = []
    for name in ranked[:limit]:
        chosen.append(name)
        if enough(last := tried(chosen)):
            break
    else:
        return repair
    for name in list(chosen[:-1]):  # the last one added was needed; each earlier one only if it still is
        fewer = [n for n in chosen if n != name]
        if enough(result := tried(fewer)):
            chosen, last = fewer, result
    repair.chosen = last
    return repair


def repaired_config(overrides: list[str], own_rules: list[LayerRule], repair: Repair, out_dir: Path) -> str:
    """repaired.yaml: the run's config with the repair's rules before the mode's own; returns its name."""
    rules = [*repair.chosen.rules, *own_rules] if repair.chosen else own_rules
    trains = [o for o in overrides if not o.lstrip("+~").startswith(("diff.", "compare."))]  # train has neither
    job = compose_job("train", [*trains, *Preparation({}, rules).overrides()], with_hydra=True)
    path = out_dir / f"{REPAIRED}.yaml"
    io.atomic_write_text(path, loadable_config("train", job))
    return path.name


def own_rules(cfg: DictConfig) -> list[LayerRule]:
    """The mode's rules as the config has them (its defaults included)."""
    return rules_of(OmegaConf.to_container(cfg.precision, resolve=True, enum_to_str=True))


def repair_lines(repair: Repair, summary: ModelSummary, out_dir: Path) -> list[str]:
    """What the repair found, in words."""
    before = summary.error_over_noise
    if repair.interrupted:
        return [f"repair: stopped by a signal after {io.count_of(len(repair.tried), 'set')} of layers measured, before "
                "it chose; the ranking stands (diff.repair=true again searches from the start)"]
    if repair.chosen is None:
        return [f"repair: raising the {len(repair.tried)} layers ranked first, one more at a time, did not bring the "
                f"gradient's error under the yardstick (its best: {min(t.gradient_error for t in repair.tried):.1e}"
                f"); the error is not a few layers': see the ranking"]
    if not repair.chosen.rules:
        return ["repair: nothing to repair: the gradient's error is already under the yardstick"]
    rules = ", ".join(f"{r.match} -> {r.run_in}" for r in repair.chosen.rules)
    n = len(repair.chosen.rules)
    converted = set(summary.converted_layers)
    if converted and converted <= {r.match for r in repair.chosen.rules}:
        rules += "; every layer the mode converts: what is left is the mode without its format"
    lines = [f"repair: {io.count_of(n, 'layer')} raised ({rules}) {'brings' if n == 1 else 'bring'} the gradient's "
             f"error from {summary.gradient_error:.1e} ({before:.2g}x the noise) to "
             f"{repair.chosen.gradient_error:.1e} ({repair.chosen.error_over_noise:.2g}x); "
             f"{io.count_of(len(repair.tried), 'set')} of layers measured"]
    if repair.config:
        lines += ["the repaired config trains with:", f"ampctl train -cd {out_dir} -cn {Path(repair.config).stem}"]
    return lines


def run_repair(cfg: DictConfig, overrides: list[str], measure_candidate: Callable[[DictConfig], ModelErrors],
               ranked: list[str], step_up: Callable[[str], Optional[str]], noise: float,
               said: Callable[[Tried], None] = lambda tried: None) -> Repair:
    """The search with the candidate composed again for each set of rules; measure_candidate(config): its whole
    model's errors against the reference on the diff's weights and batches; said(tried): after each set."""
    own = own_rules(cfg)

    def measure_with(rules: list[LayerRule]) -> ModelErrors:
        return measure_candidate(compose_job("diff", [*overrides, *Preparation({}, [*rules, *own]).overrides()]))

    return search(ranked, step_up, cfg.diff.repair_layers, cfg.diff.noise_share, measure_with, noise, said)
