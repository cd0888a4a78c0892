"""What checkpointing every N steps costs a run, as its wall time against the same run without checkpoints: a full
checkpoint (one file, written before the next step), a sharded one (DCP, written before the next step), and a sharded
one written in the background (distributed.async_checkpoint=true) by DCP's thread or by a process of its own
(distributed.async_checkpointer=process). Each run is a DDP job under torchrun (one process by default: the
checkpointing process is for distributed runs, and every way pays the same), one at a time, in alternating rounds
so that the machine's load falls on all alike; prints the median wall time of the steps and its ratio to the run
without checkpoints, with the rounds' range.

    python benchmarks/checkpoint_cost.py                                  # the small GPT, every 10 steps, 3 rounds
    python benchmarks/checkpoint_cost.py --every 5 --rounds 5 --overrides recipe=mlp recipe.hidden=2048
    python benchmarks/checkpoint_cost.py --nproc 2 --overrides distributed=fsdp ...   # more ranks, where cores allow
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SMALL_GPT = ["recipe=gpt", "recipe.n_layers=4", "recipe.d_model=256", "recipe.n_heads=4", "recipe.block_size=64",
             "recipe.batch_size=8", "recipe.max_corpus_bytes=300000"]
WAYS = {
    "none": ["train.checkpoint.every=null", "train.checkpoint.every_s=null"],
    "full": [],
    "sharded": ["distributed.checkpoint_format=sharded"],
    "sharded, async thread": ["distributed.checkpoint_format=sharded", "distributed.async_checkpoint=true"],
    "sharded, async process": ["distributed.checkpoint_format=sharded", "distributed.async_checkpoint=true",
                               "distributed.async_checkpointer=process"],
}


def one_run(run_dir: Path, overrides: list[str], way: list[str], every: int, steps: int, nproc: int) -> float:
    """The steps' wall time (the summary's training window), in seconds."""
    every_arg = [] if "train.checkpoint.every=null" in way else [f"train.checkpoint.every={every}"]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                    "-m", "ampctl", "train", "device=cpu", "distributed=ddp", "train.console=quiet",
                    "telemetry.profile_cpu_memory=false", f"train.steps={steps}", *overrides, *every_arg, *way,
                    f"hydra.run.dir={run_dir}"], check=True, capture_output=True, text=True)
    start, end = json.loads((run_dir / "summary.json").read_text())["training_window"]
    return end - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=1, help="torchrun's processes (ranks) per run")
    parser.add_argument("--overrides", nargs="*", default=SMALL_GPT)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name, way in WAYS.items():
                run_dir = Path(tmp) / f"{round_}-{name.replace(' ', '_').replace(',', '')}"
                times[name].append(one_run(run_dir, args.overrides, way, args.every, args.steps, args.nproc))
    base = statistics.median(times["none"])
    print(f"{' '.join(args.overrides)}: {args.steps} steps on {args.nproc} rank(s), a checkpoint every {args.every}; "
          f"median wall time of the steps over {args.rounds} rounds (each round's range)")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:<22} {median:8.2f} s  {median / base:5.2f}x  ({min(values):.2f}-{max(values):.2f} s)")


if __name__ == "__main__":
    main()
