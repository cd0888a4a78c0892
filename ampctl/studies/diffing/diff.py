"""`ampctl diff`: the run's precision mode (the candidate) measured against a reference (diff.against, fp32) on the
same weights (a fresh init at train.seed, or a run's checkpoint: diff.weights) and the same diff.batches batches
(analysis/layer_errors.py), layer by layer; its table, files and plot, and `ampctl report`'s rendering of them
again from diff.json."""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from ampctl import io, run_files
from ampctl.analysis.layer_errors import QUANTITIES, LayerErrors, ModelErrors, Side, leaf_layers, measure
from ampctl.analysis.routing import RoutingWatch
from ampctl.conf.composing import compose_job
from ampctl.engine.build import build_state
from ampctl.engine.loop import batch_stream
from ampctl.engine.precision.policy import PrecisionPolicy
from ampctl.errors import UsageError
from ampctl.interrupt import Interrupted, StoppedOnSignal, interrupts_surfaced
from ampctl.recipes.base import build_recipe
from ampctl.reports import plots, tables
from ampctl.reports.progress import Phases, ticking
from ampctl.runner.checkpointing.export import SavedWeights, saved_weights
from ampctl.runner.plan import check_config
from ampctl.studies.diffing.diff_repair import Repair, Tried, own_rules, repair_lines, repaired_config, run_repair
from ampctl.studies.diffing.findings import ModelSummary, Proof, error_cell

TITLE = "error by layer, ranked by the error each adds itself (local)"
# the columns a terminal shows: what ranks a layer, what it inherits, and its share of the gradient's error
SCREEN = ["layer", "out_local", "input_inherited", "dgrad_local", "wgrad_local", "gradient_share"]
HEADERS = {"out_local": "out local", "out_total": "out total", "input_inherited": "input err",
           "dgrad_local": "dgrad local", "dgrad_total": "dgrad total", "grad_inherited": "grad in err",
           "wgrad_local": "wgrad local", "wgrad_total": "wgrad total", "gradient_share": "grad err share",
           "out_cosine": "output cosine", "out_max_abs": "output max abs err"}
# a key of the candidate's own (its mode and what belongs to it) that the reference does not take
_CANDIDATES_OWN = ("precision", "scaler")


# diff.prove's training (studies/diffing/diff_proof.prove): (cfg, out_dir, overrides, repair, started) -> its verdict
Prover = Callable[[DictConfig, Path, list[str], Optional[Repair], float], Proof]


def run_diff(cfg: DictConfig, out_dir: Path, overrides: list[str], prove: Optional[Prover] = None) -> None:
    """The diff, its repair where diff.repair is set, and its proof where a prover is given (the command gives
    studies/diffing/diff_proof.prove where diff.prove is set: a comparison's machinery the diff itself does not
    need)."""
    started = time.monotonic()  # diff.budget's clock
    console = tables.make_console()
    against, candidate = cfg.diff.against, cfg.precision.name
    console.print(f"ampctl diff: precision={candidate} against {against}, "
                  f"{io.count_of(cfg.diff.batches, 'batch')} of recipe={plots.recipe_label(cfg)} -> {out_dir}")
    phase = Phases(console)
    reference_cfg = compose_job("diff", [*(o for o in overrides if not o.lstrip("+~").startswith(_CANDIDATES_OWN)),
                                         f"precision={against}"])
    recipe = build_recipe(cfg.recipe)
    saved = _saved_weights(cfg)
    reference, _ = _side(reference_cfg, recipe, saved)
    cand, policy = _side(cfg, recipe, saved)
    device = policy.device
    at = f"step {saved.step} of {saved.source}" if saved else f"a fresh init at train.seed={cfg.train.seed}"
    phase(f"built the model twice, {against} and {candidate}, at the weights of {at}")
    batches = list(itertools.islice(batch_stream(recipe, device, cfg.train.seed), cfg.diff.batches))
    theirs = dict(cand.model.named_modules())
    compared = sum(name in theirs for name in leaf_layers(reference.model))
    routing = RoutingWatch(reference.model, cand.model)  # a mixture of experts' routers: the tokens they flip
    with ticking(console, len(batches) * compared, "through both, layer by layer") as tick:
        layers, model = measure(
            reference, cand, recipe.loss, batches,
            on_batch=lambda done: phase(f"batch {done}/{len(batches)} through both, layer by layer"),
            on_layer=lambda batch, done, of: tick((batch - 1) * of + done, f"batch {batch}/{len(batches)}, layer "
                                                                           f"{done}/{of}:"),
            routing=routing if routing.flips else None)
    out_dir.mkdir(parents=True, exist_ok=True)
    # the layers converted: a repair that raises them all leaves no format
    summary = ModelSummary.of(model, candidate, against, cfg.diff.noise_share, cand.scale, sorted(policy.converted))
    table = layer_table(layers, model)
    report = DiffReport(table, summary, candidate, against, cfg.diff.noise_share, cfg.diff.top, overrides,
                        tables.machine_info([{"device": device.type}]),
                        f"recipe={plots.recipe_label(cfg)} · {candidate} against {against} · "
                        f"{io.count_of(len(batches), 'batch')}", repairs=cfg.diff.repair, proves=prove is not None,
                        routing=routing.results(),
                        experts={name: [sums.rel_rms if sums.values else None for sums in layer.per_expert]
                                 for name, layer in layers.items() if layer.per_expert})
    if cfg.diff.repair and summary.gradient_noise:
        def measure_candidate(variant: DictConfig) -> ModelErrors:
            return measure(reference, _side(variant, recipe, saved)[0], recipe.loss, batches, per_layer=False)[1]

        if summary.below_the_noise:  # nothing to repair: its config is the run's
            repair = Repair(chosen=Tried([], summary.gradient_error, summary.error_over_noise))
        else:
            ranked = [row["layer"] for row in table.as_dicts() if row["out_local"] or row["dgrad_local"]
                      or row["wgrad_local"]]  # in the table's order: the error each adds itself
            noise = summary.gradient_noise
            repair = _repaired(lambda said: run_repair(cfg, overrides, measure_candidate, ranked, policy.one_step_up,
                                                       noise, said), report, out_dir, console, phase)
            if repair.chosen is not None:
                repair.config = repaired_config(overrides, own_rules(cfg), repair, out_dir)
        report.repair = repair
    report.write(out_dir, console)  # the diff's figures first: a proof that is stopped leaves them whole
    if prove is not None:
        _proved(report, lambda: prove(cfg, out_dir, overrides, repair, started), out_dir, console)


