"""How long ampctl takes before it does anything: `ampctl train --help`, a shell-completion query (each Tab), and
the time to the first step of a 1-step mlp run, each against `python -c "import torch"` alone, measured in
alternating rounds of fresh processes (the machine's load falls on all alike). Prints the medians and the
quartiles of each, and the issue's targets: --help and completion under 1 s, the first step within 2 s of
importing torch.

    python benchmarks/startup.py               # 7 rounds
    python benchmarks/startup.py --rounds 15

The first step is timed from the process's start to the moment its line reaches the pipe (train.console=plain
prints it when the step's values come back), so it holds everything before the loop: imports, composing the
config, the checks, building the recipe, the model and the optimizer, and the step itself.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

AMPCTL = [sys.executable, "-m", "ampctl"]


def timed(command: list[str], env: dict[str, str], until: str = "") -> float:
    """Seconds from starting command to its exit, or to the first line of stdout that starts with `until`."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    assert process.stdout is not None
    seen = None
    for line in process.stdout:
        if until and seen is None and line.startswith(until):
            seen = time.perf_counter() - start
    _, err = process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({process.returncode}): {err.strip()[-500:]}")
    if until and seen is None:
        raise SystemExit(f"{' '.join(command)} printed no line starting with {until!r}")
    return seen if until else time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    env = {**os.environ, "COMP_LINE": "ampctl train precision=f"}
    with tempfile.TemporaryDirectory() as tmp:
        runs = iter(range(10**6))
        cases: dict[str, Callable[[], float]] = {
            "import torch": lambda: timed([sys.executable, "-c", "import torch"], env),
            "ampctl train --help": lambda: timed([*AMPCTL, "train", "--help"], env),
            "completion query": lambda: timed([*AMPCTL, "-sc", "query=bash"], env),
            "first step, 1-step mlp run": lambda: timed(
                [*AMPCTL, "train", "recipe=mlp", "train.steps=1", "train.console=plain",
                 f"hydra.run.dir={Path(tmp) / str(next(runs))}"], env, until="step 1/1"),
        }
        for case in cases.values():  # once, untimed: the files are in the page cache for every round
            case()
        times: dict[str, list[float]] = {name: [] for name in cases}
        for round_ in range(args.rounds):
            order = list(cases)[round_ % len(cases):] + list(cases)[:round_ % len(cases)]  # rotate the order
            for name in order:
                times[name].append(cases[name]())
    torch_s = statistics.median(times["import torch"])
    # the first step against import torch, round by round: both met the same load
    over_torch = [s - t for s, t in zip(times["first step, 1-step mlp run"], times["import torch"])]
    print(f"{'':<30}{'median s':>9}{'quartiles':>16}   ({args.rounds} alternating rounds of fresh processes)")
    for name, values in times.items():
        q1, _, q3 = statistics.quantiles(values, n=4)
        print(f"{name:<30}{statistics.median(values):>9.2f}   {q1:>5.2f} .. {q3:<5.2f}")
    q1, _, q3 = statistics.quantiles(over_torch, n=4)
    first_over = statistics.median(over_torch)
    print(f"{'first step - import torch':<30}{first_over:>9.2f}   {q1:>5.2f} .. {q3:<5.2f}")
    print()
    for what, value, target in (("ampctl train --help", statistics.median(times["ampctl train --help"]), 1.0),
                                ("completion query", statistics.median(times["completion query"]), 1.0),
                                ("first step after import torch", first_over, 2.0)):
        print(f"{what}: {value:.2f} s, target < {target:g} s: {'met' if value < target else 'NOT met'}")
    print(f"(import torch alone: {torch_s:.2f} s)")


if __name__ == "__main__":
    main()
