"""Overhead of ampctl's training step against a minimal hand-written torch.amp loop.

Both loops train the same model (same init, same batches) under the same autocast dtype and scaler; they
run in one process, alternating in rounds, so that machine noise falls on both alike. ampctl's step does
what the hand loop does plus its telemetry (grad norm, per-step record on the device, read back every
log_every steps) and its on-device lr schedule. Both clip the gradient norm to 1.0 (ampctl's default; the
hand loop unscales then clips, as the torch.amp docs show), or neither with --clip none, in which case
ampctl still computes the norm it records. Prints medians and the ratio.

    python benchmarks/loop_overhead.py                       # gpt recipe, bf16; clipping on in both loops
    python benchmarks/loop_overhead.py --recipe mlp --precisions bf16,fp16 --clip none
    python benchmarks/loop_overhead.py --precisions fp32 --compile   # both loops compiled, block by block
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from hydra import compose, initialize_config_module

from ampctl.conf.schema import register_configs
from ampctl.engine.build import build_state
from ampctl.engine.loop import StepSettings, batch_stream, train_step
from ampctl.engine.telemetry import Telemetry
from ampctl.recipes.base import build_recipe
from ampctl.runner.plan import check_config

RECIPES = {
    # step time dominated by matmuls, small enough for a 2-core CPU
    "gpt": ["recipe=gpt", "recipe.d_model=256", "recipe.n_layers=2", "recipe.block_size=128", "recipe.batch_size=8",
            "recipe.max_corpus_bytes=2000000"],
    # a narrow GPT (d_model 64): elementwise work and per-op overhead are a large share of its step, which is
    # what compilation removes
    "gpt64": ["recipe=gpt", "recipe.d_model=64", "recipe.n_layers=4", "recipe.block_size=128", "recipe.batch_size=16",
              "recipe.max_corpus_bytes=2000000"],
    # the d_model 768 GPT of the README's bf16-vs-fp32 comparison (about a second a step on 2 CPU cores)
    "gpt768": ["recipe=gpt", "recipe.d_model=768", "recipe.n_heads=12", "recipe.n_layers=4", "recipe.block_size=256",
               "recipe.batch_size=8", "recipe.max_corpus_bytes=2000000"],
    # GPT-2 small's shape, for GPUs
    "gpt2": ["recipe=gpt2", "recipe.max_corpus_bytes=2000000"],
    # small enough that fp16 (emulated on CPUs without fp16 hardware) still takes ~20 ms a step
    "mlp": ["recipe=mlp", "recipe.hidden=256", "recipe.batch_size=128"],
    # almost no compute: the step is the loop's own host work, so the difference of two loops is their
    # overhead in microseconds, which divided by a real recipe's step time is its overhead there
    "tiny": ["recipe=mlp", "recipe.in_features=16", "recipe.hidden=16", "recipe.depth=1", "recipe.num_classes=4",
             "recipe.batch_size=8", "recipe.norm=none"],
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class AmpctlLoop:
    def __init__(self, overrides: list[str]) -> None:
        cfg = compose(config_name="train", overrides=overrides)
        self.policy = check_config(cfg)
        self.recipe = build_recipe(cfg.recipe)
        self.policy.__enter__()
        self.state = build_state(cfg, self.policy, self.recipe)
        self.batches = batch_stream(self.recipe, self.policy.device, cfg.train.seed)  # as fit() draws them
        self.clip = cfg.train.clip_grad_norm
        self.telemetry = Telemetry(self.policy.device, cfg.train.log_every, self.recipe.samples_per_batch, None, [])

    def step(self) -> None:
        train_step(self.state, self.batches, self.recipe, self.policy, StepSettings(1, self.clip), self.telemetry)
        data_s, idle_s = self.batches.take_wait_s()
        self.telemetry.end_step(last=False, data_s=data_s, data_idle_s=idle_s)


class HandWrittenLoop:
    """The torch.amp docs' loop: autocast forward, scaled backward, scaler.step, scaler.update."""

    def __init__(self, reference: AmpctlLoop, dtype: torch.dtype | None, scaled: bool, clip: float | None,
                 compiled: bool) -> None:
        device = reference.policy.device
        torch.manual_seed(0)
        self.model = reference.recipe.build_model().to(device)
        if compiled:  # the regions ampctl compiles: each block the recipe names, else the whole model
            for region in getattr(reference.recipe, "activation_checkpoint_blocks", lambda m: [])(self.model) or [
                    self.model]:
                region.compile()
        self.recipe, self.device, self.dtype = reference.recipe, device, dtype
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                                           fused=True)
        self.scaler = torch.amp.GradScaler(device.type, enabled=scaled)
        self.batches = self.recipe.batches(device, 0)
        self.clip = clip

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None):
            loss = self.recipe.loss(self.model, next(self.batches))
        self.scaler.scale(loss).backward()
        if self.clip is not None:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip, foreach=True)
        self.scaler.step(self.optimizer)
        self.scaler.update()


