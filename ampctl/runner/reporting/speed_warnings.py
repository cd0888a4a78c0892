"""What makes a run slower than it should be, said on log steps (when the records come back anyway): torch.compile
compiling again and again, and a step that waits on its data."""

from __future__ import annotations

import statistics
from typing import Optional

from ampctl.engine.compilation import CompileWatch
from ampctl.engine.telemetry import StepRecord

# Steps that wait this share of their time for batches (the median step of DATA_WAIT_STEPS past the warm-up) are
# said to wait on data: the device (or, on a CPU, the compute) idles that long while the input pipeline catches
# up. The median of several steps, so that a step the OS preempted in the middle of a fetch does not decide.
DATA_WAIT_SHARE = 0.10
DATA_WAIT_STEPS = 8


class SpeedWarnings:
    def __init__(self, timing_warmup_steps: int, compiling: CompileWatch, device_type: str) -> None:
        self.timing_warmup_steps, self.compiling, self.device_type = timing_warmup_steps, compiling, device_type
        self.recompiles_said = 0
        self.data_wait_said = False
        self._waits: list[StepRecord] = []  # timed steps not judged yet

    def check(self, fresh: list[StepRecord]) -> list[str]:
        """The warnings the records of the latest log interval(s) call for."""
        return self._recompiles() + self._data_wait(fresh)

    def _settled(self) -> int:
        """The last step of the warm-up: compilation and first-step allocations are expected until then."""
        compiles = self.compiling.compiles_at
        return max(self.timing_warmup_steps, compiles[0] if compiles else 0)

    def _recompiles(self) -> list[str]:
        """torch.compile compiling again after the warm-up steps (shapes or guards that change from step to
        step): said on the first log step that sees it, and again only when it has doubled."""
        settled = self._settled()
        late = self.compiling.recompiles_after(settled)
        if not late or len(late) < 2 * self.recompiles_said:
            return []
        self.recompiles_said = len(late)
        steps = sorted(set(late))
        return [f"torch.compile compiled {len(late)} more time(s) after step {settled} (at step "
                f"{', '.join(map(str, steps[:5]))}{', ...' if len(steps) > 5 else ''}): something the compiled code "
                "depends on changes from step to step (a shape, a Python value); those steps are left out of the "
                "timings; TORCH_LOGS=recompiles says what changed"]

    def _waited_ms(self, r: StepRecord) -> Optional[float]:
        """What a step waited for its batches. On a GPU, all its host time getting them: the device idles through
        it. On a CPU, only the time the loop's thread was idle: a batch it makes itself (the synthetic recipes'
        generation, a tokenizer in the loop) is the batch's own cost, compute the CPU does either way, not a wait
        on a pipeline, and a busy machine's preemptions inflate both alike."""
        return r.data_ms if self.device_type == "cuda" else r.data_idle_ms

    def _data_wait(self, fresh: list[StepRecord]) -> list[str]:
        """Said once, when DATA_WAIT_STEPS steps past the warm-up have come back and their median step waited
        DATA_WAIT_SHARE or more of its time for batches; the summary's data_wait_fraction has the run's share."""
        if self.data_wait_said:
            return []
        settled = self._settled()
        self._waits += [r for r in fresh if r.step > settled and self._waited_ms(r) is not None and r.step_time_ms > 0]
        if len(self._waits) < DATA_WAIT_STEPS:
            return []
        steps, self._waits = self._waits, []
        share = statistics.median(self._waited_ms(r) / r.step_time_ms for r in steps)  # type: ignore[operator]
        if share < DATA_WAIT_SHARE:
            return []
        self.data_wait_said = True
        idles = "the GPU idles" if self.device_type == "cuda" else "the training compute waits"
        data_ms = statistics.median(self._waited_ms(r) for r in steps)  # type: ignore[type-var]
        step_ms = statistics.median(r.step_time_ms for r in steps)
        return [f"steps {steps[0].step}-{steps[-1].step} waited for their batches {share:.0%} of the time (median "
                f"step: {data_ms:.2f} ms of {step_ms:.2f} ms): {idles} while the input pipeline catches up; give its "
                "DataLoader more workers (recipe.num_workers where the recipe has it) or prepare the batches on the "
                "device"]
