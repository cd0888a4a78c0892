"""precision.schedule in real runs: a run that switches from nvfp4 to bf16 after step k equals, bit for bit, a run of
nvfp4 to k resumed from its checkpoint in bf16; resumed before or after its switch it equals itself; and it says
the switch where a user looks (the start line, the log, summary.json)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ampctl.cli import main
from tests.support.runs import rows

# a constant lr: the run of the first mode alone stops at the switch, and its resume trains on to the end with the
# same lr (a decaying one ends where train.steps says); two micro-batches a step
RUN = ["device=cpu", "recipe=mlp", "recipe.hidden=48", "recipe.batch_size=16", "precision=nvfp4",
       "train.lr.schedule=constant", "train.lr.warmup_steps=0", "train.steps=8", "train.grad_accum_steps=2",
       "train.checkpoint.every=2", "train.checkpoint.keep=4", "train.log_every=1", "train.console=quiet",
       "telemetry.profile_cpu_memory=false"]
SWITCH = "precision.schedule=[{step: 4, precision: bf16}]"


def weights(run_dir: Path, step: int = 8) -> dict:
    return torch.load(run_dir / "checkpoints" / f"step_{step:08d}.pt", weights_only=True)["model"]


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def switched(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("switched") / "run"
    main(["train", *RUN, SWITCH, f"hydra.run.dir={run_dir}"])
    return run_dir


def test_a_switch_equals_the_first_mode_to_its_step_and_a_resume_in_the_second(switched, tmp_path, restore_argv):
    halves = tmp_path / "halves"
    main(["train", *RUN, "train.steps=4", f"hydra.run.dir={halves}"])  # nvfp4 alone, to the switch
    # the schedule given on resume: the steps ahead of it may change mode
    main(["train", *RUN, SWITCH, f"hydra.run.dir={halves}", "resume=auto"])
    assert rows(switched) == rows(halves) and len(rows(switched)) == 8
    assert same_weights(weights(switched), weights(halves))
    # the switch matters: nvfp4 to the end trains otherwise after step 4, bf16 from the start from step 1
    nvfp4, bf16 = tmp_path / "nvfp4", tmp_path / "bf16"
    main(["train", *RUN, f"hydra.run.dir={nvfp4}"])
    main(["train", *RUN, "precision=bf16", f"hydra.run.dir={bf16}"])
    assert rows(nvfp4)[:4] == rows(switched)[:4] and rows(nvfp4)[4:] != rows(switched)[4:]
    assert rows(bf16)[0] != rows(switched)[0]


@pytest.mark.parametrize("resumed_at", [2, 6])
def test_a_resume_before_or_after_the_switch_equals_the_whole_run(switched, tmp_path, restore_argv, resumed_at):
    copy = tmp_path / "copy"
    shutil.copytree(switched, copy)
    # the run's own config (its schedule with its mode) from the checkpoint: the command line names none of it
    main(["train", f"resume={copy / 'checkpoints' / f'step_{resumed_at:08d}.pt'}", "train.console=quiet",
          f"hydra.run.dir={tmp_path / 'other'}"])
    assert rows(copy) == rows(switched)
    assert same_weights(weights(copy), weights(switched))
    log = (copy / "train.log").read_text()
    resumed = log[log.rindex("Selected precision="):]  # the resumed process's lines
    assert resumed.startswith("Selected precision=" + ("nvfp4" if resumed_at < 4 else "bf16"))
    assert ("precision: nvfp4 -> bf16 after step 4" in resumed) == (resumed_at < 4)


def test_the_switch_is_said_on_the_start_line_in_the_log_and_in_the_summary(switched):
    log = (switched / "train.log").read_text()
    assert "precision.schedule: nvfp4 steps 1-4 → bf16 steps 5-8 (at 4)" in log
    assert "precision: nvfp4 -> bf16 after step 4 (precision.schedule at 4)" in log
    summary = json.loads((switched / "summary.json").read_text())
    assert summary["precision"] == "nvfp4" and summary["precision_scheduled"] == "nvfp4→bf16@4"
    assert summary["schedule"] == [{"after_step": 4, "at": "4", "precision": "bf16", "rules": []}]
    assert summary["emulated"] and summary["converter"]["name"] == "mx_emulated"  # its first mode's format
    # the checkpoint written at the switch is the run's, its config the run's own (the schedule with its mode)
    saved = torch.load(switched / "checkpoints" / "step_00000004.pt", weights_only=False)["config"]["precision"]
    assert saved["name"] == "nvfp4" and saved["schedule"][0]["mode"]["name"] == "bf16"


def test_a_fraction_switches_at_the_nearest_step_and_rules_change_alone(tmp_path, restore_argv):
    run_dir = tmp_path / "rules"
    main(["train", *RUN, "precision.schedule=[{at: 0.75, rules: [{match: '0', run_in: bf16}]}]",
          f"hydra.run.dir={run_dir}"])
    log = (run_dir / "train.log").read_text()
    assert "precision: nvfp4 -> nvfp4+rules after step 6 (precision.schedule at 0.75)" in log
    after = log[log.index("after step 6"):]
    assert "bfloat16" in after and "MXLinear" in after  # the rebuilt run's layer table: the rule in force


def test_a_resume_may_change_the_schedule_ahead_of_it_only(switched, tmp_path, capsys, restore_argv):
    copy = tmp_path / "copy"
    shutil.copytree(switched, copy)
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    checkpoint = copy / "checkpoints" / "step_00000006.pt"
    with pytest.raises(SystemExit) as refused:  # steps 5-6 trained in bf16: a change at 2 rewrites them
        main(["train", f"resume={checkpoint}", "precision.schedule=[{step: 2, precision: bf16}]",
              f"hydra.run.dir={tmp_path / 'other'}"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.count("\n") == 1, err
    assert "resume: precision.schedule changes the modes of steps the run trained already" in err
    assert "trained as nvfp4→bf16@4, now nvfp4→bf16@2" in err
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before


def test_the_report_names_the_schedule_and_marks_the_switch_on_the_loss_plot(switched, tmp_path, restore_argv):
    copy = tmp_path / "copy"
    shutil.copytree(switched, copy)
    main(["report", str(copy)])
    report = (copy / "report.md").read_text()
    assert "| precision_scheduled | nvfp4→bf16@4 |" in report, report
    assert (copy / "loss.png").stat().st_size > 0
