"""ampctl advise's decision on recorded measurements (studies/advising/advice.py): given these figures, this mode and
these
reasons."""

from __future__ import annotations

import dataclasses
import json

from ampctl.conf.precision_schema import LayerRule
from ampctl.studies.advising.advice import Advice, GradientEvidence, LayerLoss, ModeEvidence, decide, prepare

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
    assert advice.reasons == ["no other mode was compared with fp32 here (each one's reason below): fp32, the "
                              "reference, by default"]


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
        assert advice.mode == "fp32"
        assert "a longer advise.budget trains longer and decides it" in advice.rejected["bf16"]


def test_a_mode_within_noise_of_fp32s_speed_is_not_faster():
    advice = decide([FP32, bf16(speedup=1.02, speedup_low=0.97, speedup_high=1.08)], None)
    assert advice.mode == "fp32"
    assert advice.rejected["bf16"] == ("matches fp32's accuracy, but no measurable difference in speed from fp32 "
                                       "(0.97-1.08x)")


def test_the_fastest_matching_mode_wins_and_a_scaled_one_gets_its_scale_and_rules():
    gradients = GradientEvidence(max_gradient=3.2, flushed_in_fp16=0.0, overflowing_layers=("head",))
    advice = decide([FP32, bf16(), fp16()], {"fp16": prepare("fp16", gradients)})
    assert advice.mode == "fp16" and advice.rejected["bf16"].endswith("below fp16's 2.00x")
    # 65504 / 3.2 = 20470: the largest power of two below is 2^14, and one bit to spare makes it 2^13
    assert advice.scaler == {"init_scale": 2.0**13, "growth_interval": 2000}
    assert advice.rules == [LayerRule(run_in="fp32", match="head")]
    assert advice.overrides() == ["precision=fp16", "scaler.init_scale=8192.0", "scaler.growth_interval=2000",
                                  "precision.rules=[{match:'head',run_in:'fp32'}]"]
    assert any("overflows fp16 at GradScaler's 2^16" in r for r in advice.reasons)


def test_tiny_gradients_start_the_scale_higher_and_say_what_fp16_would_flush():
    gradients = GradientEvidence(max_gradient=1e-3, flushed_in_fp16=0.05)
    advice = decide([FP32, fp16()], {"fp16": prepare("fp16", gradients)})
    assert advice.scaler["init_scale"] == 2.0**24  # 2^25 is safe; capped at 2^24
    assert any("flushes 5.00% of the activation gradients" in r for r in advice.reasons)


def test_goal_memory_takes_the_smallest_peak_that_matches():
    advice = decide([FP32, bf16(), fp16(parity="differs", eval_loss_delta=0.3)], None, goal="memory")
    assert advice.mode == "bf16" and "60.0 MiB against fp32's 100.0 MiB" in advice.reasons[0]
    assert "beyond the seed-to-seed noise" in advice.rejected["fp16"]


def test_goal_memory_weighs_optimizer_states_as_rows_against_fp32_with_the_runs_adamw():
    """Rows labelled by their optimizer (advise.goal=memory compares adamw_8bit beside adamw): the reference is
    fp32 with the run's AdamW; the smallest peak that matches wins, and its config names its optimizer. Where
    nothing beats the reference, the reference row is the advice, with the run's own optimizer."""
    reference = dataclasses.replace(FP32, mode="fp32+adamw")
    eight_bit = dataclasses.replace(bf16(peak_mib=41.0, speedup=0.9, speedup_low=0.85, speedup_high=0.95),
                                    mode="bf16+adamw_8bit")
    advice = decide([reference, dataclasses.replace(bf16(), mode="bf16+adamw"), eight_bit,
                     dataclasses.replace(FP32, mode="fp32+adamw_8bit", peak_mib=70.0, speedup=0.8, speedup_low=0.75,
                                         speedup_high=0.85, parity="matches", eval_loss_delta=0.0)], goal="memory")
    assert advice.mode == "bf16+adamw_8bit" and advice.overrides() == ["precision=bf16", "optimizer=adamw_8bit"]
    assert "41.0 MiB against fp32's 100.0 MiB" in advice.reasons[0]
    assert advice.rejected["bf16+adamw"] == "peak 60.0 MiB, above bf16+adamw_8bit's 41.0 MiB"
    alone = decide([reference, dataclasses.replace(eight_bit, parity="differs", eval_loss_delta=0.2)], goal="memory")
    assert alone.mode == "fp32+adamw" and alone.overrides() == ["precision=fp32", "optimizer=adamw"]


