"""How fast this CPU multiplies matrices in fp32 and under autocast(bfloat16 / float16), measured and kept: the one
set of figures (cpu_figures.py) behind `ampctl list`, the start warnings, compare's default modes and the MFU peak
on a CPU.

The CPU's flags decide where they can: a half type without instructions for its dot products (AVX512-BF16 or
AMX-BF16 for bfloat16) runs on fp32's after a conversion, never faster than fp32, and is timed only on a small
screening matmul, for the figure its slowdown is said with. Where it has them (oneDNN may use them or convert in
software, as torch's build decides), or the flags cannot be read, the type is measured at full size, in a way a
busy machine cannot fool:
- matmuls of real work's size (PROBE_SHAPE, a transformer's linear layer at a thousand tokens), under autocast
  as a run computes them, casts included;
- fp32 and each half type in alternating rounds whose order rotates, so that load falls on all of them alike;
- each type's best trial over a time floor: load makes a trial slower, never faster;
- each trial's share of the cores (its CPU time over its wall time and threads): a probe whose best fp32 trial
  had less than BUSY_SHARE of them was measured on a busy machine; its verdicts stand (load fell on every type
  alike) but its rates are no peak, and it is measured again later (BUSY_RETRY_S);
- a slow type's slowdown is said as a bound its rounds support (`more than 20x`): load moves the point figure;
- a half type the CPU has instructions for that measures slow is measured again, longer, and never described
  as lacking them.
Measured once per machine (CPU, instruction sets, torch, threads), kept in ~/.cache/ampctl/cpu_speed.json (one
process measures at a time, under a lock; the others wait and read), and measured again on demand (`ampctl list
--remeasure`) or when a run contradicts it (a run faster than the peak).

`AMPCTL_ASSUME_CPU=<kind>` answers as another kind of CPU would (ASSUMED_CPUS: its instruction sets and its half
types' matmul times against fp32, as measured on such machines), with this CPU's fp32 as measured: what ampctl
decides from the figures (list, warnings, compare's modes, advise's candidates) is then that CPU's, while the runs
compute on this one. The test suite runs under each kind so that no expectation is one CPU's.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from ampctl.analysis.assumed_cpus import ASSUME_ENV, ASSUMED_CPUS, check_assumed
from ampctl.analysis.cpu_figures import FP32, HALF_TYPES, CpuSpeed, DtypeSpeed, Shape
from ampctl.engine import devices
from ampctl.engine.devices import instructions_for

PROBE_SHAPE = (1024, 1024, 1024)  # (m, k, n): ~2.1 GFLOP, 7-15 ms in fp32 on two cores of these machines
SCREEN_SHAPE = (512, 512, 512)  # large enough that a trial outlasts a time slice of a busy scheduler
SCREEN_ROUNDS = 5
MIN_ROUNDS, FLOOR_S, CAP_S = 7, 1.0, 10.0  # per attempt: rounds, seconds of trials at least, at most
ATTEMPTS = 3  # a half type with instructions that measures slow: measured up to this many times in all
BUSY_RETRY_S = 600.0  # a busy machine's figures are measured again after this long


@dataclass(frozen=True)
class Trial:
    seconds: float  # wall time of one matmul
    core_share: float  # its CPU time / (wall time x threads): ~1 on an idle machine, 0.5 when another job has half


Timer = Callable[[Shape, str], Trial]  # one warm matmul of this shape in this dtype


# --- measuring ------------------------------------------------------------------------------------------------


class MatmulTimer:
    """Times one CPU matmul of a shape in fp32 or under autocast(dtype); the first call of each (shape, dtype) is
    a warm-up (oneDNN picks and packs its kernel) and is not returned."""

    def __init__(self) -> None:
        self._inputs: dict[Shape, tuple[torch.Tensor, torch.Tensor]] = {}
        self._warm: set[tuple[Shape, str]] = set()

    def __call__(self, shape: Shape, dtype: str) -> Trial:
        if shape not in self._inputs:
            m, k, n = shape
            gen = torch.Generator().manual_seed(0)
            self._inputs[shape] = (torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen))
        a, b = self._inputs[shape]
        autocast = (contextlib.nullcontext() if dtype == FP32
                    else torch.autocast("cpu", dtype=getattr(torch, dtype)))
        with autocast:
            if (shape, dtype) not in self._warm:
                torch.mm(a, b)
                self._warm.add((shape, dtype))
            wall, cpu = time.perf_counter(), time.process_time()
            torch.mm(a, b)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return Trial(wall, cpu / (wall * torch.get_num_threads()) if wall > 0 else 1.0)


def alternating_rounds(timer: Timer, shape: Shape, dtypes: list[str], min_rounds: int, floor_s: float,
                       cap_s: float = CAP_S) -> dict[str, list[Trial]]:
    """Each dtype's trial times, round by round: every round times each dtype once, in an order that rotates from
    round to round, until min_rounds rounds and floor_s seconds of trials (or cap_s, after two rounds)."""
    times: dict[str, list[Trial]] = {d: [] for d in dtypes}
    spent, rounds = 0.0, 0
    while rounds < min_rounds or spent < floor_s:
        if rounds >= 2 and spent >= cap_s:
            break
        order = dtypes[rounds % len(dtypes):] + dtypes[:rounds % len(dtypes)]
        for dtype in order:
            trial = timer(shape, dtype)
            times[dtype].append(trial)
            spent += trial.seconds
        rounds += 1
    return times


def summarize(times: dict[str, list[Trial]], shape: Shape) -> dict[str, DtypeSpeed]:
    """Each dtype's best rate, and its time relative to fp32's round by round: ratios of trials taken side by side,
    which load slows alike."""
    flops = 2 * math.prod(shape)
    speeds = {}
    for dtype, trials in times.items():
        per_round = [t.seconds / f.seconds for t, f in zip(trials, times[FP32])]
        quartiles = statistics.quantiles(per_round, n=4, method="inclusive") if len(per_round) > 1 else per_round * 3
        best = min(trials, key=lambda t: t.seconds)
        speeds[dtype] = DtypeSpeed(dtype, flops / best.seconds / 1e12, quartiles[1], (quartiles[0], quartiles[2]),
                                   len(trials), shape, round(best.core_share, 3))
    return speeds


def probe(timer: Timer, half_types: list[str], flags: frozenset[str]) -> CpuSpeed:
    """Measure fp32 and half_types (those CPU autocast computes in) on this CPU, as the module says; flags: the
    CPU's (empty where they could not be read: nothing is decided from them)."""
    converted = [d for d in half_types if flags and not instructions_for(d, flags)]
    screen = alternating_rounds(timer, SCREEN_SHAPE, [FP32, *converted], SCREEN_ROUNDS, 0.0) if converted else {}
    decided = {d: replace(speed, decided_by_flags=True)
               for d, speed in summarize(screen, SCREEN_SHAPE).items() if d != FP32}
    measured = [FP32, *(d for d in half_types if d not in decided)]
    times = alternating_rounds(timer, PROBE_SHAPE, measured, MIN_ROUNDS, FLOOR_S)
    attempts = 1
    while attempts < ATTEMPTS and any(instructions_for(d, flags) and not speed.runs_at_speed
                                      for d, speed in summarize(times, PROBE_SHAPE).items() if d != FP32):
        attempts += 1  # a busy spell, or a build that does not use the instructions: longer, then decide
        more = alternating_rounds(timer, PROBE_SHAPE, measured, MIN_ROUNDS, FLOOR_S * attempts)
        times = {d: times[d] + more[d] for d in measured}
    spent = sum(t.seconds for trials in [*screen.values(), *times.values()] for t in trials)
    return CpuSpeed({**summarize(times, PROBE_SHAPE), **decided}, flags, torch.get_num_threads(),
                    datetime.datetime.now().isoformat(timespec="seconds"), attempts, round(spent, 2))


