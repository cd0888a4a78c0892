"""What `ampctl diff` costs, as a multiple of one training step of the same model in the same mode: each batch of a
diff runs both models forward and backward (each layer's own results taken from them), then every leaf layer's
forward and backward once more (the candidate's on the reference's input); a few steps' worth, not one step per layer.
Measured in one process in alternating rounds (a round: a diff of one batch, then three training steps), so that
the machine's load falls on both alike; prints the median ratio and its quartiles.

    python benchmarks/diff_cost.py                                   # the small GPT, bf16 against fp32
    python benchmarks/diff_cost.py --precision fp8_emulated --rounds 9
    python benchmarks/diff_cost.py --overrides recipe=mlp recipe.hidden=512
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
from hydra import compose, initialize_config_module

from ampctl.analysis.layer_errors import Side, measure
from ampctl.engine.build import build_state
from ampctl.engine.loop import StepSettings, batch_stream, run_steps
from ampctl.recipes.base import build_recipe
from ampctl.runner.plan import check_config
from ampctl.shell.hydra_internals import register_schemas

SMALL_GPT = ["recipe=gpt", "recipe.n_layers=4", "recipe.d_model=128", "recipe.n_heads=4", "recipe.block_size=64",
             "recipe.batch_size=8", "recipe.max_corpus_bytes=300000"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--overrides", nargs="*", default=SMALL_GPT)
    args = parser.parse_args()
    register_schemas()
    with initialize_config_module(config_module="ampctl.conf", version_base=None):
        base = ["device=cpu", "train.console=quiet", *args.overrides]
        reference_cfg = compose(config_name="train", overrides=[*base, "precision=fp32"])
        candidate_cfg = compose(config_name="train", overrides=[*base, f"precision={args.precision}"])
    recipe = build_recipe(candidate_cfg.recipe)
    sides, states = [], []
    for cfg in (reference_cfg, candidate_cfg):
        policy = check_config(cfg)
        with policy:
            state = build_state(cfg, policy, recipe)
        scale = float(state.scaler.current_scale()) if state.scaler.can_skip else 1.0
        sides.append(Side(state.model, lambda policy=policy: policy, policy.forward_context, scale))
        states.append((state, policy))
    train_state, train_policy = build_state(candidate_cfg, states[1][1], recipe), states[1][1]
    batches = batch_stream(recipe, train_policy.device, 0)
    steps = 3
    with train_policy:
        run_steps(train_state, batches, 2, recipe, train_policy, StepSettings())  # warm-up: oneDNN's kernels
    measure(*sides, recipe.loss, list(itertools.islice(batch_stream(recipe, train_policy.device, 1), 1)))
    ratios, diff_s, step_s = [], [], []
    for _ in range(args.rounds):
        one = list(itertools.islice(batch_stream(recipe, train_policy.device, 1), 1))
        start = time.perf_counter()
        measure(*sides, recipe.loss, one)
        diff_s.append(time.perf_counter() - start)
        with train_policy:
            times = run_steps(train_state, batches, steps, recipe, train_policy, StepSettings(), timed=True)
        step_s.append(statistics.median(times) / 1e3)
        ratios.append(diff_s[-1] / step_s[-1])
    layers = sum(1 for _, m in sides[0].model.named_modules() if not list(m.children()))
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    print(f"{args.precision} against fp32, {layers} leaf layers, {torch.get_num_threads()} threads")
    print(f"  one training step: {statistics.median(step_s) * 1e3:.1f} ms; a diff of one batch: "
          f"{statistics.median(diff_s) * 1e3:.1f} ms")
    print(f"  a diff batch = {median:.1f} training steps (quartiles {q1:.1f} .. {q3:.1f}, {args.rounds} rounds)")


if __name__ == "__main__":
    main()