def test_goal_accuracy_is_fp32_with_the_alternatives():
    advice = decide([FP32, bf16()], None, goal="accuracy")
    assert advice.mode == "fp32" and "bf16: 1.80x fp32's speed" in advice.reasons[0]


def test_advice_round_trips_as_json():
    advice = decide([FP32, bf16()], None)
    assert Advice(**advice.to_json()) == advice
    advice.rules = [LayerRule(run_in="fp32", match="head"), LayerRule(run_in="fp32", type="norm")]
    record = advice.to_json()
    assert record["rules"] == [{"match": "head", "run_in": "fp32"}, {"type": "norm", "run_in": "fp32"}]  # set keys
    assert Advice(**json.loads(json.dumps(record))) == advice


def test_o2s_own_rule_stays_after_the_advised_ones():
    """precision.rules replaces the mode's list: O2's norms-in-fp32 must be carried after the advised rules."""
    norms = LayerRule(run_in="fp32", type="norm")
    prepared = prepare("O2", GradientEvidence(3.2, 0.0, ("head",)), own_rules=[norms])
    assert prepared.rules == [LayerRule(run_in="fp32", match="head"), norms]
    assert prepare("O2", GradientEvidence(3.2, 0.0), own_rules=[norms]).rules == []  # nothing added: the mode's own


def test_a_converted_mode_keeps_the_layers_its_format_loses_too_much_of_unconverted():
    losses = [LayerLoss("blocks.0.fc", "gradient", 0.12), LayerLoss("blocks.1.fc", "activation", 0.002),
              LayerLoss("head", "activation", 0.03)]
    prepared = prepare("fp8", None, losses, limit=0.01, measured_by="fp8 (by its tensorwise scale)")
    assert prepared.refused is None and prepared.scaler == {}
    assert prepared.rules == [LayerRule(run_in="unconverted", match="blocks.0.fc"),
                              LayerRule(run_in="unconverted", match="head")]
    assert prepared.reasons == ["2 layers of 3 kept unconverted (precision.rules), as fp8 (by its tensorwise scale) "
                                "loses more than advise.layer_loss_limit=0.01 of an operand there: blocks.0.fc "
                                "(12.00% of its gradients), head (3.00% of its activations)"]
    advice = decide([FP32, ModeEvidence("fp8", 1.4, 1.3, 1.5, "matches", 0.001, 3)], {"fp8": prepared})
    assert advice.mode == "fp8" and advice.rules == prepared.rules and prepared.reasons[0] in advice.reasons
    assert advice.overrides() == ["precision=fp8", "precision.rules=[{match:'blocks.0.fc',run_in:'unconverted'},"
                                  "{match:'head',run_in:'unconverted'}]"]
    assert prepare("fp8", None, [LayerLoss("x", "activation", 0.0)]).rules == []


def test_a_format_that_loses_too_much_everywhere_is_not_worth_comparing():
    prepared = prepare("mxfp4", None, [LayerLoss("a", "activation", 0.2), LayerLoss("b", "weight", 0.05)],
                       limit=0.01, measured_by="mxfp4 (by its block scales)")
    assert prepared.refused == ("mxfp4 (by its block scales) loses more than 1.00% of an operand in every one of its 2 "
                                "converted layers (least: 5.00%): nothing would be left to run in it")


def test_a_compiled_row_is_advised_as_compile_and_notes_are_kept():
    compiled = bf16(speedup=2.2, speedup_low=2.1, speedup_high=2.3)
    advice = decide([FP32, bf16(), dataclasses.replace(compiled, mode="bf16+compile")],
                    notes=["activation checkpointing: not measured"])
    assert advice.mode == "bf16+compile" and advice.overrides() == ["precision=bf16", "train.compile.enabled=true"]
    assert advice.rejected["bf16"].endswith("below bf16+compile's 2.20x")
    assert advice.notes == ["activation checkpointing: not measured"]


def test_a_rejected_mode_says_the_settings_it_was_compared_with():
    gradients = GradientEvidence(max_gradient=3.2, flushed_in_fp16=0.0, overflowing_layers=("head",))
    slower = fp16(speedup=0.7, speedup_low=0.65, speedup_high=0.75)
    advice = decide([FP32, slower], {"fp16": prepare("fp16", gradients)})
    assert advice.mode == "fp32" and advice.scaler == {} and advice.rules == []
    assert advice.rejected["fp16"].endswith("(as advise would set it: scaler.init_scale=2^13, head in fp32)")


