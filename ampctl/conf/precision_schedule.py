"""precision.schedule: a run that changes its mode or its rules at points of its steps. NVFP4's training recipe
(arXiv 2509.25149) trains its last ~18% of tokens in bf16, which closes most of what remains of its loss gap:
`precision.schedule=[{at: 0.82, precision: bf16}]`.

The run is cut into segments at its changes; each trains on the run's config with the precision node in force (the
named mode's, or the run's own, with the change's rules before the mode's). The run's recorded config keeps its own
precision node and the schedule, so that a resume at any step trains in the segment's mode; the run switches as a
run resumed at the change would (runner/run.py). Conf-level: no torch, no Hydra (the modes' nodes are composed by
the caller, once, into the run's record: `resolved`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf, read_write

from ampctl.conf.precision_schema import LayerRule, PrecisionConfig
from ampctl.errors import UsageError

ARROW = "→"  # in a scheduled run's label: nvfp4_recipe→bf16@0.82
ASCII_ARROW = "->"  # the same, as typed (quoted in a Hydra list: compare.precisions=[fp32,'nvfp4->bf16@0.82'])


@dataclass(frozen=True)
class Segment:
    """The steps after `after` (to the next segment's) train in `mode` (its name) with the precision node `node`."""

    after: int
    mode: str
    node: dict[str, Any]
    point: str = ""  # where it begins as the schedule says it (0.82, 820): '' for the run's first


def _plain(node: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(node, resolve=True, enum_to_str=True)  # type: ignore[return-value]


def change_step(change: Any, steps: int) -> int:
    """The number of steps done before a change holds: its step, or the step nearest its fraction of `steps`."""
    return int(change["step"]) if change.get("step") is not None else round(float(change["at"]) * steps)


def _point(change: Any) -> str:
    return str(change["step"]) if change.get("step") is not None else f"{float(change['at']):g}"


def segments(cfg: DictConfig) -> list[Segment]:
    """The run's segments in order: its own mode from step 0, then one per change (the schedule resolved)."""
    precision = _plain(cfg.precision)
    own = {**precision, "schedule": []}
    found = [Segment(0, own["name"], own)]
    for change in precision.get("schedule") or []:
        if change.get("precision") is not None and change.get("mode") is None:
            raise UsageError(f"precision.schedule: the change to precision={change['precision']} is not resolved "
                             "(its mode's node is composed when the run is planned: plan the run with ampctl's "
                             "commands or the Python API)")
        base = {**change["mode"], "schedule": []} if change.get("mode") is not None else own
        rules = [*(change.get("rules") or []), *(base.get("rules") or [])]
        node = {**base, "rules": rules}
        name = str(node["name"]) + ("+rules" if change.get("rules") else "")
        found.append(Segment(change_step(change, cfg.train.steps), name, node, _point(change)))
    return found


def refuse_a_bad_order(cfg: DictConfig) -> None:
    """Changes in the order of their steps, each with steps of its own, none at or past the end."""
    steps = cfg.train.steps
    before = 0
    for index, segment in enumerate(segments(cfg)[1:]):
        key = f"precision.schedule[{index}]"
        if segment.after >= steps:
            raise UsageError(f"{key}: the change at {segment.point} holds after step {segment.after}, at or past the "
                             f"run's end (train.steps={steps}): no step would train in {segment.mode}; choose a point "
                             f"before the end (at in (0, 1), or step < {steps})")
        if segment.after <= before:
            raise UsageError(f"{key}: the change at {segment.point} (after step {segment.after}) is not after the "
                             f"one before it (after step {before}): list the changes in the order of their steps, "
                             "each with at least one step")
        before = segment.after


def segment_after(cfg: DictConfig, done: int) -> Segment:
    """The segment the step after `done` steps trains in."""
    return [segment for segment in segments(cfg) if segment.after <= done][-1]


def next_change(cfg: DictConfig, done: int) -> Optional[int]:
    """The step after which the next change holds, past `done` steps (none: the run ends in its mode)."""
    return next((segment.after for segment in segments(cfg) if segment.after > done), None)


def config_of(cfg: DictConfig, segment: Segment) -> DictConfig:
    """The run's config (its command's: train's, a study's) with the segment's precision node: what its steps build,
    check and train on."""
    config = copy.deepcopy(cfg)
    with read_write(config):
        config.precision = OmegaConf.merge(OmegaConf.structured(PrecisionConfig), segment.node)
    return config


def label(cfg: DictConfig) -> str:
    """The run's mode as compare's rows and the start line name it: nvfp4_recipe→bf16@0.82."""
    found = segments(cfg)
    return found[0].mode + "".join(f"{ARROW}{s.mode}@{s.point}" for s in found[1:])


def row_label(row: str) -> str:
    """A compare row as typed, in the label's own spelling: nvfp4->bf16@0.82 -> nvfp4→bf16@0.82."""
    return row.replace(ASCII_ARROW, ARROW)


def modes_in(row: str) -> list[str]:
    """The precision modes a row names: `bf16`, or a schedule's `nvfp4→bf16@0.82` -> nvfp4, bf16."""
    first, *changes = row_label(row).split(ARROW)
    return [first, *(change.partition("@")[0] for change in changes)]


def row_overrides(row: str) -> list[str]:
    """The overrides that run a row of compare.precisions: `bf16` -> precision=bf16; `nvfp4→bf16@0.82` ->
    precision=nvfp4 and precision.schedule=[{at: 0.82, precision: bf16}] (a point with a dot is a fraction of
    train.steps, one without a step). UsageError for a change without its point."""
    first, *changes = row_label(row).split(ARROW)
    scheduled = []
    for change in changes:
        mode, _, point = change.partition("@")
        if not mode or not point.replace(".", "", 1).isdigit():
            raise UsageError(f"{row!r}: a scheduled row is MODE{ASCII_ARROW}MODE@POINT (nvfp4_recipe{ASCII_ARROW}"
                             f"bf16@0.82: bf16 from 82% of train.steps on; @820: after step 820)")
        scheduled.append(f"{{{'at' if '.' in point else 'step'}: {point}, precision: {mode}}}")
    return [f"precision={first}", *([f"precision.schedule=[{', '.join(scheduled)}]"] if scheduled else [])]


def dir_name(row: str) -> str:
    """A row's directory name, one a Hydra override can name unquoted (no arrow): nvfp4_then_bf16@0.82."""
    return row_label(row).replace(ARROW, "_then_")


def described(cfg: DictConfig) -> str:
    """The start line's: `precision.schedule: nvfp4_recipe steps 1-82 → bf16 steps 83-100 (at 0.82)`."""
    found = segments(cfg)
    ends = [s.after for s in found[1:]] + [cfg.train.steps]
    parts = [f"{s.mode} steps {s.after + 1}-{end}" + (f" (at {s.point})" if s.point else "")
             for s, end in zip(found, ends)]
    return "precision.schedule: " + f" {ARROW} ".join(parts)


def resolved(cfg: DictConfig, mode_node: Callable[[str], dict[str, Any]]) -> DictConfig:
    """cfg with each change's mode composed (mode_node(name): the precision group's node), once: a change already
    resolved (a resumed run's record) keeps its own."""
    schedule = cfg.precision.get("schedule") or []
    if not any(change.precision is not None and change.mode is None for change in schedule):
        return cfg
    config = copy.deepcopy(cfg)
    with read_write(config):
        for change in config.precision.schedule:
            if change.precision is not None and change.mode is None:
                change.mode = {**mode_node(change.precision), "schedule": []}
    return config


def refuse_a_changed_past(saved: DictConfig, cfg: DictConfig, done: int) -> None:
    """A resumed run may change its schedule after `done` steps only: the segments it trained through are its."""
    def trained(config: DictConfig) -> list[tuple[int, dict[str, Any]]]:
        return [(s.after, s.node) for s in segments(config) if s.after < done]

    if trained(saved) != trained(cfg):
        raise UsageError(f"resume: precision.schedule changes the modes of steps the run trained already (it "
                         f"resumes after step {done}; trained as {label(saved)}, now {label(cfg)}): a resume may "
                         f"change the schedule after step {done} only (changes at step {done} or later; a fraction "
                         "moves with train.steps)")


def as_record(cfg: DictConfig) -> list[dict[str, Any]]:
    """summary.json's: each change, where it holds from and what it trains in."""
    return [{"after_step": s.after, "at": s.point, "precision": s.mode,
             "rules": [LayerRule.of(rule).as_record() for rule in s.node.get("rules") or []]}
            for s in segments(cfg)[1:]]
