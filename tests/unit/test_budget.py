"""advise's budget (studies/budget.py): each phase sized to what is left, on recorded figures, and the estimate of
what is kept never more than the time it was sized for."""

from __future__ import annotations

import itertools
import time

from ampctl.studies.budget import (
    INSPECT_FIXED_S,
    INSPECTED_STEP_COST,
    MIN_STEPS,
    PROCESS_START_S,
    SERVER_START_S,
    BudgetClock,
    Candidate,
    estimate,
    inspected_steps,
    seconds_since_start,
    size_comparison,
)

FP32 = Candidate("fp32", 1.0, baseline=True)


def test_the_reported_overrun_is_sized_down_instead_of_started():
    """The issue's case: compare.precisions=[fp32,bf16,fp16] on a CPU where both half types are ~80x slower, on a
    busy machine (fp32 steps of 0.47 s: what made advise announce 116 min for a 3 min budget). Nothing fits: not run,
    and the two slow modes are named with the reason."""
    candidates = [FP32, Candidate("bf16", 84.0), Candidate("fp16", 78.0)]
    size = size_comparison(candidates, step_s=0.474, seconds=150, seeds=3)
    assert not size.runs and size.kept == ["fp32"]
    assert set(size.dropped) == {"bf16", "fp16"}
    assert "not compared in the budget" in size.dropped["bf16"] and "~84x fp32's here" in size.dropped["bf16"]


def test_on_a_quiet_machine_the_same_modes_fit_with_every_seed():
    candidates = [FP32, Candidate("bf16", 84.0), Candidate("fp16", 78.0)]
    size = size_comparison(candidates, step_s=0.004, seconds=150, seeds=3)
    assert size.kept == ["fp32", "bf16", "fp16"] and size.seeds == 3 and size.steps >= MIN_STEPS
    assert size.fewer_seeds is None and size.estimate_s <= 150


def test_fewer_seeds_come_before_fewer_modes_and_fp32_is_never_dropped():
    candidates = [FP32, Candidate("O0", 1.0)]
    # the server's start, then per seed two runs' starts and MIN_STEPS steps of 0.2 s each
    three_seeds_s, two_seeds_s = (SERVER_START_S + n * 2 * (PROCESS_START_S + MIN_STEPS * 0.2) for n in (3, 2))
    size = size_comparison(candidates, step_s=0.2, seconds=(two_seeds_s + three_seeds_s) / 2, seeds=3)
    assert size.kept == ["fp32", "O0"] and size.seeds == 2 and "2 seeds of compare.seeds=3" in size.fewer_seeds
    size = size_comparison(candidates, step_s=0.2, seconds=two_seeds_s - 1, seeds=3)
    assert size.kept == ["fp32", "O0"] and size.seeds == 1  # the pair with one seed: its speed, not its accuracy
    one_seed_s = SERVER_START_S + 2 * (PROCESS_START_S + MIN_STEPS * 0.2)
    size = size_comparison(candidates, step_s=0.2, seconds=one_seed_s - 1, seeds=3)
    assert size.kept == ["fp32"] and not size.runs and list(size.dropped) == ["O0"]
    # the costliest goes first: the compiled run, whose compile time is paid in every seed
    three = [FP32, Candidate("bf16", 1.0), Candidate("fp32+compile", 1.0, compiled=True)]
    size = size_comparison(three, step_s=0.01, seconds=60, seeds=2, compile_s=20.0)
    assert size.kept == ["fp32", "bf16"] and list(size.dropped) == ["fp32+compile"]


def test_what_is_kept_is_never_estimated_past_the_time_it_was_sized_for():
    relatives = [0.5, 1.0, 3.0, 80.0]
    for step_s, seconds, seeds, rel in itertools.product([0.001, 0.01, 0.1, 0.5, 2.0], [20, 60, 180, 600, 3600],
                                                          [1, 2, 3, 5], relatives):
        candidates = [FP32, Candidate("a", rel), Candidate("b", 1.0, compiled=True)]
        size = size_comparison(candidates, step_s, seconds, seeds, compile_s=15.0)
        if size.runs:
            kept = [c for c in candidates if c.label in size.kept]
            assert size.estimate_s <= seconds and size.steps >= MIN_STEPS
            assert estimate(kept, step_s, size.seeds, 15.0, steps=size.steps) == (size.steps, size.estimate_s)
        assert size.kept[0] == "fp32" and len(size.kept) + len(size.dropped) == 3


def test_the_estimate_counts_every_process_start_compile_and_step():
    candidates = [FP32, Candidate("bf16", 2.0), Candidate("bf16+compile", 1.5, compiled=True)]
    steps, seconds = estimate(candidates, step_s=0.1, seeds=2, compile_s=10.0, steps=50)
    assert steps == 50
    assert seconds == SERVER_START_S + 2 * (3 * PROCESS_START_S + 10.0) + 2 * 50 * (1.0 + 2.0 + 1.5) * 0.1


def test_the_inspection_takes_the_steps_that_fit_and_none_where_one_does_not():
    step_s = 0.1  # an inspected step: INSPECTED_STEP_COST x 0.1 s
    one = INSPECTED_STEP_COST * step_s
    assert inspected_steps(2, step_s, INSPECT_FIXED_S + 0.99 * one) == 0
    assert inspected_steps(2, step_s, INSPECT_FIXED_S + 1.01 * one) == 1
    assert inspected_steps(2, step_s, INSPECT_FIXED_S + 100 * one) == 2  # inspect.steps at most
    assert inspected_steps(2, step_s, INSPECT_FIXED_S + 3 * one, relative=2.0) == 1  # a mode twice as slow


def test_the_clock_counts_from_the_commands_start():
    assert 0 < seconds_since_start() < 3600  # this test process started a moment ago, not at boot
    clock = BudgetClock(60, already_s=10)
    assert 9.9 < clock.elapsed() < 11 and 49 < clock.left() <= 50.1
    assert clock.line("x").startswith("[0:10 of 1:00] x")
    assert abs(clock.deadline(0.5) - (time.monotonic() + 0.5 * clock.left())) < 0.1
    assert BudgetClock(5, already_s=10).left() == 0


def test_a_pair_that_does_not_fit_two_seeds_runs_with_one_and_says_the_budget_that_would_fit_two():
    """The issue's case: fp32 and bf16 on a machine where two seeds of MIN_STEPS do not fit what is left: the pair with
    one seed (its speed measured, its accuracy not decided), and the seconds two seeds would need; where not even
    one fits, nothing runs but the seconds are said."""
    pair = [FP32, Candidate("bf16", 0.5), Candidate("mxfp8", 8.0)]
    two_s = estimate(pair[:2], 0.2, 2, steps=MIN_STEPS)[1]
    one_s = estimate(pair[:2], 0.2, 1, steps=MIN_STEPS)[1]
    size = size_comparison(pair, step_s=0.2, seconds=(one_s + two_s) / 2, seeds=3)
    assert size.kept == ["fp32", "bf16"] and size.seeds == 1 and size.steps >= MIN_STEPS
    assert size.fewer_seeds.startswith("1 seed of compare.seeds=3: 2 would leave fewer than 30 steps a run; its speed "
                                       "is measured, its accuracy against fp32 is not decided")
    assert size.needed_s == two_s and list(size.dropped) == ["mxfp8"]
    nothing = size_comparison(pair, step_s=0.2, seconds=one_s - 1, seeds=3)
    assert not nothing.runs and nothing.needed_s == two_s
