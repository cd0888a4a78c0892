"""train.deterministic: the same config, the same bits, step by step (torch's reproducibility notes, as Lightning's
`Trainer(deterministic=True)`, torchtune's and Composer's flags do it).

torch's deterministic algorithms (an op that has none raises, said in one line by recipes/failures.py), cuDNN's
deterministic kernels without autotuning, and cuBLAS's fixed workspace (CUBLAS_WORKSPACE_CONFIG, which cuBLAS reads
when it makes its first handle: set here unless the environment sets it). Every random generator is seeded where the
state is built (engine/build.py); a DataLoader recipe's workers draw from generators of the seed alone
(recipes/images.py). All of it is put back when the run ends: a process of the Python API goes on."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

CUBLAS_WORKSPACE = ":4096:8"  # torch's documented setting for deterministic cuBLAS (CUDA >= 10.2)


@contextlib.contextmanager
def deterministic(enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    environ = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]
        if environ is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def described() -> str:
    """The start line's words for it."""
    return (f"deterministic: torch.use_deterministic_algorithms(True), cuDNN deterministic without autotuning, "
            f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG')}")
