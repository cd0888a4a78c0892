"""precision.schedule's segments, their points, the label compare's rows use, and what a resume may change."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from ampctl.conf import precision_schedule
from ampctl.conf.precision_schema import ScheduledChange
from ampctl.conf.typed import typed_config
from ampctl.errors import ConfigError, UsageError

BF16 = {"name": "bf16", "autocast": True, "dtype": "bfloat16", "rules": []}
FP32 = {"name": "fp32", "autocast": False, "dtype": "float32", "rules": []}


def config(schedule: list, steps: int = 100) -> object:
    own = {"name": "nvfp4", "converter": "mx_emulated", "rules": [{"match": "head", "run_in": "bf16"}]}
    return OmegaConf.create({"precision": {**own, "schedule": schedule}, "train": {"steps": steps}})


def test_a_fraction_holds_from_the_step_after_the_nearest_one_and_a_step_from_the_step_after_it():
    cfg = config([{"at": 0.82, "precision": "bf16", "mode": BF16}, {"step": 95, "precision": "fp32", "mode": FP32}])
    found = precision_schedule.segments(cfg)
    assert [(s.after, s.mode, s.point) for s in found] == [(0, "nvfp4", ""), (82, "bf16", "0.82"), (95, "fp32", "95")]
    # 0.57 x 100 is 56.99999999999999 in binary: the nearest step, not the floor
    assert precision_schedule.change_step({"at": 0.57}, 100) == 57
    assert [precision_schedule.segment_after(cfg, done).mode for done in (0, 81, 82, 94, 95, 99)] == [
        "nvfp4", "nvfp4", "bf16", "bf16", "fp32", "fp32"]
    assert [precision_schedule.next_change(cfg, done) for done in (0, 82, 95)] == [82, 95, None]
    assert precision_schedule.label(cfg) == "nvfp4→bf16@0.82→fp32@95"
    assert precision_schedule.described(cfg) == (
        "precision.schedule: nvfp4 steps 1-82 → bf16 steps 83-95 (at 0.82) → fp32 steps 96-100 (at 95)")


def test_a_change_says_the_whole_mode_its_rules_before_the_modes_own():
    cfg = config([{"at": 0.5, "rules": [{"match": "blocks.0.*", "run_in": "fp32"}]},
                  {"at": 0.9, "precision": "bf16", "mode": BF16}])
    rules_only, to_bf16 = precision_schedule.segments(cfg)[1:]
    assert rules_only.mode == "nvfp4+rules"
    assert [r["match"] for r in rules_only.node["rules"]] == ["blocks.0.*", "head"]  # the run's own mode, its rules
    assert to_bf16.node["rules"] == [] and to_bf16.node["name"] == "bf16"  # not the earlier change's rules


@pytest.mark.parametrize("schedule,said", [
    ([{"step": 100, "precision": "bf16", "mode": BF16}], "at or past the run's end"),
    ([{"at": 0.5, "precision": "bf16", "mode": BF16}, {"step": 50, "precision": "fp32", "mode": FP32}],
     "is not after the one before it"),
    ([{"at": 0.001, "precision": "bf16", "mode": BF16}], "is not after the one before it (after step 0)"),
])
def test_changes_out_of_order_or_without_steps_are_refused(schedule, said):
    with pytest.raises(UsageError, match="precision.schedule") as refused:
        precision_schedule.refuse_a_bad_order(config(schedule))
    assert said in str(refused.value)


def test_a_change_is_composed_once_and_a_composed_one_kept():
    asked = []

    def node(name: str) -> dict:
        asked.append(name)
        return {**BF16, "description": "composed now"}

    cfg = typed_config(OmegaConf.create({"precision": {"name": "nvfp4", "schedule": [
        {"at": 0.5, "precision": "bf16"}, {"at": 0.9, "precision": "bf16", "mode": {**BF16, "description": "then"}}]},
        "scaler": {"kind": "none"}, "train": {"steps": 10}}))
    with pytest.raises(UsageError, match="is not resolved"):
        precision_schedule.segments(cfg)
    resolved = precision_schedule.resolved(cfg, node)
    assert asked == ["bf16"]  # the one not composed yet
    assert [s.node["description"] for s in precision_schedule.segments(resolved)[1:]] == ["composed now", "then"]
    assert precision_schedule.resolved(resolved, node) is resolved and asked == ["bf16"]


def test_a_resume_may_change_only_the_changes_ahead_of_it():
    saved = config([{"at": 0.5, "precision": "bf16", "mode": BF16}])
    later = config([{"at": 0.5, "precision": "bf16", "mode": BF16}, {"at": 0.9, "precision": "fp32", "mode": FP32}])
    precision_schedule.refuse_a_changed_past(saved, later, 60)  # a change added after step 60: allowed
    precision_schedule.refuse_a_changed_past(saved, config([]), 50)  # the change after step 50 is still ahead
    with pytest.raises(UsageError, match="trained as nvfp4→bf16@0.5, now nvfp4"):
        precision_schedule.refuse_a_changed_past(saved, config([]), 51)
    # a fraction moves with train.steps: the same schedule over 200 steps would have switched after step 100
    with pytest.raises(UsageError, match="changes the modes of steps the run trained already"):
        precision_schedule.refuse_a_changed_past(saved, config([{"at": 0.5, "precision": "bf16", "mode": BF16}],
                                                               steps=200), 60)


@pytest.mark.parametrize("fields,key", [({}, "at"), ({"at": 0.5, "step": 3, "precision": "bf16"}, "at"),
                                        ({"at": 0.0, "precision": "bf16"}, "at"),
                                        ({"step": 0, "precision": "x"}, "step"),
                                        ({"at": 0.5}, "precision")])
def test_a_change_gives_one_point_inside_the_run_and_something_to_change(fields, key):
    with pytest.raises(ConfigError, match=f"precision.schedule\\[\\].{key}"):
        ScheduledChange(**fields)


def test_a_scheduled_row_of_compare_as_the_overrides_that_run_it():
    assert precision_schedule.row_overrides("bf16") == ["precision=bf16"]
    assert precision_schedule.row_overrides("nvfp4_recipe->bf16@0.82") == [
        "precision=nvfp4_recipe", "precision.schedule=[{at: 0.82, precision: bf16}]"]
    assert precision_schedule.row_overrides("nvfp4→bf16@600→fp32@0.9") == [
        "precision=nvfp4", "precision.schedule=[{step: 600, precision: bf16}, {at: 0.9, precision: fp32}]"]
    assert precision_schedule.modes_in("nvfp4->bf16@0.82") == ["nvfp4", "bf16"]
    assert precision_schedule.row_label("nvfp4->bf16@0.82") == "nvfp4→bf16@0.82"
    assert precision_schedule.dir_name("nvfp4->bf16@0.82") == "nvfp4_then_bf16@0.82"
    for bad in ("nvfp4->bf16", "nvfp4->@0.5", "nvfp4->bf16@x"):
        with pytest.raises(UsageError, match="a scheduled row is MODE->MODE@POINT"):
            precision_schedule.row_overrides(bad)
