"""ampctl's training step against Lightning Fabric's and Hugging Face Accelerate's, and the hand-written torch.amp
loop, on the same model, batches, optimizer (fused AdamW), clipping and precision, in one process, rotating in
rounds so that machine noise falls on all alike. Prints each loop's median step time and its ratio to the hand
loop (median over rounds of per-round ratios, with quartiles).

Fabric and Accelerate are not ampctl's dependencies: run this where they are installed, in an environment of its
own, e.g. next to ampctl's torch without touching its venv:

    pip install --target /tmp/frameworks --no-deps lightning lightning-utilities accelerate torchmetrics \\
        fsspec huggingface_hub safetensors psutil
    PYTHONPATH=/tmp/frameworks python benchmarks/framework_overhead.py --recipe mlp --precisions fp32,bf16

A framework that is not importable is left out, and the line says so. Every loop runs in a process whose malloc
holds what a step frees, as ampctl's runs do (train.hold_host_memory; --host-memory default for glibc's defaults):
with the defaults a step pays thousands of page faults, which fall on whichever loop frees what when, and the
comparison is of the allocator's churn more than of the loops (benchmarks/host_memory.py measures what holding
buys a run). "hand on ampctl's" is the hand loop's step on
the model and optimizer ampctl built (the same objects ampctl's own step trains): ampctl's row against it is what
its step costs beyond the hand's, apart from the state both train.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch
from hydra import initialize_config_module

sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/ is not a package: share loop_overhead's loops
from loop_overhead import RECIPES, AmpctlLoop, HandWrittenLoop, add_workload_arguments, rotating_rounds, timed_steps  # noqa: E402

from ampctl.conf.schema import register_configs  # noqa: E402
from ampctl.engine import host_memory  # noqa: E402

# each framework's own name for the mode
FABRIC_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
ACCELERATE_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _model_and_optimizer(reference: AmpctlLoop) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model ampctl trains (same seed, same init) and the optimizer ampctl's adamw config builds."""
    torch.manual_seed(0)
    model = reference.recipe.build_model().to(reference.policy.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    return model, optimizer


class FabricLoop:
    """Lightning Fabric's documented loop: setup, fabric.backward, fabric.clip_gradients, optimizer.step."""

    def __init__(self, reference: AmpctlLoop, precision: str, clip: Optional[float]) -> None:
        from lightning.fabric import Fabric

        device = reference.policy.device
        self.fabric = Fabric(accelerator=device.type, devices=1, precision=FABRIC_PRECISION[precision])
        model, optimizer = _model_and_optimizer(reference)
        self.model, self.optimizer = self.fabric.setup(model, optimizer)
        self.recipe, self.clip = reference.recipe, clip
        self.batches = self.recipe.batches(device, 0)

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.recipe.loss(self.model, next(self.batches))  # the wrapped forward runs under its autocast
        self.fabric.backward(loss)
        if self.clip is not None:
            self.fabric.clip_gradients(self.model, self.optimizer, max_norm=self.clip)
        self.optimizer.step()


class AccelerateLoop:
    """Accelerate's documented loop: prepare, accelerator.backward, clip_grad_norm_, optimizer.step."""

    def __init__(self, reference: AmpctlLoop, precision: str, clip: Optional[float]) -> None:
        from accelerate import Accelerator

        device = reference.policy.device
        self.accelerator = Accelerator(mixed_precision=ACCELERATE_PRECISION[precision], cpu=device.type == "cpu")
        model, optimizer = _model_and_optimizer(reference)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.recipe, self.clip = reference.recipe, clip
        self.batches = self.recipe.batches(device, 0)

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.recipe.loss(self.model, next(self.batches))  # the prepared forward runs under its autocast
        self.accelerator.backward(loss)
        if self.clip is not None:
            self.accelerator.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()


class HandStepOnAmpctlState(HandWrittenLoop):
    """The hand loop's step on the model and optimizer ampctl built: what ampctl's step costs beyond the hand's,
    apart from its state (two models built alike differ by a few percent from run to run: where their memory lies,
    what their weights hold)."""

    def __init__(self, reference: AmpctlLoop, dtype: Optional[torch.dtype], scaled: bool,
                 clip: Optional[float]) -> None:
        super().__init__(reference, dtype, scaled, clip, compiled=False)
        self.model, self.optimizer = reference.state.model, reference.state.optimizer
        self.batches = reference.batches


def _frameworks(reference: AmpctlLoop, precision: str, clip: Optional[float]) -> dict[str, object]:
    loops: dict[str, object] = {}
    for name, make in (("fabric", FabricLoop), ("accelerate", AccelerateLoop)):
        try:
            loops[name] = make(reference, precision, clip)
        except ImportError as exc:
            print(f"  {name}: not installed here ({exc.name}); see this file's docstring")
    return loops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser, recipe="mlp", precisions="fp32", rounds=100, steps_per_round=2)
    parser.add_argument("--clip", default="1.0", help="max grad norm in every loop, or 'none'")
    parser.add_argument("--host-memory", choices=("held", "default"), default="held",
                        help="glibc's malloc holding freed memory in this process (as ampctl's runs), or its defaults")
    args = parser.parse_args()
    register_configs()
    clip = None if args.clip == "none" else float(args.clip)
    precisions = args.precisions.split(",")
    if len(precisions) > 1:  # Accelerate's state is one per process: each precision in a process of its own
        for precision in precisions:
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--precisions", precision], check=True)
        return
    if args.host_memory == "held":
        host_memory.hold_freed_memory()
    print(f"({args.recipe}; host memory {args.host_memory}; {args.rounds} rounds x {args.steps_per_round} steps of "
          f"each loop, rotating; clip {args.clip}; after {args.warmup_steps} warm-up steps; ratio: median over "
          "rounds of the loop's median step time / the hand loop's in the same round)")
    with initialize_config_module(config_module="ampctl.conf", version_base=None):
        for precision in precisions:
            ours = AmpctlLoop([*RECIPES[args.recipe], f"precision={precision}", f"device={args.device}",
                               f"train.clip_grad_norm={'null' if clip is None else clip}",
                               "train.lr.schedule=constant", "train.lr.warmup_steps=0"])
            device = ours.policy.device
            hand = HandWrittenLoop(ours, DTYPES[precision], ours.state.scaler.kind != "none", clip, compiled=False)
            on_ours = HandStepOnAmpctlState(ours, DTYPES[precision], ours.state.scaler.kind != "none", clip)
            loops = {"hand-written": hand, "ampctl": ours, "hand on ampctl's": on_ours,
                     **_frameworks(ours, precision, clip)}
            for loop in loops.values():
                timed_steps(loop, args.warmup_steps, device)
            medians = dict(zip(loops, rotating_rounds(list(loops.values()), args.rounds, args.steps_per_round,
                                                      device)))
            ours.policy.__exit__(None, None, None)
            print(f"{precision}:")
            for name, ms in medians.items():
                ratios = [a / b for a, b in zip(ms, medians["hand-written"])]
                q1, median, q3 = statistics.quantiles(ratios, n=4)
                print(f"  {name:<17}{statistics.median(ms):>8.2f} ms  {median:6.3f}x the hand loop  "
                      f"(quartiles {q1:.3f}x .. {q3:.3f}x)")


if __name__ == "__main__":
    main()
