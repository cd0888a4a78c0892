"""What accumulating micro-batch gradients in the half type loses, against fp32 accumulation
(precision.grad_accum_dtype=float32): the gradient of one step of k micro-batches on half weights (the MLP recipe,
its weights cast to bf16 or fp16, as bf16_true and O3 hold them), summed in the half type (each micro-batch's added
into .grad, as autograd does) and in fp32 (each added into an fp32 buffer, rounded once at the end), each against the
exact gradient at the same weights (float64 on the same batches); relative L2 error, the median over a few steps'
batches. fp16 runs under a loss scale of 2^10 (as GradScaler keeps it), divided out after the sum.

    python benchmarks/grad_accum_error.py                 # bf16 and fp16, k = 1, 4, 16, 64
    python benchmarks/grad_accum_error.py --steps 5 --micro-batch 16 --k 1 2 4 8 16 32 64 128
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

from ampctl.recipes.mlp import MLPRecipe

SCALES = {torch.bfloat16: 1.0, torch.float16: 2.0**10}


def step_gradients(model: torch.nn.Module, recipe: MLPRecipe, batches: list, dtype: torch.dtype,
                   in_fp32: bool) -> list[torch.Tensor]:
    """One step's gradient over `batches` on a half copy of model, accumulated in the half type or in fp32."""
    half = copy.deepcopy(model).to(dtype)
    scale, k = SCALES[dtype], len(batches)
    sums = [torch.zeros_like(p, dtype=torch.float32) for p in half.parameters()]
    for x, y in batches:
        loss = recipe.loss(half, (x.to(dtype), y)) * (scale / k)
        loss.backward()
        if in_fp32:
            for total, p in zip(sums, half.parameters()):
                total.add_(p.grad)
                p.grad = None
    if in_fp32:
        return [(total.to(dtype).double() / scale) for total in sums]
    return [p.grad.double() / scale for p in half.parameters()]


def exact(model: torch.nn.Module, recipe: MLPRecipe, batches: list, dtype: torch.dtype) -> list[torch.Tensor]:
    """The gradient at the half weights (what both sums approximate), computed in float64."""
    wide = copy.deepcopy(model).to(dtype).double()
    k = len(batches)
    for x, y in batches:
        (recipe.loss(wide, (x.to(dtype).double(), y)) / k).backward()
    return [p.grad for p in wide.parameters()]


def relative_error(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    diff = sum(float((g - r).pow(2).sum()) for g, r in zip(grads, reference))
    norm = sum(float(r.pow(2).sum()) for r in reference)
    return (diff / norm) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="steps' batches each figure is the median over")
    args = parser.parse_args()
    recipe = MLPRecipe(hidden=256, norm="none", batch_size=args.micro_batch)
    torch.manual_seed(0)
    model = recipe.build_model()
    stream = recipe.batches(torch.device("cpu"), 0)
    print(f"MLP {sum(p.numel() for p in model.parameters()):,} parameters, micro-batch {args.micro_batch}; relative "
          f"L2 error of one step's gradient against float64, median over {args.steps} steps")
    print(f"{'weights':>8} {'k':>5} {'half accumulation':>18} {'fp32 accumulation':>18} {'half / fp32':>12}")
    for dtype in (torch.bfloat16, torch.float16):
        for k in args.k:
            half, fp32 = [], []
            for _ in range(args.steps):
                batches = [next(stream) for _ in range(k)]
                reference = exact(model, recipe, batches, dtype)
                half.append(relative_error(step_gradients(model, recipe, batches, dtype, False), reference))
                fp32.append(relative_error(step_gradients(model, recipe, batches, dtype, True), reference))
            h, f = statistics.median(half), statistics.median(fp32)
            name = str(dtype).removeprefix("torch.")
            print(f"{name:>8} {k:>5} {h:>18.2e} {f:>18.2e} {h / f:>11.1f}x")


if __name__ == "__main__":
    main()