# --- the cache --------------------------------------------------------------------------------------------------


def cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "ampctl" / "cpu_speed.json"


def machine_key() -> str:
    """What decides the result: the CPU, its instruction sets, torch (oneDNN's kernels) and the threads."""
    isa = sorted(f for f in devices.cpu_flags()
                 if f.startswith(("avx", "amx", "fma", "sse4", "asimd", "sve", "bf16", "fp16")))
    return (f"{devices.cpu_model()}|{platform.machine()}|{','.join(isa)}|torch {torch.__version__}|"
            f"{torch.get_num_threads()} threads")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One process measures at a time (two probes at once would load the machine for each other); where the
    cache directory cannot be written, each process measures on its own."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_suffix(".lock"), "a")
    except (ImportError, OSError):
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:  # a file system without locks (Lustre without -o flock): measured on its own, as above
            pass
        yield


def _read_cache(path: Path) -> dict:
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def _measure_and_keep(path: Path, key: str) -> CpuSpeed:
    half_types = [d for d in HALF_TYPES if devices.autocast_works("cpu", getattr(torch, d))]
    speed = probe(MatmulTimer(), half_types, devices.cpu_flags())
    cached = _read_cache(path)
    cached[key] = speed.to_json()
    try:
        from ampctl import io

        io.atomic_write_text(path, json.dumps(cached, indent=2) + "\n")
    except OSError:
        pass  # a read-only home measures again next time
    return speed


