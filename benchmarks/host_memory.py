"""What train.hold_host_memory buys a CPU run: ampctl's step in a process whose glibc malloc keeps what each step
frees (engine/host_memory.py) against one with glibc's defaults.

The setting is the process's, so each side runs in processes of its own: every round starts one process of each,
in an order that alternates from round to round, and each process builds the same model (same init, same
batches), takes the warm-up steps, then times its steps and counts the minor page faults they cost
(getrusage). Prints, per precision, each side's median step time and faults a step, and the median over rounds of
the held side's step time over the default's in the same round, with its quartiles.

    python benchmarks/host_memory.py                                  # gpt recipe, fp32 and bf16
    python benchmarks/host_memory.py --recipe gpt768 --precisions bf16 --rounds 3 --steps-per-round 5
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/ is not a package: share loop_overhead's loops
from loop_overhead import RECIPES, AmpctlLoop, add_workload_arguments, timed_steps  # noqa: E402

from ampctl.engine import host_memory  # noqa: E402

SIDES = ("default", "held")


def one_process(args: argparse.Namespace) -> None:
    """The child: one side's steps, as a JSON line {ms, faults_per_step}."""
    from hydra import initialize_config_module

    from ampctl.conf.schema import register_configs

    if args.side == "held" and not host_memory.hold_freed_memory():
        sys.exit("this C library is not glibc: nothing to hold")
    register_configs()
    with initialize_config_module(config_module="ampctl.conf", version_base=None):
        loop = AmpctlLoop([*RECIPES[args.recipe], f"precision={args.precisions}", f"device={args.device}",
                           "train.lr.schedule=constant", "train.lr.warmup_steps=0"])
        timed_steps(loop, args.warmup_steps, loop.policy.device)
        faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        times = timed_steps(loop, args.steps_per_round, loop.policy.device)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    print(json.dumps({"ms": statistics.median(times), "faults_per_step": faults / args.steps_per_round}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser, recipe="gpt", precisions="fp32,bf16", rounds=8, steps_per_round=20)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # a child process's
    args = parser.parse_args()
    if args.side:
        return one_process(args)
    print(f"({args.recipe}; {args.rounds} rounds, each a process of each side in alternating order: "
          f"{args.steps_per_round} steps after {args.warmup_steps} warm-up steps; ratio: median over rounds of the "
          "held side's median step time / the default's in the same round)")
    for precision in args.precisions.split(","):
        results: dict[str, list[dict]] = {side: [] for side in SIDES}
        for round_index in range(args.rounds):
            for side in SIDES[::1 if round_index % 2 == 0 else -1]:
                child = [sys.executable, __file__, "--side", side, "--precisions", precision,
                         *(f"--{key.replace('_', '-')}={value}" for key, value in vars(args).items()
                           if key not in ("side", "precisions"))]
                out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
                results[side].append(json.loads(out.splitlines()[-1]))
        ratios = [held["ms"] / default["ms"] for held, default in zip(results["held"], results["default"])]
        q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        print(f"{precision}:")
        for side in SIDES:
            ms = statistics.median(r["ms"] for r in results[side])
            faults = statistics.median(r["faults_per_step"] for r in results[side])
            print(f"  {side:<8}{ms:>9.2f} ms a step  {faults:>9.1f} page faults a step")
        print(f"  held / default: {median:.3f}x (quartiles {q1:.3f}x .. {q3:.3f}x)")


if __name__ == "__main__":
    main()
