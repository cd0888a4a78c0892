"""`python -m tests.support.fp8_anywhere ARGS`: `ampctl ARGS` with precision=fp8's one check a CPU fails (FP8 tensor
cores) lifted, for the processes a test starts (torchrun's ranks), as the fp8_tensor_cores fixture lifts it in the
test's own (torch._scaled_mm has a CPU kernel: the same torchao layers run here, slowly)."""

from ampctl.cli import main
from ampctl.engine.precision import fp8_torchao

fp8_torchao.unsupported_reason = lambda _device: None

if __name__ == "__main__":
    main()
