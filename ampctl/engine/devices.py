"""Which device a run uses, and what that device and this torch build can do. Feature-detected, not
version-checked, so the same code runs on torch 2.4 through the newest."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from ampctl.errors import UnsupportedError


def resolve_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise UnsupportedError(
            f"device=cuda but no CUDA device is visible to torch {torch.__version__} "
            f"(built with CUDA {torch.version.cuda}); use device=cpu or device=auto"
        )
    return torch.device(choice)


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()


@functools.lru_cache(maxsize=None)
def autocast_works(device_type: str, dtype: torch.dtype) -> bool:
    """Does torch.autocast(device_type, dtype) actually run a matmul in dtype here?"""
    try:
        a = torch.ones(2, 2, device=device_type)
        with torch.autocast(device_type, dtype=dtype):
            return torch.mm(a, a).dtype == dtype
    except (RuntimeError, AssertionError):
        return False


def cpu_grad_scaler_available() -> bool:
    try:
        torch.amp.GradScaler("cpu")
        return True
    except (AttributeError, RuntimeError, TypeError):
        return False


def cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def has_tf32(device: torch.device) -> bool:
    return device.type == "cuda" and cuda_capability(device) >= (8, 0)


def has_native_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        try:
            return torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # torch < 2.3 has no including_emulation and reports native support only
            return torch.cuda.is_bf16_supported()
    return autocast_works("cpu", torch.bfloat16)


# A half type "runs at speed" on a CPU when its autocast matmul takes at most this many times fp32's time.
# Measured: AVX512-BF16 EPYC, bf16 ~0.5x; AVX2-only EPYC, bf16 ~16x and fp16 ~20x (oneDNN converts in software).
SLOW_FACTOR = 1.5
_BENCH_SIZE, _BENCH_REPEATS = 256, 5


def cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "ampctl" / "cpu_matmul_speed.json"


def machine_key() -> str:
    """What decides the result: the CPU, its instruction sets, torch (oneDNN's kernels) and the threads."""
    isa = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "sse4", "asimd", "sve", "bf16", "fp16")))
    return f"{cpu_model()}|{platform.machine()}|{','.join(isa)}|torch {torch.__version__}|{torch.get_num_threads()} threads"


def matmul_times(dtype: Optional[torch.dtype], size: int = _BENCH_SIZE, repeats: int = _BENCH_REPEATS,
                 budget_s: float = 0.0) -> list[float]:
    """Seconds of each of at least `repeats` size x size matmuls on the CPU (as many more as fit in budget_s),
    in fp32 (dtype None) or under autocast(dtype), after a warm-up."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=gen) for _ in range(2))
    autocast = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
    times: list[float] = []
    with autocast:
        torch.mm(a, b)  # warm-up: oneDNN picks and prepares its kernel
        while len(times) < repeats or sum(times) < budget_s:
            start = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - start)
    return times


def _time_matmul(dtype: Optional[torch.dtype]) -> float:
    """Median seconds of a 256x256 matmul on the CPU, in fp32 (dtype None) or under autocast(dtype)."""
    return statistics.median(matmul_times(dtype))


def cached_measurement(name: str, measure: Callable[[], float]) -> float:
    """measure(), once per machine (machine_key) and name, kept in ~/.cache/ampctl: a read-only home measures
    again next time."""
    path, key = cache_path(), machine_key()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if isinstance(cached.get(key), dict) and isinstance(cached[key].get(name), (int, float)):
        return float(cached[key][name])
    value = measure()
    cached.setdefault(key, {})[name] = value
    try:
        from ampctl import io

        path.parent.mkdir(parents=True, exist_ok=True)
        io.atomic_write_text(path, json.dumps(cached, indent=2) + "\n")
    except OSError:
        pass
    return value


@functools.lru_cache(maxsize=None)
def cpu_half_slowdown(dtype: torch.dtype) -> float:
    """How many times longer a matmul takes under CPU autocast(dtype) than in fp32 on this machine. Measured
    once (well under a second) and kept in ~/.cache/ampctl, keyed by CPU, instruction sets, torch version and
    threads: flags alone cannot tell a CPU that emulates bf16 in AVX512 from one that runs it natively."""
    if not autocast_works("cpu", dtype):
        return math.inf
    return cached_measurement(str(dtype).removeprefix("torch."),
                              lambda: _time_matmul(dtype) / _time_matmul(None))


def half_runs_at_speed(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether compute in this half type is not much slower than fp32 here: always on CUDA (refusals cover
    what a GPU lacks), on a CPU as measured."""
    return device.type != "cpu" or cpu_half_slowdown(dtype) <= SLOW_FACTOR


def has_fast_bf16_cpu() -> bool:
    """AMX or AVX512-BF16: the instruction sets that give bf16 dot products in hardware (a description of the
    CPU; decisions use the measured half_runs_at_speed)."""
    flags = cpu_flags()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def has_fast_fp16_cpu() -> bool:
    """AVX512-FP16 or AMX-FP16: the instruction sets that give fp16 dot products in hardware."""
    flags = cpu_flags()
    return "avx512_fp16" in flags or "amx_fp16" in flags


_CPU_ALLOCATION_FAILED = re.compile(r"DefaultCPUAllocator: can't allocate memory: you tried to allocate (\d+) bytes")


def out_of_memory(exc: BaseException) -> Optional[str]:
    """What ran out, in a few words, when exc is an allocation failure (CUDA's OutOfMemoryError, or the CPU
    allocator's RuntimeError); None for any other error."""
    if isinstance(exc, torch.OutOfMemoryError):
        return str(exc).split(". ")[0].strip()  # "CUDA out of memory. Tried to allocate 20.00 GiB"...
    match = _CPU_ALLOCATION_FAILED.search(str(exc)) if isinstance(exc, RuntimeError) else None
    if match:
        from ampctl.io import format_bytes

        return f"CPU out of memory: tried to allocate {format_bytes(int(match.group(1)))}"
    return None
