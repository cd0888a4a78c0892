"""A training run in the test's own process: the configs the tests compose (QUIET, FAST), a composed config, a run
(train_here) and the parts to drive a step by hand (build)."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

from hydra import compose, initialize_config_module

from ampctl.runner.plan import plan_run
from ampctl.runner.run import run_training

# device=cpu: tests are CPU tests unless marked gpu, also on a machine that has a GPU.
# telemetry.profile_cpu_memory=false: the CPU memory profiler leaves steps 1-2 untimed; the tests of peak memory
# turn it on
QUIET = ["device=cpu", "train.console=quiet", "train.log_every=5", "train.lr.warmup_steps=0",
         "telemetry.profile_cpu_memory=false"]
# A small, fast workload: every precision mode trains it in about a second on 2 CPU cores.
FAST = ["recipe=mlp", "recipe.hidden=64", "recipe.batch_size=32", *QUIET]


def compose_cfg(*overrides: str):
    """The train config with these overrides (a fresh copy: tests may change it)."""
    return copy.deepcopy(_composed(overrides))


@functools.lru_cache(maxsize=None)
def _composed(overrides: tuple[str, ...]):
    # Hydra takes ~0.2 s a composition here; many tests compose the same configs
    with initialize_config_module(config_module="ampctl.conf", version_base=None):
        return compose(config_name="train", overrides=list(overrides))


def train_here(tmp_path: Path, *overrides: str, base: list[str] = FAST) -> tuple[dict, list[dict]]:
    """ampctl's training run in this process (plan_run, run_training); returns (summary, metrics rows)."""
    cfg = compose_cfg(*base, *overrides)
    summary = run_training(plan_run(cfg, tmp_path), echo=lambda _msg: None)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def build(*overrides: str, base: list[str] = FAST):
    """(cfg, policy, recipe) for driving train_step by hand; use `with policy:` around the steps."""
    from ampctl.recipes.base import build_recipe
    from ampctl.runner.plan import check_config

    cfg = compose_cfg(*base, *overrides)
    return cfg, check_config(cfg), build_recipe(cfg.recipe)
