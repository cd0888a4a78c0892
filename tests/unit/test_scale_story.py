"""The loss scale's story (runner/reporting/scale_story.py) on records whose skips and scales are known."""

from __future__ import annotations

from ampctl.engine.telemetry import StepRecord
from ampctl.runner.reporting.scale_story import MAX_EVENT_LINES, ScaleStory


def records(scales: list[float], skipped: set[int]) -> list[StepRecord]:
    total, out = 0, []
    for step, scale in enumerate(scales, start=1):
        total += step in skipped
        out.append(StepRecord(step=step, loss=1.0, loss_scale=scale, skipped=step in skipped, skipped_total=total,
                              grad_norm=1.0, lr=1e-3, step_time_ms=1.0, samples_per_s=1.0))
    return out


def told(scales: list[float], skipped: set[int], log_every: int = 3) -> tuple[list[str], str]:
    lines: list[str] = []
    story = ScaleStory(lines.append)
    rows = records(scales, skipped)
    for i in range(0, len(rows), log_every):  # as the records come back, a log interval at a time
        story.write(rows[i:i + log_every])
    story.close()
    return lines, story.summary()


def test_a_dynamic_scalers_growths_skips_and_backoffs_are_each_a_line_in_step_order():
    # grows after 2 clean steps (4 -> 8 after step 2), overflows at 16 (step 5: skipped, back to 8)
    lines, summary = told([4, 4, 8, 8, 16, 8, 8, 16], {5})
    assert lines == ["after step 2: loss scale 2^2 -> 2^3 (2 clean steps)",
                     "after step 4: loss scale 2^3 -> 2^4 (2 clean steps)",
                     "step 5 skipped: gradients not finite at scale 2^4; scale -> 2^3",
                     "after step 7: loss scale 2^3 -> 2^4 (2 clean steps)"]
    assert summary == "loss scale 2^2 -> 2^4: 1 skipped (first at step 5), 1 backoff, 3 growths"


def test_consecutive_skips_across_log_intervals_are_one_line():
    lines, summary = told([2**16, 2**15, 2**14, 2**13, 2**12, 2**12], {1, 2, 3, 4}, log_every=2)
    assert lines == ["steps 1-4 skipped: gradients not finite at scale 2^16; scale -> 2^12"]
    assert summary == "loss scale 2^16 -> 2^12: 4 skipped (first at step 1), 4 backoffs"


def test_a_static_scale_is_kept_and_a_run_ending_in_skips_says_where_the_scale_was():
    lines, summary = told([256, 256, 256], {2})
    assert lines == ["step 2 skipped: gradients not finite at scale 2^8; scale kept"]
    assert summary == "loss scale 2^8 throughout: 1 skipped (first at step 2)"
    lines, _ = told([8, 8, 4], {2, 3})
    assert lines == ["steps 2-3 skipped: gradients not finite at scale 2^3; scale 2^2 at step 3"]


def test_a_growth_just_before_a_skip_is_told_first():
    lines, _ = told([4, 8, 4], {2})
    assert lines == ["after step 1: loss scale 2^2 -> 2^3 (1 clean step)",
                     "step 2 skipped: gradients not finite at scale 2^3; scale -> 2^2"]


def test_a_run_without_a_scaler_tells_nothing():
    lines, summary = told([1.0] * 7, set())
    assert lines == [] and summary is None


def test_a_scale_that_moves_every_step_says_the_first_lines_then_where_the_rest_are():
    lines, summary = told([2.0**k for k in range(1, 200)], set())
    assert len(lines) == MAX_EVENT_LINES + 1 and "metrics.jsonl has every step" in lines[-1]
    assert summary.endswith("no step skipped, 198 growths")


def test_a_skip_on_the_last_step_counts_its_backoff_from_the_final_scale():
    """The issue's case: 4 skips, the last on the last step, whose backoff no record holds (it happens in the
    update after it): the summary's final scale says it; 4 skipped, 4 backoffs, ending where the run ended."""
    story = ScaleStory(lambda line: None)
    story.write(records([2**16, 2**15, 2**14, 2**14, 2**13], {1, 2, 3, 5}))
    story.close()
    assert story.summary() == "loss scale 2^16 -> 2^13: 4 skipped (first at step 1), 3 backoffs"  # records alone
    assert story.summary(final_scale=2**12) == "loss scale 2^16 -> 2^12: 4 skipped (first at step 1), 4 backoffs"
    assert story.summary(final_scale=2**13) == "loss scale 2^16 -> 2^13: 4 skipped (first at step 1), 3 backoffs"
