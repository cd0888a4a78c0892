"""ampctl compare's speed verdict on a quiet machine and beside busy loops (a load of ~4 on 2 cores), before and
after its short turns and its threads sized to the free cores (issue 51, item 12).

"before" is compare as it was: 5 rounds of long windows, a thread per core (compare.rounds=5 train.threads=<cores>);
"after" is its defaults. Each runs on two models: the small GPT (bf16 at about fp32's speed on an AVX512-BF16 CPU)
and an MLP whose 1024-wide matmuls make bf16 win where the CPU has bf16 instructions. Prints, per model, setting and
load: the verdict, the speedup with its interval, the threads the modes ran on and the wall time; then whether the
busy verdict agrees with the quiet one (or says no difference) and the busy run's time over the quiet one's.

    python benchmarks/compare_under_load.py                  # both models, 2 busy loops
    python benchmarks/compare_under_load.py --models gpt --busy-loops 2
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

MODELS = {
    "gpt": ["recipe=gpt", "recipe.n_layers=2", "recipe.d_model=128"],
    "mlp1024": ["recipe=mlp", "recipe.hidden=1024", "recipe.batch_size=1024", "train.steps=120"],
}
SETTINGS = {
    "before": lambda cores: ["compare.rounds=5", f"train.threads={cores}"],
    "after": lambda cores: [],
}


@contextlib.contextmanager
def busy_loops(n: int) -> Iterator[None]:
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    time.sleep(1.0)
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def compare(model: str, setting: str, out: Path, *extra: str) -> dict:
    cores = os.cpu_count() or 1
    command = [sys.executable, "-m", "ampctl", "compare", "device=cpu", *MODELS[model],
               "compare.precisions=[fp32,bf16]", *SETTINGS[setting](cores), *extra, f"hydra.run.dir={out}"]
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    with (out / "comparison.csv").open() as f:
        row = {r["precision"]: r for r in csv.DictReader(f)}["bf16"]
    threads = json.loads((out / "bf16" / "summary.json").read_text())["torch_threads"]
    verdict = row["speed_verdict"]
    said = ("faster" if " faster than " in verdict else "slower" if " slower than " in verdict else "no diff")
    return {"verdict": said, "speedup": float(row["speedup"]), "low": float(row["speedup_low"]),
            "high": float(row["speedup_high"]), "threads": threads, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,mlp1024")
    parser.add_argument("--busy-loops", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            results = {}
            for setting in SETTINGS:
                for load in ("quiet", "busy"):
                    out = Path(tmp) / f"{model}-{setting}-{load}"
                    with busy_loops(args.busy_loops) if load == "busy" else contextlib.nullcontext():
                        results[setting, load] = r = compare(model, setting, out)
                    print(f"{model:8} {setting:6} {load:5}: {r['verdict']:7} {r['speedup']:.2f}x "
                          f"({r['low']:.2f}-{r['high']:.2f}) on {r['threads']} thread(s), {r['wall_s']:.0f} s",
                          flush=True)
            for setting in SETTINGS:
                quiet, busy = results[setting, "quiet"], results[setting, "busy"]
                if busy["threads"] != quiet["threads"]:  # the busy run's speedup is that many threads': so is its peer
                    same = compare(model, setting, Path(tmp) / f"{model}-{setting}-quiet-same",
                                   f"train.threads={busy['threads']}")
                    print(f"{model:8} {setting:6} quiet: {same['verdict']:7} {same['speedup']:.2f}x "
                          f"({same['low']:.2f}-{same['high']:.2f}) on {same['threads']} thread(s), "
                          f"{same['wall_s']:.0f} s", flush=True)
                    quiet = {**same, "wall_s": quiet["wall_s"]}  # the time against the quiet run as a user runs it
                agrees = busy["verdict"] in (quiet["verdict"], "no diff")
                holds = busy["low"] <= quiet["speedup"] <= busy["high"]
                print(f"{model:8} {setting:6}: busy verdict {'agrees with' if agrees else 'CONTRADICTS'} the quiet "
                      f"one on {quiet['threads']} thread(s); its median {'inside' if holds else 'outside'} the busy "
                      f"interval; busy run {busy['wall_s'] / quiet['wall_s']:.1f}x the quiet one's time", flush=True)


if __name__ == "__main__":
    main()
