"""Which device a run uses, and what that device and this torch build can do. Feature-detected, not
version-checked, so the same code runs on torch 2.4 through the newest."""

from __future__ import annotations

import functools
import platform
import re
from pathlib import Path
from typing import Optional

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
        return flags_in_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def flags_in_cpuinfo(text: str) -> frozenset[str]:
    """The instruction-set flags /proc/cpuinfo lists for the first CPU: x86's `flags` line, ARM's `Features`."""
    for line in text.splitlines():
        name, colon, value = line.partition(":")
        if colon and name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


# the cpuinfo flags that give each half type's dot products in hardware, as people name them: x86's, and ARM's
# (FEAT_BF16's BFDOT/BFMMLA, SVE's bf16 forms; ARMv8.2's half-precision SIMD arithmetic)
HALF_INSTRUCTIONS_OF = {
    "x86": {"bfloat16": {"avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16"},
            "float16": {"avx512_fp16": "AVX512-FP16", "amx_fp16": "AMX-FP16"}},
    "arm": {"bfloat16": {"bf16": "ARM BF16", "svebf16": "SVE-BF16"},
            "float16": {"asimdhp": "ARM FP16 (asimdhp)"}},
}
# this machine's
HALF_INSTRUCTIONS = HALF_INSTRUCTIONS_OF["arm" if platform.machine().lower() in ("aarch64", "arm64") else "x86"]


def instructions_for(dtype: str, flags: frozenset[str]) -> list[str]:
    """The instruction sets this CPU reports for dtype's dot products (names, e.g. ["AVX512-BF16"])."""
    return [label for flag, label in HALF_INSTRUCTIONS[dtype].items() if flag in flags]


def instructions_wanted(dtype: str) -> str:
    return " or ".join(HALF_INSTRUCTIONS[dtype].values())


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
