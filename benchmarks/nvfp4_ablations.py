"""NVFP4's training recipe, piece by piece, at small scale (the ablations of NVIDIA's arXiv 2509.25149, Figure 7's
kind): the built-in GPT trained the same number of steps from the same seeds under bf16, the whole recipe, the recipe
less each piece (2D weight blocks, random Hadamard transforms, stochastic rounding), the recipe with its last block
kept in bf16 (the paper keeps its last blocks high), the recipe and plain nvfp4 switching to bf16 for the last 18%
of the steps (precision.schedule, as the paper switches at 82% of its tokens), plain nvfp4 and mxfp4; each mode's
held-out loss against fp32's with its interval over the seeds, from one `ampctl compare` (its rounds and parity,
reports/parity.py).

    python benchmarks/nvfp4_ablations.py                       # 3 seeds x 300 steps of a 4-block GPT (CPU: ~25 min)
    python benchmarks/nvfp4_ablations.py --steps 600 --seeds 5
    python benchmarks/nvfp4_ablations.py --modes "fp32,nvfp4,'nvfp4->bf16@0.82'"   # some rows (fp32 first)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import ampctl
from ampctl.conf import precision_schedule
from ampctl.reports import comparison, parity

SMALL_GPT = ["recipe=gpt", "recipe.n_layers=4", "recipe.d_model=128", "recipe.n_heads=4", "recipe.block_size=64",
             "recipe.batch_size=8", "recipe.max_corpus_bytes=2000000"]
LAST_BLOCK = 3  # SMALL_GPT's n_layers - 1


def variant(name: str, comment: str, options: dict[str, bool], rules: str = "") -> str:
    lines = [f"# {comment}", "defaults:", "  - nvfp4_recipe", "  - _self_", "", f"name: {name}", "options:"]
    lines += [f"  {key}: {str(value).lower()}" for key, value in options.items()] or ["  {}"]
    if rules:
        lines += [rules]
    return "\n".join(lines) + "\n"


# the benchmark's own modes (a config directory's precision/ YAMLs, as a user adds one)
VARIANTS = {
    "recipe_no_2d": variant("recipe_no_2d", "the recipe without 2D weight blocks", {"weights_2d": False}),
    "recipe_no_rht": variant("recipe_no_rht", "the recipe without random Hadamard transforms", {"rht": False}),
    "recipe_no_sr": variant("recipe_no_sr", "the recipe without stochastic rounding", {"stochastic_rounding": False}),
    "recipe_last_bf16": variant("recipe_last_bf16", "the recipe, its last block in bf16", {},
                                f"rules:\n  - match: blocks.{LAST_BLOCK}.*\n    run_in: bf16"),
}
SWITCH = "@0.82"  # the paper's point: bf16 for the last 18% of the steps (a compare row of precision.schedule)
MODES = ["fp32", "bf16", "nvfp4_recipe", *VARIANTS, f"'nvfp4_recipe->bf16{SWITCH}'", "nvfp4",
         f"'nvfp4->bf16{SWITCH}'", "mxfp4"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="keep the comparison here (default: a temporary one)")
    parser.add_argument("--modes", default=",".join(MODES), help="compare.precisions' rows, fp32 first")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config_dir = Path(tmp) / "conf"
        (config_dir / "precision").mkdir(parents=True)
        for name, text in VARIANTS.items():
            (config_dir / "precision" / f"{name}.yaml").write_text(text)
        out = args.out or Path(tmp) / "ablations"
        result = ampctl.compare([*SMALL_GPT, f"train.steps={args.steps}", f"compare.seeds={args.seeds}",
                                 "compare.warmup_steps=5", "device=cpu",
                                 f"compare.precisions=[{args.modes}]"], out_dir=out, config_dir=config_dir)
        switches = switch_effects(out, [row["precision"] for row in result.summary["rows"]], args.seeds)
    print(f"held-out loss after {args.steps} steps, {args.seeds} seeds (Δ against fp32, ± its 95% interval):")
    for row in result.summary["rows"]:
        delta = row.get("eval_loss_delta")
        said = "" if delta is None else f"{delta:+.4f} ± {row.get('eval_loss_delta_interval') or 0:.4f}"
        loss = row.get("eval_loss", float("nan"))
        print(f"  {row['precision']:>17}: {loss:.4f}  {said:>18}  {row.get('parity') or ''}")
    for line in switches:
        print(line)


def switch_effects(out: Path, rows: list[str], seeds: int) -> list[str]:
    """What each scheduled row's switch does to its first mode's held-out loss, paired over the seeds (the same
    batches and initial weights): the row's per-seed loss minus its first mode's, with its 95% interval."""
    def losses(row: str) -> list[float]:
        return [json.loads((comparison.run_dir(out, row, seed, seeds > 1) / "summary.json").read_text())["eval"][
            "eval/loss"] for seed in range(seeds)]

    said = []
    for row in rows:
        first = precision_schedule.modes_in(row)[0]
        if precision_schedule.ARROW not in row or first not in rows:
            continue
        result = parity.parity(losses(first), losses(row))
        if result is not None and result.half_width is not None:
            said.append(f"  the switch, {row} against {first}: held-out loss {result.difference:+.4f} ± "
                        f"{result.half_width:.4f} (paired over {result.seeds} seeds)")
    return said


if __name__ == "__main__":
    main()
