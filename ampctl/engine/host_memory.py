"""glibc's malloc told to keep what a CPU training step frees, rather than hand it back to the kernel and fault it
in again on the next step.

By default glibc serves a block above its (adaptive) mmap threshold with a fresh mmap and trims the heap's top
above 128 KiB: a step's activations and gradients, freed at its end and allocated again in the next, then cost
thousands of minor page faults a step, each page zeroed by the kernel (about 4,000 a step for the small GPT of
benchmarks/framework_overhead.py in bf16, 30,000 for the d_model 768 one). mallopt with a fixed mmap threshold
at glibc's ceiling and no trimming makes the heap keep them: the process's memory stays at its peak, which a
training process reaches every step anyway. It is what torch's own CPU launcher (torch.backends.xeon.run_cpu)
gets by preloading jemalloc with decay off; here without a preload or a restart. benchmarks/host_memory.py
measures it (faults a step and the step's time, with and without, in alternating processes).

A setting of the process: once made it stays for the process's life (glibc has no call to return to its adaptive
threshold), which is why train.hold_host_memory can turn it off and the run records whether it was made.
"""

from __future__ import annotations

import ctypes
import platform

# mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's ceiling on a 64-bit machine: blocks above it still map and unmap
NEVER_TRIM = 2**31 - 1  # mallopt takes an int


def glibc() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def hold_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed blocks below MMAP_THRESHOLD_MAX in the heap. False where the C library is
    not glibc (macOS, musl) or it refused: nothing changed."""
    if not glibc():
        return False
    libc = ctypes.CDLL(None)  # the process's own C library
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