def _repaired(search: Callable[[Callable[[Tried], None]], Repair], report: "DiffReport", out_dir: Path,
              console: Console, phase: Phases) -> Repair:
    """The ranking written, then the repair's search (search(said): run_repair's), each set measured said as it
    ends; stopped by a signal, from the ranking's writing on, the files say how far it got (the ranking stands) and
    the stop goes on."""
    tried: list[Tried] = []

    def said(result: Tried) -> None:
        tried.append(result)
        raised = ", ".join(f"{rule.match} -> {rule.run_in}" for rule in result.rules)
        over = "" if result.error_over_noise is None else f" ({result.error_over_noise:.2g}x the noise)"
        phase(f"repair: set {len(tried)} ({raised}): the gradient's error {result.gradient_error:.1e}{over}")

    try:
        # a signal a library's clean-up turned into an error of its own (interrupts_surfaced) stops it as Ctrl-C does
        with interrupts_surfaced():
            report.write(out_dir, console, files_only=True)  # the ranking first: a repair stopped leaves it whole
            return search(said)
    except (KeyboardInterrupt, Interrupted):
        report.repair = Repair(tried=tried, interrupted=True)
        report.write(out_dir, console, files_only=True)
        raise


def _proved(report: "DiffReport", proof: Callable[[], Proof], out_dir: Path, console: Console) -> None:
    """The proof's verdict into the diff's files and on the screen; stopped by a signal, the files say it was
    (the comparison's runs so far are in proof/, each with the line that continues it)."""
    try:
        report.proof = proof()
    except StoppedOnSignal:
        report.proof = Proof("interrupted", "stopped before its seeds finished; the runs so far are in proof/, each "
                                            "continued by the line compare printed for it", {})
        report.write(out_dir, console, files_only=True)
        raise
    report.write(out_dir, console, files_only=True)
    tables.print_line(console, proof_line(report.proof))


def _saved_weights(cfg: DictConfig) -> Optional[SavedWeights]:
    """diff.weights' checkpoint, refused in one line where its run trained another recipe than this config's."""
    if cfg.diff.weights is None:
        return None
    saved = saved_weights(Path(cfg.diff.weights).expanduser(), "diff.weights")
    ours = OmegaConf.to_container(cfg.recipe, resolve=True)
    differing = sorted(k for k in set(ours) | set(saved.recipe) if ours.get(k) != saved.recipe.get(k))
    if differing:
        theirs = " ".join(f"recipe.{k}={saved.recipe.get(k)}" for k in differing if k != "_target_")
        raise UsageError(f"diff.weights={cfg.diff.weights}: its run trained another recipe ("
                         f"{', '.join(f'recipe.{k}' for k in differing)} differ); give its recipe: "
                         f"recipe._target_={saved.recipe.get('_target_')} {theirs}".rstrip())
    return saved


