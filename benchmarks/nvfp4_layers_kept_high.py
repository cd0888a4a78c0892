"""Which layers to keep out of NVFP4, measured against the paper's static choice (arXiv 2509.25149 keeps its first
and last blocks in BF16): for each seed, the small GPT of benchmarks/nvfp4_ablations.py trained under
`precision=nvfp4_recipe`; on its trained weights, `ampctl diff diff.repair=true` raises layers one at a time in its
ranking (the error each adds itself) and measures each set; the paper's sets at the same number of layers (the last
block: 4 Linear layers; the first and last blocks: 8) are measured by the same diff on the same weights and batches.
Each set's layers run `unconverted` (out of the format, as the rest of the model computes: fp32 here), the repair's
one step up. The figure: the whole gradient's error against fp32 over its batch-to-batch noise (diff's
error_over_noise; the repair's yardstick is diff.noise_share=0.1 of it).

    python benchmarks/nvfp4_layers_kept_high.py                 # 3 seeds x 300 steps (CPU: ~35 min)
    python benchmarks/nvfp4_layers_kept_high.py --steps 600 --seeds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Optional

import ampctl

SMALL_GPT = ["recipe=gpt", "recipe.n_layers=4", "recipe.d_model=128", "recipe.n_heads=4", "recipe.block_size=64",
             "recipe.batch_size=8", "recipe.max_corpus_bytes=2000000", "device=cpu"]
PAPERS = {4: "the last block", 8: "the first and last blocks"}  # a block holds 4 Linear layers


def rules(blocks: list[int]) -> str:
    """The paper's set as precision.rules: every Linear of these blocks unconverted."""
    return "precision.rules=[" + ",".join(f"{{match:'blocks.{b}.*',run_in:unconverted}}" for b in blocks) + "]"


def diff(out: Path, *overrides: str) -> dict:
    ampctl.diff([*SMALL_GPT, "precision=nvfp4_recipe", *overrides], out_dir=out)
    return json.loads((out / "diff.json").read_text())


def one_seed(seed: int, steps: int, tmp: Path) -> dict[str, object]:
    run = ampctl.train([*SMALL_GPT, "precision=nvfp4_recipe", f"train.steps={steps}", f"train.seed={seed}",
                        "train.console=quiet", "telemetry.profile_cpu_memory=false"], run_dir=tmp / f"run_{seed}")
    common = [f"diff.weights={run.run_dir}", f"train.seed={seed}"]
    repaired = diff(tmp / f"repair_{seed}", *common, "diff.repair=true", f"diff.repair_layers={max(PAPERS)}")
    tried = repaired["repair"]["tried"]
    found: dict[str, object] = {"seed": seed, "none": repaired["model"]["error_over_noise"]}
    for k in PAPERS:
        chosen: Optional[dict] = tried[k - 1] if len(tried) >= k else None  # the search stops once under the yardstick
        found[f"repair_{k}"] = chosen["error_over_noise"] if chosen else None
        found[f"repair_{k}_layers"] = [r["match"] for r in chosen["rules"]] if chosen else None
    last = 3  # SMALL_GPT's n_layers - 1
    found["paper_4"] = diff(tmp / f"paper4_{seed}", *common, rules([last]))["model"]["error_over_noise"]
    found["paper_8"] = diff(tmp / f"paper8_{seed}", *common, rules([0, last]))["model"]["error_over_noise"]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        seeds = [one_seed(seed, args.steps, Path(tmp)) for seed in range(args.seeds)]
    print(f"gradient error over its noise on nvfp4_recipe's weights after {args.steps} steps (lower is closer to fp32)")
    for s in seeds:
        print(f"seed {s['seed']}: all in NVFP4 {s['none']:.3f}")
        for k, paper in PAPERS.items():
            repair = s[f"repair_{k}"]
            said = (f"{repair:.3f} ({', '.join(s[f'repair_{k}_layers'])})" if repair is not None
                    else "under the yardstick with fewer layers")
            print(f"  {k} layers: the repair's {said}; the paper's, {paper}: {s[f'paper_{k}']:.3f}")
    for k, paper in PAPERS.items():
        ratios = [s[f"repair_{k}"] / s[f"paper_{k}"] for s in seeds if s[f"repair_{k}"] is not None]
        if ratios:
            print(f"{k} layers: the repair's error / the paper's ({paper}): mean {statistics.mean(ratios):.3f}, "
                  f"range {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} seeds")


if __name__ == "__main__":
    main()
