"""One training run around fit(): a TrainingRun holds the run's parts (as torchtitan's Trainer holds its
components), made in named steps: find where it resumes, build, announce, train (with the checkpointer, the
guards and the agreement to stop), summarize. Rank 0 records through a Recorder, the other ranks through a
NoRecorder (runner/recorder.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from omegaconf import OmegaConf

from ampctl import machine_load, run_files
from ampctl.analysis import flops
from ampctl.analysis.memory.measure import TrainingPeak
from ampctl.conf import precision_schedule
from ampctl.conf.sweeps import stop_requested_of_this_job
from ampctl.engine import devices, host_memory
from ampctl.engine import parallel as parallelism
from ampctl.engine.build import build_state
from ampctl.engine.compilation import CompileWatch
from ampctl.engine.determinism import deterministic
from ampctl.engine.loop import FitHooks, StepSettings, TrainState, fit
from ampctl.engine.telemetry import StepRecord, Telemetry, read_metrics
from ampctl.errors import RunStopped, UsageError
from ampctl.interrupt import Interrupted, StopOnSignal
from ampctl.recipes.base import Recipe, build_recipe
from ampctl.recipes.failures import Context, recipe_errors
from ampctl.runner import eval_records
from ampctl.runner.checkpointing import checkpoint
from ampctl.runner.checkpointing.best_checkpoints import BestCheckpoints
from ampctl.runner.checkpointing.checkpointer import Checkpointer
from ampctl.runner.checkpointing.mirror import Mirror
from ampctl.runner.eval_records import RunEvaluation
from ampctl.runner.guarding.diagnose import replay, replay_to
from ampctl.runner.guarding.escalation import Escalate, Escalator, Stop
from ampctl.runner.guarding.guards import Guard, GuardStop
from ampctl.runner.layer_error_log import LayerErrorLog
from ampctl.runner.ownership import start_timeline_at
from ampctl.runner.plan import RunPlan, check_config, first_profiled
from ampctl.runner.profiling import StepProfiler
from ampctl.runner.recorder import NoRecorder, Recorder, log
from ampctl.runner.reporting.console import say
from ampctl.runner.reporting.run_account import announce, layer_table, summary_of
from ampctl.runner.reporting.speed_warnings import SpeedWarnings
from ampctl.runner.resume import Resume
from ampctl.runner.round_windows import RoundWindows
from ampctl.runner.watchdog import Watchdog


def run_training(plan: RunPlan, echo: Callable[[str], None] = say) -> dict:
    """Train as planned (runner/plan.py: checked there, not again), recording into plan.run_dir. Returns the
    summary. Raises UsageError for user mistakes, Interrupted after SIGINT/SIGTERM."""
    cfg, policy = plan.cfg, plan.policy
    threads_before = torch.get_num_threads()  # put back after: the Python API's process goes on
    if cfg.train.threads is not None:
        torch.set_num_threads(cfg.train.threads)
    parallel = parallelism.start(cfg, policy.device, policy.dtype if policy.precision.autocast else None)
    try:
        mine = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        if parallel.main_value(mine) != mine:  # e.g. resume=auto found another checkpoint on this rank
            raise UsageError(f"rank {parallel.rank} resolved a different config than rank 0 (resume={cfg.resume}): "
                             "every rank must see the same run directory and checkpoints")
        try:
            with deterministic(cfg.train.deterministic):
                summary = TrainingRun(plan, echo, parallel).train()
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            what = devices.out_of_memory(exc)
            if what is None:
                raise
            raise UsageError(f"{what} (recipe.batch_size={cfg.recipe.get('batch_size')}): lower "
                             "recipe.batch_size; `ampctl memory` estimates what fits") from None
        parallel.barrier()  # ranks leave together: none tears the group down while another still talks to it
        return summary
    finally:
        parallel.close()
        torch.set_num_threads(threads_before)


class TrainingRun:
    """One run's parts. Made before anything is written (where it resumes, the recorder, the recipe, the memory
    measurement, the FLOP count, the evaluation); train() builds the state, announces it, trains and writes the
    summary. The parts train() makes (state, telemetry, profiler, compiling) are attributes from then on."""

    state: TrainState
    telemetry: Telemetry
    profiler: StepProfiler
    compiling: CompileWatch

    def __init__(self, plan: RunPlan, echo: Callable[[str], None], parallel: parallelism.Parallel) -> None:
        cfg, policy = plan.cfg, plan.policy
        self.parallel = parallel
        self.policies: list = []  # every mode this process trains in (precision.schedule's, an escalation's)
        self._take_plan(plan)
        self.recorder = Recorder(self.resume.run_dir, echo) if parallel.is_main else NoRecorder(self.resume.run_dir)
        # a setting of the process (engine/host_memory.py), before the model is built: on a CPU, what each step
        # frees stays in malloc's heap rather than being faulted in again
        self.host_memory_held = (policy.device.type == "cpu" and cfg.train.hold_host_memory
                                 and host_memory.hold_freed_memory())
        self.recipe = self._rank_recipe()
        self.peak = TrainingPeak(policy.device)
        # On a CPU the memory profiler would record torch.compile's own work too: minutes, for a peak it distorts
        compiled_on_cpu = cfg.train.compile.enabled and policy.device.type == "cpu"
        measure_cpu = cfg.telemetry.profile_cpu_memory and not compiled_on_cpu
        self.measure_memory = parallel.is_main and (policy.device.type == "cuda" or measure_cpu)
        self.why_memory_not_measured = ("train.compile on a CPU" if compiled_on_cpu and cfg.telemetry.profile_cpu_memory
                                        else "")
        # the same window on every rank (rank 0 alone measures memory, over the first steps on a CPU); the plan
        # refused a window past the run's end
        self.first_profiled = first_profiled(cfg, policy.device, self.resume.step or 0)
        # model FLOPs of a step (counted on fake tensors) and the device's peak, for MFU in every record; before
        # the peak memory is measured, which the batch drawn for the count must not raise. On a recipe of its
        # own: counting calls its loss, and a user recipe's state (a call counter) must stay the run's.
        self.step_flops = flops.count(self._rank_recipe(), policy.device, policy.precision, cfg.train.seed,
                                      cfg.train.grad_accum_steps)
        # refuses a recipe without held-out batches, before anything is written
        self.evaluation = RunEvaluation(cfg, self.recipe, policy) if cfg.train.eval.every else None
        self.steps_began_at = time.time()  # set again when the steps begin
        self.load_at_start: Optional[machine_load.Sample] = None  # taken there too
        self.mirror: Optional[Mirror] = None  # train.checkpoint.mirror's uploader, once the run has its identity
        self.rebuilt_at: set[int] = set()  # the first steps after an escalation built the run again: not timed

    def train(self) -> dict:
        cfg, policy, recorder, resume = self.cfg, self.policy, self.recorder, self.resume
        with recorder.holding():  # no other run records into this directory while this one lives
            # the peak counts the model's build; a user recipe's mistake is one line naming it
            with policy, self.peak.measuring(enabled=self.measure_memory, why_not=self.why_memory_not_measured), \
                    recipe_errors(self.recipe, self._where):
                self.state = build_state(cfg, policy, self.recipe, self.parallel)
                resume.restore(self.state)
                if self.evaluation is not None and cfg.train.checkpoint.save_top_k:
                    # one held-out batch, first
                    self.evaluation.check_monitor(self.state.model, cfg.train.checkpoint.monitor)
                announce(self)
                recorder.identity = self.parallel.main_value(recorder.claim(cfg, self.choices))  # before any record
                self.mirror = self._mirror()
                # the trackers reached (and a resumed run's tracker ids read) before anything is set aside or written
                recorder.start_trackers(self.plan.trackers, cfg, resume.step, after_steps=self.peak.untimed_steps)
                recorder.open(resume.step)
                if self.mirror is not None and resume.step is not None:
                    self.mirror.start_timeline_at(resume.step)  # what the directory set aside, the mirror too
                if cfg.resume:
                    recorder.record_config(cfg)
                self.telemetry = self._telemetry()
                self.telemetry.skipped_total = resume.skipped_total
                self.profiler = StepProfiler(cfg.train.profile, self.first_profiled, self.state.step, recorder.run_dir,
                                             self.parallel.rank, policy.device, recorder.echo)
                self.profiler.watch(self.state.model, policy.layer_rows)  # what ran, layer by layer
                # torch.compile compiles in the first steps
                with CompileWatch(lambda: self.state.step + 1, enabled=cfg.train.compile.enabled) as self.compiling:
                    best = self._fit_to_the_end()
            # inside: the summary is written while the run directory is held, and ends the trackers' runs
            summary = recorder.write_summary(lambda: {
                **summary_of(self),
                **eval_records.summary_of(recorder.run_dir),
                **({"eval_best": best.best()} if best is not None and best.best() else {})})
        learned_nothing = recorder.every_loss_nonfinite() if recorder.every_step_skipped(summary) else None
        if learned_nothing is not None:  # recorded whole, and said as the failure it is (exit 1)
            raise RunStopped(learned_nothing)
        return summary

    def _rank_recipe(self) -> Recipe:
        """The recipe as this process sees it: built for the global batch, this rank's slice of it."""
        world = self.parallel.world_size
        recipe = build_recipe(parallelism.global_recipe_config(self.cfg.recipe, world, self.cfg.distributed.kind))
        return parallelism.RankShard(recipe, self.parallel.rank, world) if world > 1 else recipe

    def _telemetry(self) -> Telemetry:
        train, recipe = self.cfg.train, self.recipe
        per_step = train.grad_accum_steps * self.parallel.world_size  # throughput is the whole job's: every rank's
        tokens = None if recipe.tokens_per_batch is None else recipe.tokens_per_batch * per_step
        sinks = self.recorder.sinks(train.console, train.steps, tokens is not None, self.peak.bytes,
                                    scaled=self.state.scaler.kind != "none")
        # its device buffer holds one log interval: never more rows than the run has (log_every=10**9 is "at the end")
        log_every = min(train.log_every, train.steps)
        return Telemetry(self.policy.device, log_every, recipe.samples_per_batch * per_step, tokens, sinks,
                         self.step_flops.per_step, self.step_flops.peak.tflops)

    def _where(self) -> Context:
        """Where the run was, for the line of a recipe that raised."""
        state = getattr(self, "state", None)
        where = "building the model" if state is None else f"at step {state.step + 1}"
        half = None if self.policy.dtype == torch.float32 else self.policy.dtype
        return Context(where, self.policy.precision.name, half,
                       self.parallel.rank if self.parallel.world_size > 1 else None)

    def _fit(self) -> Checkpointer:
        """fit() with the checkpointer, the evaluations, the guards, the value-range log, the profiler and a stop
        on SIGINT/SIGTERM, to the run's end or to precision.schedule's next change (where it writes a checkpoint, as
        at the end). Returns its checkpointer (the last checkpoint, the run's best ones)."""
        cfg, state, telemetry, recorder, parallel = self.cfg, self.state, self.telemetry, self.recorder, self.parallel
        until = precision_schedule.next_change(cfg, state.step) or cfg.train.steps
        checks = LogStepChecks(self)
        checkpointer = Checkpointer(cfg, self.choices, state, telemetry, recorder,
                                    on_saved=self.mirror.upload if self.mirror is not None else None)
        windows = RoundWindows.from_env() if parallel.world_size == 1 else None  # compare's rounds: take turns
        hang_after_s = cfg.train.cluster.hang_after_s if parallel.is_main else None
        watchdog = Watchdog(recorder.run_dir, recorder.echo, hang_after_s)
        layer_errors = (LayerErrorLog(cfg, state, self.policy, self.recipe, recorder.run_dir)
                        if cfg.train.diff.every and parallel.is_main else None)

        def after_step(last: bool) -> None:
            watchdog.step_done(state.step)
            self.profiler.step()  # first: a profiled step ends where its timer mark is, before a checkpoint
            evaluated = (self.evaluation(state.step, state.model, telemetry, self.compiling, recorder, state.ema)
                         if self.evaluation is not None and self.evaluation.due(state.step, last) else None)
            self.peak.after_step()
            if layer_errors is not None and layer_errors.due(state.step):
                layer_errors.between_steps(state.step, telemetry, watchdog.pause, recorder)
            checks(telemetry.take_fresh())  # non-empty on log steps, when values came back from the device
            checkpointer(last, evaluated)
            if windows is not None and not last:
                with watchdog.pause():
                    windows.after_step(state.step, telemetry)
            watchdog.bookkeeping_done()

        ranges_log = recorder.ranges_log(state, self.policy.device, cfg.telemetry.ranges_every)
        blocks_log = recorder.blocks_log(state, cfg.telemetry.blocks_every)
        experts_log = recorder.experts_log(state, cfg.telemetry.experts_every
                                           or min(cfg.train.log_every, cfg.train.steps))  # null: every log step
        announce_stop = "after this step" if parallel.world_size == 1 else "at the next log step (all ranks together)"
        self.steps_began_at = time.time()  # a sweep's report tells from it which jobs overlapped
        self.load_at_start = machine_load.sample()  # what other processes take of the machine while it steps
        try:
            preempt = cfg.train.cluster.preempt_signal.value if cfg.train.cluster.preempt_signal else None
            with StopOnSignal(announce_stop if parallel.is_main else "", preempt, stop_requested_of_this_job()) \
                    as stop, self.profiler, watchdog:
                hooks = FitHooks(after_step=after_step,
                                 stop_requested=stop_agreement(parallel, stop, state, cfg.train.log_every))
                watches = [log.around for log in (ranges_log, blocks_log, experts_log) if log]
                if watches:
                    hooks.around_step = functools.partial(_all_around, watches)
                finished = fit(state, self.recipe, self.policy, self.settings, telemetry, until, cfg.train.seed,
                               hooks)
            checkpointer.writer.finish()  # every rank here together: the last async save agreed
        finally:
            telemetry.close()
            checkpointer.writer.close()  # a pending async save completes: the last checkpoint exists from here
        if not finished:
            # a rank that agreed to stop without a signal of its own (distributed) reports SIGTERM's code
            raise Interrupted(stop.signum or signal.SIGTERM, state.step,
                              str(checkpointer.last) if checkpointer.last else None)
        return checkpointer

    def _fit_to_the_end(self) -> Optional[BestCheckpoints]:
        """_fit(), switching at precision.schedule's changes; a guard's trip stops the run, its step replayed to
        name the layer, or (guard.on_trip=escalate) raises that layer's precision and trains again from the newest
        good checkpoint (runner/guarding/escalation.py). Returns the run's best checkpoints, if it keeps them."""
        recorder = self.recorder
        escalator = Escalator(self.cfg, recorder.run_dir, recorder.identity, check_config)
        try:
            while True:
                try:
                    checkpointer = self._fit()
                    if self.state.step >= self.cfg.train.steps:
                        return checkpointer.best
                    assert checkpointer.last is not None  # written at the change, as at an end
                    self._switch(checkpointer.last)
                except GuardStop as stop:
                    trip = stop.trip
                    if not self.parallel.is_main:
                        raise RunStopped(trip.reason) from None  # rank 0 replays and explains
                    recorder.echo(f"{'tripped' if escalator.enabled else 'stopped'}: {trip.reason}; replaying step "
                                  f"{trip.step} to find the layer...")
                    replayed = replay_to(self.cfg, self.policy, self.recipe, recorder.run_dir, trip.step)
                    diagnosis = replay(self.cfg, self.policy, self.recipe, recorder.run_dir, trip.step, trip.reason,
                                       replayed)
                    decision = escalator.decide(trip, diagnosis, replayed, self.plan, self.recipe)
                    if isinstance(decision, Stop):
                        raise RunStopped(recorder.explain_stop(
                            trip.reason, decision.diagnosis, decision.why_not if escalator.enabled else None)) from None
                    self._go_back(decision, escalator)
        finally:
            self._close_mirror()  # its uploads complete: a preempted machine's stop checkpoint is off it

    def _go_back(self, decision: Escalate, escalator: Escalator) -> None:
        """Train on from the escalation's new plan: what lies past its checkpoint set aside, and the run built again
        from the plan (its config with the raised layers, their policy, the checkpoint restored), as a run resumed
        there with those rules is."""
        escalation, recorder = decision.escalation, self.recorder
        for line in start_timeline_at(recorder.run_dir, escalation.step):
            log.info("escalation %d: %s", escalation.number, line)
        escalator.record(escalation)
        if self.mirror is not None:  # before training on: a pull must not take the abandoned timeline
            self.mirror.start_timeline_at(escalation.step)
        recorder.echo(escalation.line(escalator.most))
        recorder.record_config(decision.plan.cfg)
        self._rebuild(decision.plan)

    def _switch(self, checkpoint_path: Path) -> None:
        """precision.schedule's change after this step: the run built again in the change's mode from the
        checkpoint just written, as a run resumed from it is (bit for bit: test_precision_schedule.py)."""
        done = self.state.step
        segment = precision_schedule.segment_after(self.cfg, done)
        resume = Resume(self.recorder.run_dir, checkpoint_path, checkpoint.load(checkpoint_path, mmap=True))
        before = self.policy.precision.name
        self._rebuild(dataclasses.replace(self.plan, policy=check_config(self.cfg, done), resume=resume))
        self.recorder.echo(f"precision: {before} -> {segment.mode} after step {done} (precision.schedule at "
                           f"{segment.point}): the run built again in {segment.mode} from step {done}'s checkpoint")
        for line in layer_table(self.policy):
            self.recorder.echo(line)

    def _rebuild(self, plan: RunPlan) -> None:
        """The run built again from a new plan (an escalation's, a scheduled change's) and its checkpoint, as a
        process that resumes there with that plan builds it."""
        self._take_plan(plan)
        self.recipe = self._rank_recipe()  # as a resumed process's: a user recipe's own state starts again
        self.evaluation = (RunEvaluation(self.cfg, self.recipe, self.policy) if self.cfg.train.eval.every else None)
        self.step_flops = flops.count(self._rank_recipe(), self.policy.device, self.policy.precision,
                                      self.cfg.train.seed, self.cfg.train.grad_accum_steps)
        self.state = build_state(self.cfg, self.policy, self.recipe, self.parallel)
        self.resume.restore(self.state)
        self.telemetry = self._telemetry()
        self.telemetry.skipped_total = self.resume.skipped_total
        self.profiler.stop_profiling()  # its window is the first timeline's: profiled once
        self.rebuilt_at.add(self.state.step + 1)

    def _take_plan(self, plan: RunPlan) -> None:
        """The plan the run trains on from here: its start's, or an escalation's (the rest is built from it)."""
        self.plan, self.cfg, self.choices, self.policy, self.resume = plan, plan.cfg, plan.choices, plan.policy, \
            plan.resume
        self.policies.append(plan.policy)
        self.settings = StepSettings.of(plan.cfg.train)

    def _mirror(self) -> Optional[Mirror]:
        """train.checkpoint.mirror's uploader, on rank 0 (the one that writes whole files and the manifests)."""
        url = self.cfg.train.checkpoint.mirror
        if not url or not self.parallel.is_main:
            return None
        options = OmegaConf.to_container(self.cfg.train.checkpoint.mirror_options, resolve=True)
        mirror = Mirror(url, self.recorder.run_dir, self.recorder.echo, options)  # type: ignore[arg-type]
        mirror.claim()
        self.recorder.echo(f"mirror: each checkpoint also to {url} (train.checkpoint.mirror), its records with it")
        return mirror

    def _close_mirror(self) -> None:
        if self.mirror is None:
            return
        failed = self.mirror.close()
        if failed:
            self.recorder.echo(f"warning: {len(failed)} checkpoint(s) not mirrored to {self.mirror.url}: "
                               f"{', '.join(failed)} (each said when it failed); the local ones are whole")


