"""Kinds of CPU the probe can be told to assume (AMPCTL_ASSUME_CPU=<kind>; analysis/cpu_speed.py): what ampctl
decides from the CPU's figures is then that kind's, while the runs compute on this CPU. The test suite runs under
each, so that no expectation is one CPU's. A module of its own so that the command line checks the name without
importing torch."""

from __future__ import annotations

import os

from ampctl.errors import UsageError

ASSUME_ENV = "AMPCTL_ASSUME_CPU"
# kind -> (its instruction flags, each half type's autocast matmul time over fp32's), from the probe on such CPUs
ASSUMED_CPUS: dict[str, tuple[frozenset[str], dict[str, float]]] = {
    "avx2": (frozenset({"avx2", "fma"}), {"bfloat16": 30.0, "float16": 80.0}),  # EPYC Rome/Milan: both converted
    "avx512_bf16": (frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}),  # EPYC Genoa: bf16 at speed, fp16 not
                    {"bfloat16": 0.45, "float16": 60.0}),
    "amx": (frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16"}),
            {"bfloat16": 0.2, "float16": 0.25}),  # Xeon Sapphire Rapids and later: both at speed
}


def check_assumed() -> None:
    """Refuse an AMPCTL_ASSUME_CPU that names no kind of ASSUMED_CPUS (UsageError)."""
    kind = os.environ.get(ASSUME_ENV)
    if kind and kind not in ASSUMED_CPUS:
        raise UsageError(f"{ASSUME_ENV}={kind}: no such kind of CPU; choose one of {', '.join(ASSUMED_CPUS)}")
