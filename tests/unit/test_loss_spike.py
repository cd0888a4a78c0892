"""guard.loss_spike's rule on hand-made step records: nothing before its window is full, a spike measured in robust
deviations of the window's own spread (at least 1% of its median), the spike itself kept out of the window, and
a skipped step (a scaler's overflow, not a loss) never counted."""

from __future__ import annotations

from omegaconf import OmegaConf

from ampctl.engine.telemetry import StepRecord
from ampctl.runner.guarding.guards import Guard


def guard(window: int = 10, k: float = 6.0) -> Guard:
    cfg = OmegaConf.create({"max_consecutive_skips": None, "stop_at_min_scale": False, "on_nonfinite": "stop",
                            "loss_spike": k, "loss_spike_window": window})
    return Guard(cfg, can_skip=True, min_scale=None)


def record(step: int, loss: float, skipped: bool = False) -> StepRecord:
    return StepRecord(step, loss, 1.0, skipped, 0, 1.0, 1e-3, 1.0, 1.0)


def test_nothing_trips_before_the_window_is_full():
    trip, _ = guard().check([record(1, 1.0), record(2, 50.0), *(record(s, 1.0) for s in range(3, 11))])
    assert trip is None


def test_a_flat_loss_measures_a_spike_against_one_percent_of_itself():
    flat = [record(s, 1.0) for s in range(1, 11)]
    assert guard().check([*flat, record(11, 1.05)])[0] is None  # 5 deviations of 0.01: under 6
    trip, _ = guard().check([*flat, record(11, 1.07)])
    assert trip is not None and trip.step == 11 and "7.0 robust deviations above the median 1" in trip.reason


def test_the_windows_own_spread_sets_the_scale_and_a_spike_stays_out_of_the_window():
    wiggle = [record(s, 2.0 + (0.1 if s % 2 else -0.1)) for s in range(1, 11)]  # MAD 0.1: deviation 0.148
    assert guard().check([*wiggle, record(11, 2.8)])[0] is None  # 5.4 deviations
    g = guard()
    trip, _ = g.check([*wiggle, record(11, 3.0)])
    assert trip is not None and trip.step == 11
    assert 3.0 not in g.window  # what tripped is not what the next steps are measured against


def test_a_skipped_step_is_a_scalers_overflow_not_a_loss():
    steps = [record(s, 1.0) for s in range(1, 11)]
    assert guard().check([*steps, record(11, 1e4, skipped=True), record(12, 1.0)])[0] is None


def test_a_guard_primed_inside_a_skip_streak_trips_where_the_uninterrupted_one_does():
    """A run stopped inside a streak of skipped steps (its checkpoint at step 6, steps 5 and 6 skipped) and resumed:
    the streak goes on from the run's own rows, so 7 and 8 skipped trip at max_consecutive_skips=4 naming step 5,
    the streak's first, as the run that never stopped did; not 7..10, naming step 7."""
    cfg = OmegaConf.create({"max_consecutive_skips": 4, "stop_at_min_scale": False, "on_nonfinite": "stop",
                            "loss_spike": None, "loss_spike_window": 10})
    rows = [record(s, 1.0, skipped=s >= 5) for s in range(1, 9)]
    uninterrupted, _ = Guard(cfg, can_skip=True, min_scale=None).check(rows)
    resumed = Guard(cfg, can_skip=True, min_scale=None)
    resumed.prime(rows[:6])
    trip, _ = resumed.check(rows[6:])
    assert uninterrupted is not None and trip is not None
    assert (trip.step, trip.reason) == (uninterrupted.step, uninterrupted.reason) == (
        5, "4 consecutive skipped steps (5..8), loss scale now 1: the run is not recovering "
           "(guard.max_consecutive_skips)")
    after_a_good_step = Guard(cfg, can_skip=True, min_scale=None)
    after_a_good_step.prime([*rows[:6], record(7, 1.0)])  # a step that was not skipped ends the streak
    assert after_a_good_step.check([record(8, 1.0, skipped=True)])[0] is None