def test_goal_memory_takes_the_faster_of_peaks_within_two_percent():
    """fp16+ac and O2+ac at 3.70 and 3.68 MiB are the same peak to a user: the faster wins, and fp32's own peak
    is not beaten by a mode 1% below it."""
    fast = fp16(peak_mib=3.70, speedup=0.5, speedup_low=0.45, speedup_high=0.55)
    slow = dataclasses.replace(fp16(peak_mib=3.68, speedup=0.3, speedup_low=0.28, speedup_high=0.33), mode="O2")
    advice = decide([dataclasses.replace(FP32, peak_mib=7.2), fast, slow], goal="memory")
    assert advice.mode == "fp16" and "within 2% of fp16's 3.7 MiB, and fp16 runs faster" in advice.rejected["O2"]
    advice = decide([FP32, bf16(peak_mib=99.0)], goal="memory")
    assert advice.mode == "fp32" and "not below fp32's (100.0 MiB) by more than 2%" in advice.rejected["bf16"]


def test_a_scale_lowered_only_for_headroom_is_not_said_to_overflow():
    """0.652 * 2^16 = 42729 fits fp16 (65504), with less than a factor 2 to spare: 2^15, and the reason says so."""
    prepared = prepare("fp16", GradientEvidence(max_gradient=0.652, flushed_in_fp16=0.0))
    assert prepared.scaler["init_scale"] == 2.0**15
    assert "leaves less than a factor 2 below fp16's max (4.273e+04 of 65504)" in prepared.reasons[0]
    assert "overflows" not in prepared.reasons[0]


def test_a_mode_that_differs_is_worth_repairing_only_where_the_goal_would_take_it():
    """Faster and differing: repaired; slower and differing: not (speed would rule it out anyway); a mode compared
    several ways is repaired once, from its best row; under goal=memory, a peak below fp32's is what counts."""
    from ampctl.studies.advising.advise_repair import worth_repairing

    differs = dict(parity="differs", eval_loss_delta=0.5)
    compiled = ModeEvidence("bf16+compile", 2.2, 2.1, 2.3, "differs", 0.5, None, 3, 70.0)
    rows = [FP32, bf16(**differs), compiled, fp16(**differs, speedup=0.5, speedup_low=0.4, speedup_high=0.6)]
    assert [m.mode for m in worth_repairing(rows, "speed")] == ["bf16+compile"]
    assert [m.mode for m in worth_repairing(rows, "memory")] == ["fp16", "bf16"]  # the smallest peak of each mode
    assert worth_repairing([FP32, bf16()], "speed") == []  # matches: nothing to repair
    assert worth_repairing(rows, "accuracy") == []


def test_a_repaired_row_is_advised_with_the_repairs_rules_before_the_modes_own():
    """bf16 differs; bf16+repaired (compared with fp32 on its own) matches and is faster: it is the advice, run as
    precision=bf16 with its rules (its label's preparation), and bf16 alone stays rejected with its loss."""
    from ampctl.studies.advising.advice import Preparation

    repaired = dataclasses.replace(bf16(speedup=1.6, speedup_low=1.5, speedup_high=1.7), mode="bf16+repaired")
    rules = [LayerRule(run_in="fp32", match="cancel")]
    prepared = {"bf16+repaired": Preparation(rules=rules, reasons=["repaired by ampctl diff's repair"],
                                             summary="repaired: cancel -> fp32")}
    advice = decide([FP32, bf16(parity="differs", eval_loss_delta=0.7), repaired], prepared)
    assert advice.mode == "bf16+repaired" and advice.precision == "bf16"
    assert advice.overrides() == ["precision=bf16", "precision.rules=[{match:'cancel',run_in:'fp32'}]"]
    assert "repaired by ampctl diff's repair" in advice.reasons
    assert "+0.7000" in advice.rejected["bf16"]


def test_each_reason_a_mode_is_ruled_out_for_is_said_once_with_every_mode_it_rules_out(tmp_path):
    """fp16 and O2 are slow for one reason: one line names both (advise said fp16's slowness six times)."""
    from ampctl.studies.advising.advice_report import advice_lines

    slow = "float16 matmuls are converted in software on this CPU, which has no AVX512-FP16 or AMX-FP16"
    advice = decide([FP32, ModeEvidence("fp16", skipped=slow), ModeEvidence("O2", skipped=slow),
                     ModeEvidence("bf16", skipped="bfloat16 matmuls ran slow")], None)
    lines = advice_lines(advice, None, tmp_path / "advised.yaml", tmp_path)
    assert [line for line in lines if line.startswith("not ")] == [f"not fp16, O2: {slow}",
                                                                   "not bf16: bfloat16 matmuls ran slow"]
    assert " ".join(lines).count(slow) == 1
