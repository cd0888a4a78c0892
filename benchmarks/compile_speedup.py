"""What train.compile buys: ampctl's own step, eager against compiled (each block the recipe names compiled
on its own), on the same model, batches and precision, in one process, alternating in rounds so that machine
noise falls on both alike. Compile time (the first steps of the compiled loop) is reported on its own and
left out of the step times. Prints median step times, the speedup and its quartiles over rounds.

    python benchmarks/compile_speedup.py                          # gpt recipe, fp32 (the issue's CPU target: >= 2x)
    python benchmarks/compile_speedup.py --recipe gpt768 --precisions fp32,bf16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from hydra import initialize_config_module

sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/ is not a package: share loop_overhead's loops
from loop_overhead import RECIPES, AmpctlLoop, add_workload_arguments, alternating_rounds, timed_steps  # noqa: E402

from ampctl.conf.schema import register_configs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser, recipe="gpt", precisions="fp32", rounds=10, steps_per_round=3)
    parser.add_argument("--mode", default="default", help="train.compile_mode of the compiled loop")
    args = parser.parse_args()
    register_configs()
    print(f"{'precision':<10}{'eager ms':>10}{'compiled ms':>13}{'speedup':>9}{'compile s':>11}   ({args.recipe}, "
          f"{args.rounds} rounds x {args.steps_per_round} steps, alternating; mode {args.mode}; "
          f"after {args.warmup_steps} warm-up steps)")
    with initialize_config_module(config_module="ampctl.conf", version_base=None):
        for precision in args.precisions.split(","):
            base = [*RECIPES[args.recipe], f"precision={precision}", f"device={args.device}",
                    "train.lr.schedule=constant", "train.lr.warmup_steps=0"]
            eager = AmpctlLoop([*base, "train.compile.enabled=false"])
            compiled = AmpctlLoop([*base, "train.compile.enabled=true", f"train.compile.mode={args.mode}"])
            device = eager.policy.device
            timed_steps(eager, args.warmup_steps, device)
            start = time.perf_counter()
            first = timed_steps(compiled, args.warmup_steps, device)
            compile_s = time.perf_counter() - start - statistics.median(first) * (len(first) - 1) / 1e3
            eager_ms, compiled_ms, ratios = alternating_rounds(eager, compiled, args.rounds, args.steps_per_round,
                                                               device)
            for loop in (eager, compiled):
                loop.policy.__exit__(None, None, None)
            q1, median, q3 = statistics.quantiles(ratios, n=4)
            print(f"{precision:<10}{statistics.median(eager_ms):>10.2f}{statistics.median(compiled_ms):>13.2f}"
                  f"{median:>8.2f}x{compile_s:>11.1f}   quartiles {q1:.2f}x .. {q3:.2f}x")


if __name__ == "__main__":
    main()