def _side(cfg: DictConfig, recipe: Any, saved: Optional[SavedWeights]) -> tuple[Side, PrecisionPolicy]:
    """The model of cfg's precision mode at train.seed's weights or the saved ones, as its training would start
    (its loss scale)."""
    policy = check_config(cfg)
    with policy:
        state = build_state(cfg, policy, recipe)
        if saved is not None:  # the run's fp32 weights, in this mode's layout (O2's half copies, FP8's layers)
            loaded = state.model.load_state_dict(saved.state, strict=False)
            params = dict(state.model.named_parameters())
            unloaded = [name for name in loaded.missing_keys if name in params]
            if unloaded:  # a layer this mode renamed: it would keep its fresh init without a word
                raise UsageError(f"diff.weights: precision={cfg.precision.name}'s model names {len(unloaded)} weights "
                                 f"the checkpoint does not hold ({', '.join(unloaded[:3])})")
            if policy.converter is not None:
                policy.converter.weights_changed(state.model)
    scale = float(state.scaler.current_scale()) if state.scaler.can_skip else 1.0
    return Side(state.model, lambda: policy, policy.forward_context, scale), policy


# --- what it found --------------------------------------------------------------------------------------------


def layer_table(layers: dict[str, LayerErrors], model: ModelErrors) -> tables.ReportTable:
    """Every layer, ranked by the error it adds itself."""
    columns = ["rank", "layer", "type", "depth", *(f"{q}_{s}" for q in QUANTITIES for s in ("local", "total")),
               "input_inherited", "grad_inherited", "out_cosine", "out_max_abs", "flushed", "saturated", "nonfinite",
               "gradient_share"]
    depth = {name: i for i, name in enumerate(layers)}
    ranked = sorted(layers.values(), key=lambda layer: -layer.local_error())
    rows = []
    for rank, layer in enumerate(ranked, start=1):
        out = layer.total["out"]
        rows.append([rank, layer.name, layer.kind, depth[layer.name],
                     *(_rel(sums[q]) for q in QUANTITIES for sums in (layer.local, layer.total)),
                     _rel(layer.inherited_input), _rel(layer.inherited_grad), out.cosine, out.max_abs,
                     out.share(out.flushed), out.share(out.saturated), out.share(out.nonfinite),
                     model.by_layer.get(layer.name)])
    return tables.ReportTable(TITLE, columns, rows, headers=HEADERS, formats=FORMATS, screen=SCREEN,
                              screen_note="every column (totals, cosine, flushed, saturated) in report.md and "
                                          "diff.csv")


def _rel(sums: Any) -> Optional[float]:
    return sums.rel_rms if sums.values else None


FORMATS = {**{f"{q}_{s}": error_cell for q in QUANTITIES for s in ("local", "total")},
           "input_inherited": error_cell, "grad_inherited": error_cell, "out_max_abs": error_cell,
           "out_cosine": lambda v: f"{v:.6f}", "flushed": tables.fraction_cell, "saturated": tables.fraction_cell,
           "nonfinite": tables.fraction_cell, "gradient_share": lambda v: f"{v:.0%}"}