def timed_steps(loop, steps: int, device: torch.device) -> list[float]:
    sync(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loop.step()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def rotating_rounds(loops: list, rounds: int, steps: int, device: torch.device) -> list[list[float]]:
    """Per loop, its median step time (ms) in each round. Every round times `steps` steps of each loop, the order
    rotating from round to round, so that machine noise falls on all alike and no loop always runs right after
    the same other."""
    medians: list[list[float]] = [[] for _ in loops]
    for round_index in range(rounds):
        for k in range(len(loops)):
            i = (round_index + k) % len(loops)
            medians[i].append(statistics.median(timed_steps(loops[i], steps, device)))
    return medians


def alternating_rounds(a, b, rounds: int, steps: int, device: torch.device) -> tuple[list, list, list]:
    """a's and b's median step time in each round, and each round's ratio of them (a / b): the ratio compares
    neighbours in time, so slow phases of a noisy machine cancel out."""
    a_ms, b_ms = rotating_rounds([a, b], rounds, steps, device)
    return a_ms, b_ms, [x / y for x, y in zip(a_ms, b_ms)]


def add_workload_arguments(parser: argparse.ArgumentParser, recipe: str, precisions: str, rounds: int,
                           steps_per_round: int) -> None:
    """The options every benchmark here shares: what to run, where, and how many rounds of how many steps."""
    parser.add_argument("--recipe", choices=sorted(RECIPES), default=recipe)
    parser.add_argument("--precisions", default=precisions)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--steps-per-round", type=int, default=steps_per_round)
    parser.add_argument("--warmup-steps", type=int, default=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # many short rounds: the two loops' steps interleave closely, so that drifts of a noisy machine fall on both
    add_workload_arguments(parser, recipe="gpt", precisions="bf16", rounds=100, steps_per_round=2)
    parser.add_argument("--clip", default="1.0", help="max grad norm in both loops, or 'none'")
    parser.add_argument("--compile", action="store_true", help="both loops compiled (train.compile.enabled=true)")
    args = parser.parse_args()
    register_configs()
    dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    clip = None if args.clip == "none" else float(args.clip)
    print(f"{'precision':<10}{'ampctl ms':>12}{'hand ms':>12}{'overhead':>10}{'per step':>11}   "
          f"({args.recipe}, {args.rounds} rounds x {args.steps_per_round} steps each, alternating; clip {args.clip}; "
          f"{'compiled' if args.compile else 'eager'}; "
          f"after {args.warmup_steps} warm-up steps)")
    with initialize_config_module(config_module="ampctl.conf", version_base=None):
        for precision in args.precisions.split(","):
            overrides = [*RECIPES[args.recipe], f"precision={precision}", f"device={args.device}",
                         f"train.clip_grad_norm={'null' if clip is None else clip}", "train.lr.schedule=constant",
                         "train.lr.warmup_steps=0", f"train.compile.enabled={str(args.compile).lower()}"]
            ours = AmpctlLoop(overrides)
            theirs = HandWrittenLoop(ours, dtypes[precision], ours.state.scaler.kind != "none", clip, args.compile)
            device = ours.policy.device
            timed_steps(ours, args.warmup_steps, device)
            timed_steps(theirs, args.warmup_steps, device)
            ours_ms, theirs_ms, ratios = alternating_rounds(ours, theirs, args.rounds, args.steps_per_round, device)
            ours.policy.__exit__(None, None, None)
            # The overhead is the median of the per-round ratios: each ratio compares neighbours in time,
            # so slow phases of a noisy machine cancel out. The quartiles show how noisy it was.
            q1, median, q3 = statistics.quantiles(ratios, n=4)
            extra_us = (statistics.median(ours_ms) - statistics.median(theirs_ms)) * 1e3
            print(f"{precision:<10}{statistics.median(ours_ms):>12.3f}{statistics.median(theirs_ms):>12.3f}"
                  f"{(median - 1) * 100:>+9.1f}%{extra_us:>+9.0f} us   quartiles {(q1 - 1) * 100:+.1f}% .. "
                  f"{(q3 - 1) * 100:+.1f}%")


if __name__ == "__main__":
    main()
