"""How `ampctl compare`'s modes share the machine: the rounds of turns they take (their steps), and on a CPU that other
processes keep busy, the threads each mode computes on."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from omegaconf import DictConfig

from ampctl import machine_load
from ampctl.errors import UsageError
from ampctl.reports import round_stats

# compare.rounds=null: each mode's turn in a round is this many steps (its first, on caches another mode left, is
# left out): the two sides of a round's ratio run seconds apart, so that a machine's load, which changes over
# seconds, falls on both alike (5 rounds of 38 steps: a busy machine's rounds differed 4.8x, and the verdict with them)
TURN_STEPS = 4


def rounds_of(cfg: DictConfig, steps: int) -> int:
    """compare.rounds, or (null) as many turns of TURN_STEPS as the steps after the warm-up hold (1 at least)."""
    if cfg.compare.rounds is not None:
        return cfg.compare.rounds
    return max(1, (steps - cfg.compare.warmup_steps) // TURN_STEPS)


def round_spans(cfg: DictConfig, steps: int) -> list[tuple[int, int]]:
    """The steps of each round, refused in one line when a round would have no timed step (its first is left out)."""
    warmup, n = cfg.compare.warmup_steps, rounds_of(cfg, steps)
    if steps - warmup < 2 * n:
        raise UsageError(
            f"compare.rounds={n}: each round needs 2 steps or more after compare.warmup_steps={warmup} (its first is "
            f"left out), and train.steps={steps} leaves {max(steps - warmup, 0)}: raise train.steps to "
            f"{warmup + 2 * n} or more, or lower compare.rounds")
    return round_stats.windows(warmup, steps, n)


@dataclass(frozen=True)
class Threads:
    threads: int
    said: str


LOAD_SAMPLE_S = 1.0  # how long compare watches the machine before it starts: what other processes take of it


def threads_left_free(cfg: DictConfig, devices: list[str]) -> Optional[Threads]:
    """On a CPU that other processes keep busy, every mode's intra-op threads sized to the cores they leave free:
    with a thread per core, a step waits for whichever thread the scheduler set aside (a GPT step took up to 18x its
    quiet time beside two busy loops on two cores, 1 thread ~2x). None where the machine is quiet, the device is not
    a CPU, or the user chose train.threads."""
    if cfg.train.threads is not None or any(device != "cpu" for device in devices):
        return None
    before = machine_load.sample()
    time.sleep(LOAD_SAMPLE_S)
    others = machine_load.others_cores(before, machine_load.sample())
    if not machine_load.busy(others):
        return None
    assert others is not None
    threads = max(1, round(machine_load.cores() - others))
    return Threads(threads, f"the machine is busy ({machine_load.said(others)}): every mode runs on {threads} "
                            f"thread{'s' if threads > 1 else ''} (train.threads={threads}), so that no step waits on a "
                            "thread the scheduler set aside; the speedups are those of that many threads")
