"""What a run leaves behind, as an object: rank 0's Recorder speaks and writes the run directory (metrics,
console, checkpoints, value ranges, summary); every other rank gets a NoRecorder, whose verbs do nothing.
The run calls the same verbs on either, instead of asking which rank it is at every turn."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from omegaconf import DictConfig, OmegaConf

from ampctl import io, machine_load, run_files
from ampctl.engine.telemetry import JsonlSink, Sink
from ampctl.runner import identity
from ampctl.runner.checkpointing import checkpoint_files
from ampctl.runner.identity import RunIdentity
from ampctl.runner.reporting.console import make_console_sink
from ampctl.runner.reporting.scale_story import ScaleStory

if TYPE_CHECKING:  # annotations only: the state's class is the engine's, the diagnosis the guard's replay's
    from ampctl.engine.loop import TrainState
    from ampctl.runner.guarding.diagnose import Diagnosis

log = logging.getLogger("ampctl.train")


class Recorder:
    """Rank 0's record of the run (the loss it records is the mean over ranks). What it says is printed and
    logged: into train.log, through Hydra's job logging (the file only), or, for a run resumed from another
    directory, through a handler of its own on the run's train.log (appended: one log per run)."""

    def __init__(self, run_dir: Path, echo: Callable[[str], None]) -> None:
        self.run_dir = run_dir
        self._print = echo
        self.trackers: Any = None  # runner/trackers/'s Trackers, once start_trackers made them
        self.identity: Optional[RunIdentity] = None  # the run's identity.json, once claim() read or wrote it
        self.scale_story: Optional[ScaleStory] = None  # the loss scale's story, told as the run goes

    def echo(self, line: str) -> None:
        self._print(line)
        log.info(line)

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """The run directory held for this run while it lives (runner/ownership.py), its log lines in its
        train.log."""
        from ampctl.runner.ownership import holding

        with holding(self.run_dir), _logging_into(self.run_dir / run_files.TRAIN_LOG):
            try:
                yield
            finally:
                if self.trackers is not None:
                    self.trackers.fail()  # a run that ended without its summary (finished ones are left as they are)

    def claim(self, cfg: DictConfig, choices: dict[str, str]) -> Optional[RunIdentity]:
        """The run's identity: its identity.json when the directory holds this run already (a resume), else a new
        one, written before any record."""
        self.identity = identity.own_or_create(self.run_dir, cfg, choices)
        return self.identity

    def open(self, resumed_at: Optional[int]) -> None:
        """Create the run directory; resuming at a step, set aside what the directory holds past it."""
        from ampctl.runner.ownership import start_timeline_at

        self.run_dir.mkdir(parents=True, exist_ok=True)
        stale = checkpoint_files.remove_stale_files(self.run_dir)
        if stale:
            self.echo(f"removed {len(stale)} temporary file(s) a killed write left: {', '.join(p.name for p in stale)}")
        if resumed_at is not None:
            for line in start_timeline_at(self.run_dir, resumed_at):
                self.echo(f"resume: {line}")

    def record_config(self, cfg: DictConfig) -> None:
        """A resumed run's config (the checkpoint's, with the safe changes) as Hydra's .hydra/config.yaml of
        its run directory, so that the file says what runs now (Hydra wrote the composed one, or none)."""
        hydra_dir = self.run_dir / ".hydra"
        if hydra_dir.is_dir():
            io.atomic_write_text(hydra_dir / "config.yaml", OmegaConf.to_yaml(cfg))

    def set_aside_rows_without_checkpoint(self) -> list[Path]:
        from ampctl.runner.ownership import set_aside_rows_without_checkpoint

        return set_aside_rows_without_checkpoint(self.run_dir)

    def start_trackers(self, chosen: dict[str, Any], cfg: DictConfig, resumed_at: Optional[int],
                       after_steps: int) -> None:
        """The experiment trackers the plan checked ({name: (class, typed options)}), started with the resolved
        config after this process's first `after_steps` steps (the CPU memory profiler's window: runner/trackers/
        says why)."""
        if not chosen:
            return
        from ampctl.runner.trackers import Trackers

        self.trackers = Trackers(chosen, cfg, self.run_dir, resumed_at, after_steps)

    def sinks(self, console_mode: Any, total_steps: int, tokens: bool,
              peak_memory: Callable[[], Optional[int]], scaled: bool = True) -> list[Sink]:
        console = make_console_sink(console_mode, total_steps, tokens, peak_memory, scaled)
        self.console = console  # what a log adds to the next line (the experts' load) goes to it
        # before the console: a log interval's skips and scale changes are said before its step's line
        self.scale_story = ScaleStory(self.echo)
        return [JsonlSink(self.run_dir / run_files.METRICS), *([self.trackers] if self.trackers is not None else []),
                self.scale_story, *([console] if console is not None else [])]

    def record_eval(self, row: dict[str, Any], line: str) -> None:
        """An evaluation: a row of evals.jsonl, the trackers' eval/<metric>, a line said."""

        with (self.run_dir / run_files.EVALS).open("a", encoding="utf-8") as f:
            f.write(io.dumps(row) + "\n")
        if self.trackers is not None:
            self.trackers.write_eval(row)
        self.echo(line)

    def record_layer_errors(self, row: dict[str, Any]) -> None:
        """train.diff.every's measurement, written to diffs.jsonl already: to the trackers as diff/... scalars."""
        if self.trackers is not None:
            self.trackers.write_layer_errors(row)

    def blocks_log(self, state: TrainState, every: Optional[int]):
        """telemetry.blocks_every's block scales (blocks.jsonl, and the trackers' blocks/...), or None."""
        if not every:
            return None
        from ampctl.analysis.block_scales import BlocksLog

        def written(row: dict[str, Any]) -> None:
            if self.trackers is not None:
                self.trackers.write_block_scales(row)

        return BlocksLog(state.model, every, self.run_dir / run_files.BLOCKS, written)

    def experts_log(self, state: TrainState, every: int):
        """A mixture of experts' load (experts.jsonl, the trackers' experts/..., the live line), or None."""
        from ampctl.analysis.expert_load import ExpertLoadLog

        def written(row: dict[str, Any]) -> None:
            if self.trackers is not None:
                self.trackers.write_expert_load(row)

        def shown(text: str) -> None:
            if getattr(self, "console", None) is not None:
                self.console.notes["load"] = text

        return ExpertLoadLog(state.model, every, self.run_dir / run_files.EXPERTS, written, shown) or None

    def ranges_log(self, state: TrainState, device: Any, every: Optional[int]):
        """telemetry.ranges_every's per-layer value ranges (ranges.jsonl), or None."""
        if not every:
            return None
        from ampctl.analysis.ranges import RangesLog

        return RangesLog(state.model, state.scaler, device, every, self.run_dir / run_files.RANGES)

    def explain_stop(self, reason: str, diagnosis: "Diagnosis", why_not_escalated: Optional[str]) -> str:
        """A guard stopped the run: its replay's diagnosis written (diagnosis.json); the stop's message, with why it
        did not escalate where it would have (guard.on_trip=escalate)."""
        io.write_json(self.run_dir / run_files.DIAGNOSIS, diagnosis.to_json())
        not_escalated = f" Not escalated: {why_not_escalated}." if why_not_escalated else ""
        return f"{reason}. {diagnosis.summary}.{not_escalated} Written to {self.run_dir / run_files.DIAGNOSIS}"

    def write_summary(self, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        from ampctl.runner.ownership import set_aside_unreadable_rows

        for line in set_aside_unreadable_rows(self.run_dir):
            self.echo(f"warning: {line} (the rows around them are whole and kept)")
        summary = build()
        io.write_json(self.run_dir / run_files.SUMMARY, summary)
        if self.trackers is not None:
            self.trackers.finish(summary)
        story = self.scale_story.summary(summary.get("final_loss_scale")) if self.scale_story is not None else None
        if story is not None:
            self.echo(story)
        self.echo(final_line(summary, self.run_dir))
        if self.every_step_skipped(summary) and self.every_loss_nonfinite() is None:
            steps = summary["steps"]
            self.echo(f"warning: every step was skipped ({steps} of {steps}: the gradients were never finite at the "
                      "loss scale): the weights never changed; lower scaler.init_scale, or see `ampctl inspect` for "
                      "where the values overflow")
        return summary

    @staticmethod
    def every_step_skipped(summary: dict[str, Any]) -> bool:
        steps = summary.get("steps")
        return bool(steps) and summary.get("skipped_total") == steps

    def every_loss_nonfinite(self) -> Optional[str]:
        """Why a run whose every step was skipped for a non-finite loss failed, or None: the loss itself (the forward
        pass, before any scaling) is what no loss scale reaches, so backing off never helps; its gradients not
        finite at the scale is the scale's to fix (a warning)."""
        story = self.scale_story
        if story is None or not story.skipped or story.nonfinite_losses != story.skipped:
            return None
        return (f"every step was skipped ({story.skipped} of {story.skipped}) and the weights never changed: the loss "
                "itself was not finite at every step, before any loss scaling, which no loss scale absorbs: the "
                "forward pass overflows (see `ampctl inspect` for activations beyond the format's range; "
                "precision.rules can keep those layers in fp32) or the data holds NaN or inf")


class NoRecorder(Recorder):
    """Every other rank: silent, writes nothing (its errors still raise)."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir, lambda _message: None)

    def echo(self, line: str) -> None:
        pass

    def holding(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def open(self, resumed_at: Optional[int]) -> None:
        pass

    def record_config(self, cfg: DictConfig) -> None:
        pass

    def claim(self, cfg: DictConfig, choices: dict[str, str]) -> Optional[RunIdentity]:
        return None  # rank 0's is broadcast

    def set_aside_rows_without_checkpoint(self) -> list[Path]:
        return []

    def start_trackers(self, chosen: dict[str, Any], cfg: DictConfig, resumed_at: Optional[int],
                       after_steps: int) -> None:
        pass

    def sinks(self, *_args: Any, **_kwargs: Any) -> list[Sink]:
        return []

    def record_eval(self, row: dict[str, Any], line: str) -> None:
        pass

    def ranges_log(self, *_args: Any):
        return None

    def blocks_log(self, *_args: Any):
        return None

    def experts_log(self, *_args: Any):
        return None

    def write_summary(self, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        return {"run_dir": str(self.run_dir)}


@contextlib.contextmanager
def _logging_into(path: Path) -> Iterator[None]:
    """Log lines into path, unless a handler (Hydra's job logging) writes there already."""
    target = str(path.resolve())
    handlers = logging.getLogger().handlers + log.handlers
    if any(getattr(h, "baseFilename", None) == target for h in handlers):
        yield
        return
    handler = logging.FileHandler(target, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    log.addHandler(handler)
    previous = log.level
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(previous)
        handler.close()


def final_line(summary: dict, run_dir: Path) -> str:
    rate = (f"{summary['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in summary
            else f"{summary['samples_per_s']:,.0f} samples/s")
    return (
        f"done: {io.count_of(summary['steps'], 'step')} | final loss {summary['final_loss']:.4f} | "
        # a mode without a loss scaler skips no step and has no scale to say
        + (f"skipped {summary['skipped_total']} | final scale {io.scale_label(summary['final_loss_scale'])} | "
           if summary.get("scaler") != "none" else "")
        + f"median {summary['median_step_time_ms']:.1f} ms/step, {rate}"
        + (f", {summary['achieved_tflops']:.3g} TFLOP/s = {summary['mfu']:.1%} MFU" if summary.get("mfu") else "")
        + (" (an emulation's speed, not the format's)" if summary.get("emulated") else "")
        + (f" | compiled in {summary['compile_s']:.1f} s (not in the step times)" if summary.get("compiled") else "")
        + (f" | escalated {len(summary['escalations'])}x: " + ", ".join(
            f"{layer} -> {run_in}" for row in summary["escalations"] for layer, run_in in row["raised"].items())
           if summary.get("escalations") else "")
        + (f" | the machine was busy ({machine_load.said(summary['others_cpu_cores'])}): its speed is not its own"
           if machine_load.busy(summary.get("others_cpu_cores")) else "")
        + f" | {run_dir / run_files.SUMMARY}"
    )
