"""What the emulated block formats cost, as a multiple of the fp32 step of the same model: `ampctl compare` of the
modes (each its own training run, the modes taking turns in short rounds, so that the machine's load falls on all
alike), printing each mode's median step time over fp32's with its interval from the comparison's own rounds.

    python benchmarks/emulation_cost.py                     # the small GPT: fp32, mxfp8, nvfp4, nvfp4_recipe
    python benchmarks/emulation_cost.py --modes fp32 mxfp8 --compile    # with train.compile.enabled=true
    python benchmarks/emulation_cost.py --torchao           # and mxfp8 by torchao's layer (its reference here)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import ampctl

SMALL_GPT = ["recipe=gpt", "recipe.n_layers=4", "recipe.d_model=128", "recipe.n_heads=4", "recipe.block_size=64",
             "recipe.batch_size=8", "recipe.max_corpus_bytes=300000"]


# a mode of the benchmark's own (a config directory's precision/ YAML, as a user adds one): mxfp8 by torchao's layer
TORCHAO_MXFP8 = """# mxfp8 computed by torchao's MXFP8 training layer (its emulated reference off sm100).
defaults:
  - mxfp8
  - _self_

name: mxfp8_torchao
options:
  kernels: torchao
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="*", default=["fp32", "mxfp8", "nvfp4", "nvfp4_recipe"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--torchao", action="store_true", help="and mxfp8 through torchao's layer (mxfp8_torchao)")
    args = parser.parse_args()
    modes = [*args.modes, *(["mxfp8_torchao"] if args.torchao else [])]
    with tempfile.TemporaryDirectory() as tmp:
        config_dir = Path(tmp) / "conf"
        (config_dir / "precision").mkdir(parents=True)
        (config_dir / "precision" / "mxfp8_torchao.yaml").write_text(TORCHAO_MXFP8)
        result = ampctl.compare([*SMALL_GPT, f"train.steps={args.steps}", "compare.warmup_steps=5", "device=cpu",
                                 f"train.compile.enabled={str(args.compile).lower()}",
                                 f"compare.precisions=[{','.join(modes)}]"],
                                out_dir=Path(tmp) / "comparison", config_dir=config_dir)
    print("step time over fp32's (the median of the rounds' ratios, and its interval):")
    for row in result.summary["rows"]:
        if row.get("speedup"):
            low, high = 1 / row["speedup_high"], 1 / row["speedup_low"]
            print(f"  {row['precision']:>14}: {row['step_time_ms']:8.1f} ms/step  {1 / row['speedup']:5.2f}x fp32's "
                  f"({low:.2f}-{high:.2f})")


if __name__ == "__main__":
    main()
