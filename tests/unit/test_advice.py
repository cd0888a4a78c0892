"""ampctl advise's decision on recorded measurements (studies/advice.py): given these figures, this mode and these
reasons."""

from __future__ import annotations

from ampctl.studies.advice import Advice, GradientEvidence, ModeEvidence, decide

FP32 = ModeEvidence("fp32", 1.0, 1.0, 1.0, peak_mib=100.0, seeds=3)


def bf16(**kw) -> ModeEvidence:
    figures = dict(speedup=1.8, speedup_low=1.7, speedup_high=1.9, parity="matches", eval_loss_delta=0.001, seeds=3,
                   peak_mib=60.0)
    return ModeEvidence("bf16", **{**figures, **kw})


def fp16(**kw) -> ModeEvidence:
    figures = dict(speedup=2.0, speedup_low=1.9, speedup_high=2.1, parity="matches", eval_loss_delta=0.002, seeds=3,
                   peak_mib=58.0)
    return ModeEvidence("fp16", **{**figures, **kw})


def test_a_cpu_without_fast_half_precision_gets_fp32_with_each_rejection_said():
    """The AMD EPYC without AVX512: compare skipped the half modes as slow; fp32 is the answer, and why."""
    advice = decide([FP32, ModeEvidence("fp16", skipped="float16 matmuls run 79x slower than fp32 on this CPU"),
                     ModeEvidence("bf16", skipped="bfloat16 matmuls run 16x slower than fp32 on this CPU")], None)
    assert advice.mode == "fp32" and advice.scaler == {} and advice.rules == []
    assert advice.rejected == {"fp16": "float16 matmuls run 79x slower than fp32 on this CPU",
                               "bf16": "bfloat16 matmuls run 16x slower than fp32 on this CPU"}
    assert advice.reasons == ["no mode was measured faster than fp32 with fp32's accuracy on this machine"]


def test_bf16_where_it_is_faster_and_matches():
    advice = decide([FP32, bf16()], None)
    assert advice.mode == "bf16" and advice.overrides() == ["precision=bf16"]
    assert "1.80x fp32's speed (1.70-1.90x)" in advice.reasons[0] and "within the seed-to-seed noise of 3" in \
        advice.reasons[0]


def test_faster_but_beyond_seed_noise_is_rejected_with_its_loss():
    advice = decide([FP32, bf16(parity="differs", eval_loss_delta=0.08)], None)
    assert advice.mode == "fp32"
    assert advice.rejected["bf16"].startswith("held-out loss +0.0800 against fp32, beyond the seed-to-seed noise")


def test_undecided_parity_is_not_recommended_and_says_what_decides_it():
    for parity in ("undecided", "one seed"):
        advice = decide([FP32, bf16(parity=parity)], None)
        assert advice.mode == "fp32" and "a longer advise.budget trains longer and decides it" in advice.rejected["bf16"]


def test_a_mode_within_noise_of_fp32s_speed_is_not_faster():
    advice = decide([FP32, bf16(speedup=1.02, speedup_low=0.97, speedup_high=1.08)], None)
    assert advice.mode == "fp32"
    assert advice.rejected["bf16"] == ("matches fp32's accuracy, but no measurable difference in speed from fp32 "
                                       "(0.97-1.08x)")


def test_the_fastest_matching_mode_wins_and_a_scaled_one_gets_its_scale_and_rules():
    gradients = GradientEvidence(max_gradient=3.2, flushed_in_fp16=0.0, overflowing_layers=("head",))
    advice = decide([FP32, bf16(), fp16()], gradients)
    assert advice.mode == "fp16" and advice.rejected["bf16"].endswith("below fp16's 2.00x")
    # 65504 / 3.2 = 20470: the largest power of two below is 2^14, and one bit to spare makes it 2^13
    assert advice.scaler == {"init_scale": 2.0**13, "growth_interval": 2000}
    assert advice.rules == [{"match": "head", "run_in": "fp32"}]
    assert advice.overrides() == ["precision=fp16", "scaler.init_scale=8192.0", "scaler.growth_interval=2000",
                                  "precision.rules=[{match:'head',run_in:'fp32'}]"]
    assert any("overflows fp16 at GradScaler's 2^16" in r for r in advice.reasons)


def test_tiny_gradients_start_the_scale_higher_and_say_what_fp16_would_flush():
    advice = decide([FP32, fp16()], GradientEvidence(max_gradient=1e-3, flushed_in_fp16=0.05))
    assert advice.scaler["init_scale"] == 2.0**24  # 2^25 is safe; capped at 2^24
    assert any("flushes 5.00% of the activation gradients" in r for r in advice.reasons)


def test_goal_memory_takes_the_smallest_peak_that_matches():
    advice = decide([FP32, bf16(), fp16(parity="differs", eval_loss_delta=0.3)], None, goal="memory")
    assert advice.mode == "bf16" and "60.0 MiB against fp32's 100.0 MiB" in advice.reasons[0]
    assert "beyond the seed-to-seed noise" in advice.rejected["fp16"]


def test_goal_accuracy_is_fp32_with_the_alternatives():
    advice = decide([FP32, bf16()], None, goal="accuracy")
    assert advice.mode == "fp32" and "bf16: 1.80x fp32's speed" in advice.reasons[0]


def test_advice_round_trips_as_json():
    advice = decide([FP32, bf16()], None)
    assert Advice(**advice.to_json()) == advice
