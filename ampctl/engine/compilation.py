"""torch.compile for every precision mode, and the account of what it cost.

Regional compilation: each block the recipe names (activation_checkpoint_blocks: a transformer block, a
ResNet bottleneck) is compiled on its own, as torchtitan compiles each TransformerBlock: identical blocks
share one compiled graph, so compile time does not grow with depth. A recipe that names no blocks has its
whole model compiled. `Module.compile()` works in place, so parameter names, hooks, state dicts and
checkpoints stay the model's own (a compiled run resumes eagerly and the other way round). It is applied
after the precision mode's converters and activation checkpointing, before DDP/FSDP wrap the model.

CompileWatch times Dynamo's compilations (its start/end callbacks, outermost only, the lazily compiled
backward included), so that compile time is reported on its own, and counts the compilations after the
first steps: shapes or guards that change every step recompile every step, which is reported rather than
left as a slow run.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Iterator

import torch
from torch import nn

# torch.compile's modes that capture CUDA graphs (Inductor's cudagraph trees); max-autotune-no-cudagraphs does not
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def compile_model(model: nn.Module, blocks: list[nn.Module], mode: str, profiled: bool = False) -> int:
    """Compile each block in place, or the whole model when there are none; the number of regions compiled.
    profiled: the run is profiled (train.profile), so Inductor's C++ kernels for the CPU each open a profiler
    range named after the kernel; without it a CPU trace shows their time as nobody's."""
    # A CUDA build of torch on a machine without CUDA says so, as a warning, when inductor first builds C++
    # kernels for the CPU: true, and beside the point of a CPU run.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    if profiled:
        import torch._inductor.config

        torch._inductor.config.cpp.enable_kernel_profile = True
    regions = blocks or [model]
    for region in regions:
        region.compile(mode=mode)
    if mode in CUDA_GRAPH_MODES:
        model.register_forward_pre_hook(_a_new_step_of_cuda_graphs)
    return len(regions)


def _a_new_step_of_cuda_graphs(_module: nn.Module, _args: Any) -> None:
    """Each forward of the model begins a new step of the CUDA graphs: the graphs replay into the same output
    buffers, and without this mark the cudagraph trees cannot tell a new step (a train step after an evaluation's
    forwards under no_grad, each compiled block's output read by the next) from a reuse of outputs still alive
    ("accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run": an H100, GPT-2 with
    compile_mode=reduce-overhead, at its first evaluation). torch's advice: mark before each model invocation."""
    torch.compiler.cudagraph_mark_step_begin()


class CompileWatch:
    """Wall time spent compiling and the number of compilations, each tagged with the step it happened in."""

    def __init__(self, step_under_way: Callable[[], int], enabled: bool = True) -> None:
        # disabled for a run that compiles nothing: importing Dynamo to watch it costs ~1.7 s a process
        self.enabled = enabled
        self.seconds = 0.0
        self.compiles_at: list[int] = []  # the step during which each compilation ran (0: before the first)
        self._step_under_way = step_under_way
        self._started: float | None = None
        self._callbacks: tuple[Any, Any] | None = None

    def __enter__(self) -> "CompileWatch":
        if not self.enabled:
            return self
        from torch._dynamo.callback import callback_handler

        # called with a CallbackArgs in recent torch, with nothing in older ones
        start = lambda *_args: self._start()  # noqa: E731
        end = lambda *_args: self._end()  # noqa: E731
        callback_handler.register_start_callback(start)
        callback_handler.register_end_callback(end)
        self._callbacks = (start, end)
        return self

    def __exit__(self, *_exc: Any) -> None:
        if self._callbacks is not None:
            from torch._dynamo.callback import callback_handler

            start, end = self._callbacks
            callback_handler.remove_start_callback(start)
            callback_handler.remove_end_callback(end)
            self._callbacks = None

    def _start(self) -> None:
        self._started = time.perf_counter()

    def _end(self) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None
        self.compiles_at.append(self._step_under_way())

    @contextlib.contextmanager
    def outside_steps(self) -> Iterator[None]:
        """Work between steps (an evaluation: no grad, eval mode) compiles graphs of its own: their time counts as
        compile time, but they are no step's compilation."""
        compiles = len(self.compiles_at)
        try:
            yield
        finally:
            del self.compiles_at[compiles:]

    def recompiles_after(self, step: int) -> list[int]:
        """The steps after `step` that compiled: graphs that should have been compiled by then were not reused."""
        return [s for s in self.compiles_at if s > step]