@dataclass
class DiffReport:
    """What a diff's directory holds: diff.csv / diff.json / report.md and its plot; diff.json has everything
    `ampctl report` needs to write them again."""

    layers: tables.ReportTable
    summary: ModelSummary
    candidate: str
    against: str
    noise_share: float
    top: int
    overrides: list[str]
    machine: dict
    context: str = ""
    repair: Optional[Repair] = None  # where diff.repair=true
    proof: Optional[Proof] = None  # where diff.prove=true
    repairs: bool = False  # diff.repair and diff.prove as the diff ran: what the next step says
    proves: bool = False
    routing: list[dict] = field(default_factory=list)  # each router's flips (analysis/routing.py), where it has any
    experts: dict[str, list] = field(default_factory=dict)  # grouped experts: each expert's local output error

    def routing_lines(self) -> list[str]:
        """The routers that send the most tokens elsewhere, each in a line (all of them in diff.json)."""
        worst = sorted(self.routing, key=lambda r: -r["flipped"])[:3]
        lines = [f"routing {r['router']}: {r['flipped']:.1%} of {r['tokens']} tokens go to other experts in "
                 f"{self.candidate} ({r['own_flipped']:.1%} by the router alone, on {self.against}'s input); its "
                 f"scores' error {error_cell(r['scores_error'])}" for r in worst]
        if len(self.routing) > len(worst):
            lines.append(f"routing: {len(self.routing) - len(worst)} more routers in diff.json")
        for name, errors in list(self.experts.items())[:3]:
            measured = [(e, error) for e, error in enumerate(errors) if error is not None]
            if measured:
                (best, low), (worst_e, high) = min(measured, key=lambda m: m[1]), max(measured, key=lambda m: m[1])
                lines.append(f"experts {name}: each expert's own output error {error_cell(low)} (expert {best}) to "
                             f"{error_cell(high)} (expert {worst_e}), on {self.against}'s routing")
        return lines

    def write(self, out_dir: Path, console: Console, files_only: bool = False) -> None:
        """diff.csv, diff.json, report.md and the plot, and (unless files_only) the table and its lines."""
        lines = self.summary.lines() + self.routing_lines()
        if self.repair is not None:
            lines += repair_lines(self.repair, self.summary, out_dir)
        if self.proof is not None:
            lines.append(proof_line(self.proof))
        lines += next_step_lines(self.summary, self.repair, self.repairs, self.proves)
        self.layers.notes = lines
        images = [plots.layer_errors(self.layers.as_dicts(), self._allowed(), out_dir / "layer_errors.png",
                                     f"{self.candidate} against {self.against}: error each layer adds", self.context)]
        extra = {"kind": "diff", "context": self.context, "overrides": self.overrides, "candidate": self.candidate,
                 "against": self.against, "noise_share": self.noise_share, "top": self.top,
                 "model": asdict(self.summary), "repair": self.repair.to_json() if self.repair else None,
                 "proof": asdict(self.proof) if self.proof else None, "repairs": self.repairs, "proves": self.proves,
                 "routing": self.routing, "experts": self.experts}
        files = tables.write_files(self.layers, out_dir, run_files.DIFF, self.machine, images, extra)
        if files_only:
            return
        shown = tables.ReportTable(self.layers.title, self.layers.columns, self.layers.rows[:self.top], lines,
                                   self.layers.headers, self.layers.formats, screen=self.layers.screen,
                                   screen_note=f"{len(self.layers.rows)} layers; " + self.layers.screen_note)
        tables.print_table(shown, console)
        console.print(tables.wrote([*files, *images], out_dir))

    def _allowed(self) -> Optional[float]:
        """The gradient error the yardstick allows (diff.noise_share of the noise), drawn on the plot."""
        noise = self.summary.gradient_noise
        return None if noise is None else self.noise_share * noise

    @classmethod
    def read(cls, out_dir: Path) -> "DiffReport":
        data = json.loads((out_dir / f"{run_files.DIFF}.json").read_text())
        if data.get("kind") != "diff":
            raise UsageError(f"{out_dir / run_files.DIFF}.json is not an ampctl diff record")
        rows = data["rows"]
        columns = list(rows[0]) if rows else []
        table = tables.ReportTable(TITLE, columns, [list(r.values()) for r in rows], headers=HEADERS, formats=FORMATS,
                                   screen=SCREEN, screen_note="every column in report.md and diff.csv")
        repair, proof = data.get("repair"), data.get("proof")
        return cls(table, ModelSummary.read(data["model"]), data["candidate"], data["against"], data["noise_share"],
                   data["top"], data.get("overrides", []), data["machine"], data.get("context", ""),
                   Repair.of(repair) if repair else None, Proof(**proof) if proof else None,
                   data.get("repairs", data.get("repair") is not None),
                   data.get("proves", data.get("proof") is not None), data.get("routing", []),
                   data.get("experts", {}))


def next_step_lines(summary: ModelSummary, repair: Optional[Repair], repairs: bool, proves: bool) -> list[str]:
    """What to do next, from what the diff found: one line, the decision first."""
    if summary.error_over_noise is None:
        return ["next: diff.batches=2 or more measures the gradient's noise, the yardstick the error is judged by"]
    if summary.below_the_noise:
        return ["next: nothing at these weights; diff.weights=RUN measures where training has taken them (divergence "
                "often starts late), train.diff.every=N watches it over a run"]
    if repair is None:
        return ["next: diff.repair=true finds the fewest layers to raise where this error matters (and writes the "
                "config that trains them raised)"]
    if repair.interrupted:
        return []
    if repair.chosen is None:
        return ["next: raise diff.repair_layers (more layers tried), choose a higher precision mode, or "
                "diff.prove=true to learn over training whether the error matters"]
    if not proves:
        return ["next: train the repaired config as printed; diff.prove=true trains it beside both modes over seeds "
                "to prove it matches"]
    return []


def proof_line(proof: Proof) -> str:
    return f"proof (proof/, trained from a fresh init over the comparison's seeds): {proof.words}"


def rerender(out_dir: Path, console: Console) -> None:
    """`ampctl report` on a diff directory: the table, files and plot again from diff.json."""
    DiffReport.read(out_dir).write(out_dir, console)
