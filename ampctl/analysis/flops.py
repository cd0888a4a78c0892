"""Model FLOPs per step and MFU: how close a run is to the hardware.

FLOPs are counted once, at start, by torch.utils.flop_counter over one forward and backward of the recipe's
model and loss on fake tensors: shapes only, nothing computed, nothing of the run touched (its RNG, its
model, its batch stream). They are model FLOPs, as MFU defines them (PaLM's appendix B): the recomputation
of activation checkpointing and the casts of a precision mode are not counted, so MFU compares modes on
the same work. One step = grad_accum_steps micro-batches of this process's batch.

MFU = achieved FLOP/s of one device / that device's dense peak for the dtype its matmuls run in. Peaks of
NVIDIA GPUs come from their datasheets (dense, no sparsity); on a CPU the peak is the best rate of the CPU probe
(analysis/cpu_speed.py, the figures every other use reads too). A run faster than its peak contradicts the probe:
the CPU is measured again, and an MFU above 100% is never reported.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from ampctl import io
from ampctl.analysis import cpu_figures, cpu_speed
from ampctl.engine import devices
from ampctl.engine.parallel import unsharded
from ampctl.engine.precision import converters
from ampctl.interrupt import raise_swallowed_signal, signal_raised
from ampctl.recipes.base import building_model
from ampctl.recipes.gpt import VOCAB_SIZE, GPTRecipe
from ampctl.recipes.mlp import MLPRecipe
from ampctl.recipes.moe import MoERecipe

# Dense TFLOP/s by datasheet, matched against torch.cuda.get_device_name() in this order (the first match).
# fp32 is the CUDA cores' rate (true fp32, TF32 off); fp8 is e4m3/e5m2 on FP8 tensor cores.
GPU_PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"float32": 66.9, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4, "float8": 1978.9}),
    ("H100 PCIe", {"float32": 51.2, "tf32": 378.0, "bfloat16": 756.0, "float16": 756.0, "float8": 1513.0}),
    ("H100 NVL", {"float32": 60.0, "tf32": 417.5, "bfloat16": 835.0, "float16": 835.0, "float8": 1670.5}),
    ("H100", {"float32": 66.9, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4, "float8": 1978.9}),  # SXM
    ("A100", {"float32": 19.5, "tf32": 156.0, "bfloat16": 312.0, "float16": 312.0}),
    ("L40S", {"float32": 91.6, "tf32": 183.0, "bfloat16": 362.05, "float16": 362.05, "float8": 733.0}),
    ("L4", {"float32": 30.3, "tf32": 60.0, "bfloat16": 121.0, "float16": 121.0, "float8": 242.5}),
    ("A10", {"float32": 31.2, "tf32": 62.5, "bfloat16": 125.0, "float16": 125.0}),
)

@dataclass
class Peak:
    tflops: Optional[float]
    source: str  # what the figure is: the datasheet row, or the measured matmul; why there is none


# A Ctrl-C inside the counter's optional import of triton comes out as an ImportError, and torch's line about a
# missing triton would come before the command's own
logging.getLogger("torch.utils.flop_counter").addFilter(lambda _record: not signal_raised())


def model_flops_per_step(recipe: Any, batch: Any, grad_accum_steps: int) -> int:
    """Forward + backward FLOPs of the recipe's model and loss on one optimizer step of this process.

    The model is built on the meta device, the batch is fake: libraries that check a tensor's values on the host
    (transformers' masks) know fake tensors and skip the check, where a meta tensor's .item() raises. Attention
    in its math form: the counter knows the fused CUDA kernels but not the CPU's, which would count as nothing."""
    # here, not with the module: the counter imports Triton where it is installed (0.15 s), and the built-in
    # recipes are counted by formula
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    raise_swallowed_signal()  # the counter imports triton where it can: a Ctrl-C inside that import is lost there
    with torch.device("meta"), building_model(recipe):
        model = recipe.build_model()
    with FakeTensorMode(allow_non_fake_inputs=True) as fake, sdpa_kernel(SDPBackend.MATH), _fake_tensor_quiet():
        fake_batch = io.map_tensors(batch, lambda t: fake.from_tensor(torch.empty_like(t, device="meta")))
        counter = FlopCounterMode(display=False)
        with counter:
            recipe.loss(model, fake_batch).backward()
    return int(counter.get_total_flops()) * grad_accum_steps


@contextlib.contextmanager
def _fake_tensor_quiet() -> Iterator[None]:
    """torch logs an op's failure on fake tensors with its traceback (a transformers MoE's grouped_mm in fp32) before
    it raises; the failure is the count's, said in one line in model_flops_source, not a traceback on the terminal."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def matmul_dtype(precision: Any) -> str:
    """The dtype the precision mode's matmuls run in, as the peak tables name it."""
    if precision.converter is not None:
        return converters.converter_class(precision.converter).matmul_dtype
    if precision.autocast or precision.cast_model:
        return precision.dtype.name
    return "tf32" if precision.tf32 else "float32"


def device_peak(device: torch.device, dtype: str) -> Peak:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in GPU_PEAK_TFLOPS:
            if key in name:
                if dtype not in peaks:
                    return Peak(None, f"{name} has no {dtype} peak in ampctl's table")
                return Peak(peaks[dtype], f"{name} datasheet, dense {dtype}: {peaks[dtype]:g} TFLOP/s")
        return Peak(None, f"{name} is not in ampctl's peak table (analysis/flops.py)")
    if device.type == "cpu" and dtype in ("float32", *cpu_figures.HALF_TYPES):
        return cpu_peak(dtype, cpu_speed.measured())
    return Peak(None, f"no {dtype} peak known for {device.type}")


def cpu_peak(dtype: str, speed: cpu_figures.CpuSpeed) -> Peak:
    """The probe's best rate for dtype. Software-converted half matmuls have none: their rate depends on the
    shape (a small one ran 2.5x "faster" than a large one); nor has a probe taken on a busy machine."""
    tflops = speed.peak_tflops(dtype)
    if tflops is None:
        return Peak(None, f"{devices.cpu_model()}: {speed.why_no_peak(dtype)}")
    shape = "x".join(map(str, speed.speeds[dtype].shape))
    threads = io.count_of(speed.threads, "thread")
    return Peak(tflops, f"{devices.cpu_model()}, {shape} {dtype} matmuls measured on {threads} "
                        f"({speed.measured_at}): {tflops:.3g} TFLOP/s")


@dataclass
class StepFlops:
    """The model FLOPs of one optimizer step of this process, and the peak of its device they are measured
    against: counted once at start, used by every record (live view, metrics.jsonl) and the summary."""

    per_step: Optional[int]
    source: str  # how they were counted, or why they were not
    peak: Peak
    device: torch.device
    dtype: str  # the one the mode's matmuls run in (matmul_dtype)

    def summary(self, median_step_time_ms: Optional[float]) -> dict[str, Any]:
        achieved = (self.per_step / (median_step_time_ms / 1e3) / 1e12
                    if self.per_step and median_step_time_ms else None)
        source = self.peak.source
        if achieved is not None and self.peak.tflops and achieved > self.peak.tflops and self.device.type == "cpu":
            # the run contradicts the probe: measured on a busy machine, or before something changed
            remeasured = cpu_speed.remeasure_if_contradicted(self.dtype, achieved)
            if remeasured is not None:
                self.peak = cpu_peak(self.dtype, remeasured)
                source = self.peak.source + f" (measured again: this run's {achieved:.3g} TFLOP/s beat the cached peak)"
        mfu = achieved / self.peak.tflops if achieved is not None and self.peak.tflops else None
        if mfu is not None and mfu > 1:  # never a figure above 100%: the peak is the one that is wrong
            source += f"; this run's {achieved:.3g} TFLOP/s is above it, so no MFU is given"
            mfu = None
        return {
            "model_flops_per_step": self.per_step,
            "model_flops_source": self.source,
            "achieved_tflops": achieved,  # one device's, at the median step time
            "peak_tflops": self.peak.tflops,
            "peak_source": source,
            "mfu": mfu,
        }


def mlp_flops(recipe: MLPRecipe, batch: Any) -> int:
    """The built-in MLP's matmuls: forward, weight gradient and input gradient (none for the first layer,
    whose input is the batch), 2 FLOPs per multiply-add each."""
    rows = batch[0].shape[0]
    widths = [recipe.in_features, *[recipe.hidden] * recipe.depth, recipe.num_classes]
    layers = [2 * rows * n_in * n_out for n_in, n_out in zip(widths, widths[1:])]
    return 2 * sum(layers) + sum(layers[1:])


def gpt_flops(recipe: GPTRecipe, batch: Any) -> int:
    """The built-in GPT's matmuls, forward and backward (3x forward: every input needs its gradient past the
    embeddings): per token, 2 x (qkv 3d^2 + proj d^2 + mlp 8d^2) per block and the tied head's 2dV; attention's
    two batched matmuls in their math form, over every (query, key) pair, 4 B T^2 d per block."""
    batch_size, tokens = batch[0].shape
    d = recipe.d_model
    per_token = recipe.n_layers * 2 * 12 * d * d + 2 * d * VOCAB_SIZE
    attention = recipe.n_layers * 4 * batch_size * tokens * tokens * d
    return 3 * (batch_size * tokens * per_token + attention)


def moe_flops(recipe: MoERecipe, batch: Any) -> int:
    """The MoE recipe's matmuls as gpt_flops counts the GPT's, its MLPs replaced: per token and block, the router's
    2dE and the k experts it chose, each 3 matmuls of 2dh (SwiGLU), and the shared expert's 2 x 2d(h x shared). The
    activated parameters, not all the experts': MFU is the work a step did (6 x active params x tokens, as MoE
    papers count it). torch.utils.flop_counter has no formula for grouped_mm: the test counts the loop over experts."""
    batch_size, tokens = batch[0].shape
    d, h = recipe.d_model, recipe.expert_hidden
    experts = recipe.top_k * 3 * 2 * d * h + 2 * 2 * d * h * recipe.shared_experts  # those a token goes through
    block = 2 * 4 * d * d + 2 * d * recipe.experts + experts
    per_token = recipe.n_layers * block + 2 * d * VOCAB_SIZE
    attention = recipe.n_layers * 4 * batch_size * tokens * tokens * d
    return 3 * (batch_size * tokens * per_token + attention)


# The built-in recipes' FLOPs by formula, equal to torch.utils.flop_counter's (tests/unit/test_flops.py), by exact
# class: the counter's first use imports Dynamo (every TorchDispatchMode does), 2-5 s of a run's start here. A
# subclass or a copy of a built-in recipe may change its model, and is counted.
FORMULAS: dict[type, Callable[[Any, Any], int]] = {MLPRecipe: mlp_flops, GPTRecipe: gpt_flops,
                                                   MoERecipe: moe_flops}


def count(recipe: Any, device: torch.device, precision: Any, seed: int, grad_accum_steps: int) -> StepFlops:
    """StepFlops for this run; a recipe the counter cannot trace gets none (said in source), the run goes on."""
    try:
        batch = next(iter(recipe.batches(device, seed)))  # a stream of its own: the run's is not touched
        formula = FORMULAS.get(type(unsharded(recipe)))
        if formula is not None:
            per_step: Optional[int] = formula(unsharded(recipe), batch) * grad_accum_steps
            source = f"{formula.__name__}: the recipe's matmuls by formula (torch.utils.flop_counter's count)"
        else:
            per_step = model_flops_per_step(recipe, batch, grad_accum_steps)
            source = "torch.utils.flop_counter, forward + backward on fake tensors"
    except Exception as exc:  # noqa: BLE001 - no figure is the answer for any failure to trace
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        per_step, source = None, f"not counted: {type(exc).__name__}: {reason}"
    dtype = matmul_dtype(precision)
    return StepFlops(per_step, source, device_peak(device, dtype), device, dtype)
