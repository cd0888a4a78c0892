"""ampctl compare's reported speedup against an independent timing of the same steps.

First `ampctl compare` runs the recipe in fp32 and the half mode (its own processes, taking turns in rounds) and
its comparison.csv gives the speedup it reports. Then the same model trains on the same batches with the loop
the torch.amp docs write (fused AdamW, clipping at 1.0, GradScaler where the mode scales), in fp32 and under
autocast, each timing in a fresh process of its own (as compare's modes run), alternating in rounds, timed with
perf_counter around each step: nothing of ampctl's loop, telemetry, turns or statistics. Prints both speedups and
ampctl's over the independent one; on these CPUs they agree within 10%.

    python benchmarks/compare_speedup.py                           # gpt (d256 x 2), bf16
    python benchmarks/compare_speedup.py --recipe gpt768 --rounds 5 --steps-per-round 4
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import torch
from hydra import compose, initialize_config_module

sys.path.insert(0, str(Path(__file__).parent))  # its neighbour, run as a script from anywhere
from loop_overhead import RECIPES, HandWrittenLoop, add_workload_arguments, timed_steps  # noqa: E402

from ampctl.conf.schema import register_configs  # noqa: E402
from ampctl.recipes.base import build_recipe  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def ampctl_speedup(args: argparse.Namespace, out: Path) -> dict[str, dict]:
    """ampctl compare's comparison.csv, by mode."""
    steps = args.warmup_steps + args.rounds * args.steps_per_round
    command = [sys.executable, "-m", "ampctl", "compare", *RECIPES[args.recipe], f"device={args.device}",
               f"compare.precisions=[fp32,{args.precisions}]", f"train.steps={steps}",
               f"compare.warmup_steps={args.warmup_steps}", f"compare.rounds={args.rounds}", f"hydra.run.dir={out}"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    with (out / "comparison.csv").open() as f:
        return {row["precision"]: row for row in csv.DictReader(f)}


def hand_loop_median_ms(args: argparse.Namespace, precision: str) -> float:
    """This process: the hand-written loop in one precision, warm-up steps, then the median of timed steps."""
    register_configs()
    with initialize_config_module(config_module="ampctl.conf", version_base=None):
        cfg = compose(config_name="train", overrides=[*RECIPES[args.recipe], f"device={args.device}"])
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    # the recipe gives the model and batches; the loop, the timing and the statistics are this file's
    reference = types.SimpleNamespace(recipe=build_recipe(cfg.recipe), policy=types.SimpleNamespace(device=device))
    loop = HandWrittenLoop(reference, DTYPES.get(precision), precision == "fp16", 1.0, False)  # type: ignore[arg-type]
    timed_steps(loop, args.warmup_steps, device)
    return statistics.median(timed_steps(loop, args.steps_per_round, device))


def independent_speedup(args: argparse.Namespace) -> tuple[float, float, float]:
    """Median fp32 and half step times (ms) of the hand-written loop over its rounds, and the median of the rounds'
    ratios. Each round times each precision in a fresh process of its own, as compare's modes run, in an order that
    rotates."""
    fp32_ms: list[float] = []
    half_ms: list[float] = []
    for r in range(args.rounds):
        for precision in (["fp32", args.precisions] if r % 2 == 0 else [args.precisions, "fp32"]):
            worker = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--worker", precision], check=True,
                                    capture_output=True, text=True)
            (fp32_ms if precision == "fp32" else half_ms).append(float(worker.stdout.split()[-1]))
    return statistics.median(fp32_ms), statistics.median(half_ms), statistics.median(
        f / h for f, h in zip(fp32_ms, half_ms))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser, recipe="gpt", precisions="bf16", rounds=7, steps_per_round=8)
    parser.add_argument("--repeat", type=int, default=3,
                        help="measure both this many times, alternating: these machines drift by tens of percent "
                             "over minutes, and one pair of measurements taken minutes apart inherits the drift")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one timing of the hand-written loop, in its own process
    args = parser.parse_args()
    if args.worker:
        print(hand_loop_median_ms(args, args.worker))
        return
    print(f"{args.recipe}, fp32 vs {args.precisions}, {args.rounds} rounds x {args.steps_per_round} steps after "
          f"{args.warmup_steps} warm-up steps, {args.repeat} times, alternating")
    ratios, inside = [], 0
    for repeat in range(1, args.repeat + 1):
        with tempfile.TemporaryDirectory() as tmp:
            rows = ampctl_speedup(args, Path(tmp) / "compare")
        row = rows[args.precisions]
        fp32_ms, half_ms, theirs = independent_speedup(args)
        ours, low, high = float(row["speedup"]), float(row["speedup_low"]), float(row["speedup_high"])
        ratios.append(ours / theirs)
        inside += low <= theirs <= high
        print(f"  {repeat}: ampctl compare {ours:.3f}x ({low:.3f}-{high:.3f}; fp32 "
              f"{float(rows['fp32']['step_time_ms']):.1f} ms, {args.precisions} {float(row['step_time_ms']):.1f} ms)"
              f" | independent {theirs:.3f}x (fp32 {fp32_ms:.1f} ms, {args.precisions} {half_ms:.1f} ms) | ratio "
              f"{ours / theirs:.3f} | {'inside' if low <= theirs <= high else 'outside'} ampctl's interval")
    median = statistics.median(ratios)
    print(f"ampctl / independent: median {median:.3f} (range {min(ratios):.3f}-{max(ratios):.3f}), "
          f"{'within' if abs(median - 1) <= 0.10 else 'outside'} 10%; the independent speedup inside ampctl's "
          f"interval {inside} of {args.repeat} times")


if __name__ == "__main__":
    main()
