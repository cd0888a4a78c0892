"""What the MoE recipe's step costs: (1) its experts through torch's grouped GEMM against the same experts one at a
time (recipe.grouped_mm=false: the loop a grouped kernel replaces), forward and backward of one MoE layer; (2) a
training step of recipe=moe against the built-in GPT whose MLP has the same activated parameters per token (a dense
MLP of 8·d² against k experts of 3·d·h: h = 8d/3k, rounded to 16). Each pair measured in alternating rounds in one
process (the machine's load falls on both alike); printed: the median of the rounds' ratios and their range.

    python benchmarks/moe_speed.py                    # fp32 and bf16 autocast, this machine
    python benchmarks/moe_speed.py --rounds 30 --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from ampctl.recipes.gpt import GPTRecipe
from ampctl.recipes.moe import MoE, MoERecipe, MoESpec

D, EXPERTS, TOP_K, HIDDEN, TOKENS = 256, 8, 2, 512, 2048
SMALL = {"n_layers": 4, "d_model": 128, "n_heads": 4, "block_size": 64, "batch_size": 8, "max_corpus_bytes": 300_000}


def timed(run: Callable[[], None], repeats: int) -> float:
    """The median wall time of `repeats` calls, in ms (after one call not timed)."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def alternating(first: Callable[[], None], second: Callable[[], None], rounds: int, repeats: int) -> list[float]:
    """second's time over first's, round by round (the order within a round alternates)."""
    ratios = []
    for r in range(rounds):
        a, b = (timed(first, repeats), timed(second, repeats)) if r % 2 == 0 else \
            tuple(reversed((timed(second, repeats), timed(first, repeats))))
        ratios.append(b / a)
    return ratios


def said(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} rounds)"


def layer_step(grouped: bool, dtype: torch.dtype) -> Callable[[], None]:
    torch.manual_seed(0)
    layer = MoE(D, MoESpec(EXPERTS, TOP_K, HIDDEN, grouped=grouped))
    for w in (layer.experts.w1, layer.experts.w2, layer.experts.w3):
        torch.nn.init.normal_(w, std=0.02)
    x = torch.randn(TOKENS, D, requires_grad=True)

    def step() -> None:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            out = layer(x)
        out.float().pow(2).mean().backward()
    return step


def training_step(recipe, dtype: torch.dtype) -> Callable[[], None]:
    torch.manual_seed(0)
    model = recipe.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batches = recipe.batches(torch.device("cpu"), 0)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = recipe.loss(model, next(batches))
        loss.backward()
        optimizer.step()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    args = parser.parse_args()
    hidden = max(16, round(8 * SMALL["d_model"] / (3 * TOP_K) / 16) * 16)
    moe = MoERecipe(**SMALL, experts=EXPERTS, top_k=TOP_K, expert_hidden=hidden)
    dense = GPTRecipe(**SMALL)
    print(f"one MoE layer ({TOKENS} tokens, d={D}, {EXPERTS} experts of {HIDDEN}, top-{TOP_K}), forward + backward; "
          f"training: recipe=moe (experts of {hidden}) against the dense GPT of the same activated parameters")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        loop = alternating(layer_step(True, dtype), layer_step(False, dtype), args.rounds, args.repeats)
        print(f"  {name}: the loop over experts takes {said(loop)} the grouped GEMM's time")
        step = alternating(training_step(dense, dtype), training_step(moe, dtype), args.rounds, args.repeats)
        print(f"  {name}: a recipe=moe training step takes {said(step)} the dense GPT's")


if __name__ == "__main__":
    main()
