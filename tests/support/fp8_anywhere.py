"""FP8 training on a CPU, for the tests of its wiring (conversion, size filter, bf16 autocast, checkpoints, FSDP):
precision=fp8's one check a CPU fails (FP8 tensor cores) lifted, and torch's own CPU kernel for the FP8 matmul.

`python -m tests.support.fp8_anywhere ARGS` is `ampctl ARGS` so, for the processes a test starts (torchrun's
ranks); the fp8_tensor_cores fixture (tests/integration/test_fp8_torchao.py) does the same in the test's own."""

import torch

from ampctl.cli import main
from ampctl.engine.precision import fp8_torchao


def torchs_own_fp8_matmul() -> None:
    """torch._scaled_mm on a CPU goes to oneDNN's FP8 matmul, a reference implementation on CPUs without FP8 units:
    ~120 ms for a 128x64x256 product, against ~0.2 ms for torch's own CPU kernel, which it takes with oneDNN off.
    Their results are bit-identical (tests/unit/test_fp8_cpu_kernel.py checks it on every run). Only the FP8 tests
    turn oneDNN off: it is also bf16's fast CPU matmul."""
    torch.backends.mkldnn.enabled = False


if __name__ == "__main__":
    fp8_torchao.unsupported_reason = lambda _device: None
    torchs_own_fp8_matmul()
    main()
