"""One probe of `ampctl memory`'s batch search, in a process of its own, so that nothing an earlier probe
or measurement left in the caching allocator (cached blocks, fragmentation, a failed step's tensors) can
decide whether this batch fits.

    python -m ampctl.studies.memory_probe BATCH_SIZE [--config-dir DIR] [overrides ...]

Builds the run of `ampctl train <overrides> recipe.batch_size=BATCH_SIZE` (a row of `ampctl memory`), takes two
training steps and prints one JSON line: {"peak": bytes} or {"out_of_memory": true}.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Optional

import torch
from hydra import compose, initialize_config_module

PROBE_STEPS = 2  # the second step is the first with the optimizer's states already allocated


def main(argv: Optional[list[str]] = None) -> None:
    from ampctl.processes import die_with_parent

    die_with_parent()
    from ampctl.analysis.memory.measure import measure_peak
    from ampctl.conf.schema import register_configs
    from ampctl.engine.build import build_state
    from ampctl.engine.loop import StepSettings, batch_stream, run_steps
    from ampctl.recipes.base import build_recipe
    from ampctl.runner.plan import check_config

    parser = argparse.ArgumentParser(prog="python -m ampctl.studies.memory_probe")
    parser.add_argument("batch_size", type=int)
    parser.add_argument("--config-dir")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    overrides = [*args.overrides, f"recipe.batch_size={args.batch_size}"]
    if args.config_dir:
        overrides.append(f"hydra.searchpath=[file://{os.path.abspath(args.config_dir)}]")
    register_configs()  # train's: a row's overrides are its run's (memory study's own keys left out)
    with initialize_config_module(config_module="ampctl.conf", version_base=None):
        cfg = compose(config_name="train", overrides=overrides)
    policy = check_config(cfg)
    recipe = build_recipe(cfg.recipe)
    try:
        with policy, measure_peak(policy.device) as peak:
            state = build_state(cfg, policy, recipe)
            run_steps(state, batch_stream(recipe, policy.device, cfg.train.seed), PROBE_STEPS, recipe, policy,
                      StepSettings.of(cfg.train))
    except torch.cuda.OutOfMemoryError:
        print(json.dumps({"out_of_memory": True}), flush=True)
        return
    print(json.dumps({"peak": peak.bytes}), flush=True)


if __name__ == "__main__":
    main()
