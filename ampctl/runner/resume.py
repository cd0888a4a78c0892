"""Where a run resumes, and with which config.

A resumed run is the run it continues: its config is the one saved in the checkpoint, and the command line
may change only what is safe to change (identity.SAFE_TO_CHANGE). A key the command line names (a value
`train.steps=400`, a group `precision=fp16`) is compared with the saved run's; a key it does not name is
the saved run's, whatever the defaults say. So `ampctl train resume=runs/x` continues runs/x as it was,
and `ampctl train precision=bf16 resume=runs/x` on an fp16 run is refused, naming precision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from ampctl.conf.precision_schema import LayerRule
from ampctl.conf.train_schema import Schedule
from ampctl.conf.typed import as_recorded_now, typed_config
from ampctl.engine.optim import lr_factor
from ampctl.runner import identity
from ampctl.runner.checkpointing import checkpoint, checkpoint_files
from ampctl.runner.guarding import escalation_rules

if TYPE_CHECKING:  # annotations only: the state's class is the engine's
    from ampctl.engine.loop import TrainState


def named_keys(overrides: list[str]) -> list[str]:
    """The config keys a command line names: `train.steps=5` names train.steps, `precision=fp16` the whole
    precision node. Hydra's own (hydra.*) are not the run's."""
    keys = []
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group.replace("/", ".")
        if key != "hydra" and not key.startswith("hydra."):
            keys.append(key)
    return keys


def _named(key: str, names: list[str]) -> bool:
    return any(key == name or key.startswith(name + ".") for name in names)


def plan(cfg: DictConfig, choices: dict[str, str], overrides: list[str], run_dir: Path,
         world_size: int = 1) -> tuple[DictConfig, dict[str, str], "Resume"]:
    """The run that cfg.resume continues, resolved once: its config and group choices (the checkpoint's, or for
    resume=auto before the run's first checkpoint, the one its identity.json was started with), with the keys
    the command line names taken from cfg, and where it starts (the checkpoint, checked and loaded here). A named
    key that may not change and differs is refused (UsageError). cfg as it is, from step 0, when there is
    nothing to resume (resume=auto into a new directory)."""
    found = checkpoint.resolve_resume(cfg.resume, run_dir) if cfg.resume else None
    own = identity.read(run_dir) if found is None and cfg.resume == "auto" else None
    if found is None and own is None:
        return cfg, choices, Resume(run_dir)
    saved_config, saved_choices = (found.config, found.choices) if found is not None else (own.config, own.choices)
    escalated = _escalation_rules(found, run_dir)
    saved_config = escalation_rules.with_rules(as_recorded_now(saved_config), escalated)
    names = named_keys(overrides)
    resumed = OmegaConf.create(saved_config)
    for name in names:
        value = OmegaConf.select(cfg, name, default=None)
        OmegaConf.update(resumed, name, value, merge=False, force_add=True)
    # a named precision node (a requeued job's command line names its mode again) keeps the run's escalations too
    resumed = typed_config(OmegaConf.create(escalation_rules.with_rules(_resolved(resumed), escalated)))
    checkpoint.config_changes(saved_config, resumed)  # raises on an unsafe change
    resumed_choices = {**saved_choices, **{g: c for g, c in choices.items() if _named(g, names)}}
    return resumed, resumed_choices, Resume.of(found, resumed, run_dir, world_size)


@dataclass
class Resume:
    """Where a run starts: from nothing, or from a checkpoint (whose run directory it continues)."""

    run_dir: Path
    source: Optional[Path] = None
    payload: Optional[dict[str, Any]] = None
    changes: list[str] = field(default_factory=list)  # config keys that differ from the checkpoint's
    passed_over: list[str] = field(default_factory=list)  # newer checkpoints that failed their check

    @classmethod
    def find(cls, cfg: DictConfig, run_dir: Path, world_size: int = 1) -> tuple[DictConfig, "Resume"]:
        """For a config that plan() did not resolve (a run started from Python with its config as it is): the
        config with the run's escalation rules where it continues an escalated run, and where it starts."""
        found = checkpoint.resolve_resume(cfg.resume, run_dir) if cfg.resume else None
        escalated = _escalation_rules(found, run_dir)
        if escalated:
            cfg = typed_config(OmegaConf.create(escalation_rules.with_rules(_resolved(cfg), escalated)))
        return cfg, cls.of(found, cfg, run_dir, world_size)

    @classmethod
    def of(cls, found: Optional[checkpoint.Found], cfg: DictConfig, run_dir: Path, world_size: int) -> "Resume":
        if found is None:
            return cls(run_dir)
        payload = found.payload
        changes = (checkpoint.config_changes(payload["config"], cfg) + _schedule_change(payload, cfg)
                   + _world_size_change(payload, cfg, world_size))
        return cls(checkpoint_files.run_dir_of(found.path), found.path, payload, changes, found.passed_over)

    def restore(self, state: TrainState) -> None:
        if self.payload:
            checkpoint.restore(self.payload, state, self.source)

    def saved_config(self) -> DictConfig:
        """The checkpoint's config, typed (as recorded then, in today's schema)."""
        assert self.payload is not None
        return typed_config(OmegaConf.create(as_recorded_now(self.payload["config"])))

    @property
    def step(self) -> Optional[int]:
        return self.payload["step"] if self.payload else None

    @property
    def skipped_total(self) -> int:
        return self.payload["skipped_total"] if self.payload else 0


def _escalation_rules(found: Optional[checkpoint.Found], run_dir: Path) -> list[LayerRule]:
    """The rules guard.on_trip=escalate scheduled for the run from the step it resumes at
    (runner/guarding/escalation.py),
    put into the checkpoint's config too: one written before the escalation it went back to lacks them."""
    step, where = (found.payload["step"], checkpoint_files.run_dir_of(found.path)) if found else (0, run_dir)
    rules = escalation_rules.resume_rules(where, step)
    if found is not None and rules:
        found.payload["config"] = escalation_rules.with_rules(found.payload["config"], rules)
    return rules


def _resolved(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]


def _world_size_change(payload: dict[str, Any], cfg: DictConfig, world_size: int) -> list[str]:
    """Either checkpoint format loads on any number of ranks (a sharded one resharded); what changes is the global
    batch (recipe.batch_size per rank x grad_accum_steps x ranks), said rather than discovered."""
    old = payload.get("world_size", 1)
    if old == world_size:
        return []
    per_rank = cfg.recipe.get("batch_size")
    batch = (f"; global batch {per_rank * cfg.train.grad_accum_steps * old} -> "
             f"{per_rank * cfg.train.grad_accum_steps * world_size} samples per step"
             if isinstance(per_rank, int) else "")
    return [f"world size: {old} -> {world_size} ranks{batch}"]


def _schedule_change(payload: dict[str, Any], cfg: DictConfig) -> list[str]:
    """A changed train.steps moves the end of the lr schedule (it decays over train.steps): the lr of the
    next step, before and after, so that a jump is seen and not discovered in a plot."""
    old_steps, train = payload["config"]["train"]["steps"], cfg.train
    if old_steps == train.steps or train.lr.schedule is Schedule.constant:
        return []
    applied = torch.tensor(float(payload["schedule"]["applied"]), dtype=torch.float64)

    def lr(total: int) -> float:
        factor = lr_factor(applied, train.lr.schedule, train.lr.warmup_steps, total, train.lr.min_ratio)
        return float(factor) * payload["schedule"]["base_lrs"][0]

    said = f"lr schedule: {train.lr.schedule.value} decay now ends at step {train.steps} (was {old_steps})"
    before, after = lr(old_steps), lr(train.steps)
    return [said + (f"; lr of the next step {before:.4g} -> {after:.4g}" if before != after else "")]