_measured: dict[str, CpuSpeed] = {}  # this process's figures, by machine key


def measured(remeasure: bool = False) -> CpuSpeed:
    """This CPU's figures: this process's, the cache's, or measured now (and kept) when there are none or when
    remeasure is asked; another kind's half types where AMPCTL_ASSUME_CPU names one."""
    kind = os.environ.get(ASSUME_ENV)
    return _measured_here(remeasure) if not kind else assumed(kind, _measured_here(remeasure))


def assumed(kind: str, here: CpuSpeed) -> CpuSpeed:
    """The figures of a CPU of this kind (ASSUMED_CPUS) whose fp32 is this one's (here: as measured)."""
    check_assumed()
    flags, relative = ASSUMED_CPUS[kind]
    fp32 = here.speeds[FP32]
    speeds = {FP32: fp32, **{dtype: replace(fp32, dtype=dtype, tflops=fp32.tflops / ratio, relative_time=ratio,
                                            spread=(ratio, ratio), decided_by_flags=not instructions_for(dtype, flags))
                             for dtype, ratio in relative.items()}}
    return CpuSpeed(speeds, flags, here.threads, here.measured_at, here.attempts, here.seconds, assumed=kind)


def _measured_here(remeasure: bool) -> CpuSpeed:
    key = machine_key()
    if key in _measured and not remeasure:
        return _measured[key]
    path = cache_path()
    with _locked(path):
        cached = None if remeasure else _usable_cache(path, key)
        _measured[key] = cached or _measure_and_keep(path, key)
    return _measured[key]


def _usable_cache(path: Path, key: str) -> Optional[CpuSpeed]:
    cached = CpuSpeed.from_json(_read_cache(path).get(key, {}))
    if cached is not None and cached.busy and _age_s(cached) > BUSY_RETRY_S:
        return None  # a busy machine's figures are kept a while, then measured again
    return cached


def measuring_needed() -> bool:
    """Whether measured() would measure now (seconds of matmuls): no figures in this process and none in the cache
    to take, so that a command can say why it waits."""
    return machine_key() not in _measured and _usable_cache(cache_path(), machine_key()) is None


def _age_s(speed: CpuSpeed) -> float:
    try:
        return (datetime.datetime.now() - datetime.datetime.fromisoformat(speed.measured_at)).total_seconds()
    except ValueError:
        return math.inf


def remeasure_if_contradicted(dtype: str, achieved_tflops: float) -> Optional[CpuSpeed]:
    """A run that computed faster than dtype's measured peak contradicts the figures (measured on a busy machine,
    or before something changed): measure again. Returns the new figures, or None where there was no
    contradiction."""
    peak = measured().peak_tflops(dtype)
    if peak is None or achieved_tflops <= peak:
        return None
    return measured(remeasure=True)
