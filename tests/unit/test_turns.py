"""How compare's modes share the machine (studies/turns.py): short turns by default, and on a CPU that other
processes keep busy, the threads left free; against a machine made busy or quiet (machine_load's samples)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from ampctl import machine_load
from ampctl.studies import turns


def cfg(rounds=None, warmup=10, threads=None):
    return OmegaConf.create({"compare": {"rounds": rounds, "warmup_steps": warmup}, "train": {"threads": threads}})


def test_by_default_the_rounds_are_turns_of_a_few_steps_as_many_as_the_steps_hold():
    assert turns.rounds_of(cfg(), 200) == (200 - 10) // turns.TURN_STEPS == 47
    assert turns.rounds_of(cfg(), 12) == 1  # two steps after the warm-up: one round, no interval
    assert turns.rounds_of(cfg(rounds=5), 200) == 5  # as the user asked
    spans = turns.round_spans(cfg(), 200)
    assert len(spans) == 47 and spans[0] == (11, 14) and spans[-1][1] == 200
    assert all(last - first + 1 >= turns.TURN_STEPS for first, last in spans)


class Machine:
    """machine_load.sample() of a machine where other processes keep `others` cores busy."""

    def __init__(self, others: float) -> None:
        self.others, self.t = others, 0.0

    def __call__(self) -> machine_load.Sample:
        self.t += 1.0
        return machine_load.Sample(self.t, self.others * self.t, 0.0)


@pytest.fixture
def no_wait(monkeypatch):
    monkeypatch.setattr(turns, "LOAD_SAMPLE_S", 0.0)
    monkeypatch.setattr(machine_load, "cores", lambda: 2)


def test_a_busy_cpu_gets_its_modes_the_threads_other_processes_leave_free(monkeypatch, no_wait):
    monkeypatch.setattr(machine_load, "sample", Machine(1.9))
    threads = turns.threads_left_free(cfg(), ["cpu", "cpu"])
    assert threads is not None and threads.threads == 1
    assert threads.said.startswith("the machine is busy (other processes used 1.9 of 2 cores): every mode runs on 1 "
                                   "thread (train.threads=1)")
    monkeypatch.setattr(machine_load, "sample", Machine(0.9))  # one core of two taken: one left
    assert turns.threads_left_free(cfg(), ["cpu"]).threads == 1


def test_a_quiet_machine_a_gpu_or_the_users_own_threads_are_left_as_they_are(monkeypatch, no_wait):
    monkeypatch.setattr(machine_load, "sample", Machine(0.1))
    assert turns.threads_left_free(cfg(), ["cpu"]) is None  # a shell and a terminal: quiet
    monkeypatch.setattr(machine_load, "sample", Machine(1.9))
    assert turns.threads_left_free(cfg(), ["cuda"]) is None
    assert turns.threads_left_free(cfg(threads=2), ["cpu"]) is None