class LogStepChecks:
    """On log steps, with the records that came back from the device anyway: the guards (a stop raises
    GuardStop), then what makes the run slower than it should be (recompiles, a wait on data), as warnings."""

    def __init__(self, run: TrainingRun) -> None:
        cfg, scaler = run.cfg, run.state.scaler
        min_scale = cfg.scaler.get("min_scale") if scaler.kind == "dynamic" else None
        self.guard = Guard(cfg.guard, scaler.can_skip, min_scale)
        metrics = run.recorder.run_dir / run_files.METRICS
        if metrics.is_file():  # the guards go on where the run was (a skip streak, the spike watch's window)
            self.guard.prime([r for r in read_metrics(metrics) if r.step <= run.state.step])
        self.speed = SpeedWarnings(cfg.train.timing_warmup_steps, run.compiling, run.peak.device.type)
        self.echo = run.recorder.echo

    def __call__(self, fresh: list[StepRecord]) -> None:
        if not fresh:
            return
        trip, warnings = self.guard.check(fresh)
        for message in warnings + self.speed.check(fresh):
            self.echo(f"warning: {message}")
        if trip:
            raise GuardStop(trip)


def stop_agreement(parallel: parallelism.Parallel, stop: StopOnSignal, state: TrainState,
                   log_every: int) -> Callable[[], bool]:
    """Whether to stop after this step. Every rank must stop after the same step, or the others wait in a
    collective: they agree on log steps, where the host reads from the device anyway."""
    if parallel.world_size == 1:
        return lambda: stop.requested
    return lambda: state.step % log_every == 0 and parallel.agree(stop.requested)


@contextlib.contextmanager
def _all_around(watches: list, step: int) -> Iterator[None]:
    """Each of the step's watches (telemetry.ranges_every's, telemetry.blocks_every's) around it, in order."""
    with contextlib.ExitStack() as stack:
        for around in watches:
            stack.enter_context(around(step))
        yield
