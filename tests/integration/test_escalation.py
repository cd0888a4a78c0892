"""guard.on_trip=escalate (runner/guarding/escalation.py): a guard's trip raises the precision of the layer to blame
and the run
trains on from its newest good checkpoint. The escalated timeline equals, bit for bit, the engine's own steps from
that checkpoint with those rules; a resume keeps the rules; a spike that fp32 shares is not escalated; the number of
escalations is bounded; what cannot escalate is refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from ampctl.conf.typed import typed_config
from ampctl.engine.build import build_state
from ampctl.engine.loop import StepSettings, fit
from ampctl.engine.telemetry import JsonlSink, Telemetry
from ampctl.recipes.base import build_recipe
from ampctl.runner.checkpointing import checkpoint
from ampctl.runner.plan import check_config
from tests.support.in_process import run_ampctl

QUIET = ["device=cpu", "train.console=quiet", "train.lr.warmup_steps=0", "telemetry.profile_cpu_memory=false"]
# 'amplifier' overflows fp16 from step 5 on; once it runs in fp32, its output overflows `out`'s fp16 input
EXPLODING = ["recipe=exploding", "precision=fp16", "scaler.init_scale=1", "guard.max_consecutive_skips=4",
             "train.steps=24", "train.log_every=2", "train.checkpoint.every=2", "train.checkpoint.keep=100",
             "guard.on_trip=escalate", *QUIET]
# the batch of step 60 is shifted by 512: 'center' loses it in bf16, not in fp32 (recipes/demonstrations.py)
OFFSET_SPIKE = ["recipe=rounding_spike", "precision=bf16", "optimizer.lr=0.01", "guard.loss_spike=6",
                "guard.loss_spike_window=20", "train.steps=70", "train.log_every=10", "train.checkpoint.every=10",
                "guard.on_trip=escalate", *QUIET]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def train(run: Path, *args: str):
    return run_ampctl("train", *args, f"hydra.run.dir={run}")


def test_an_fp16_overflow_escalates_layer_by_layer_and_the_run_finishes(tmp_path):
    run = tmp_path / "run"
    done = train(run, *EXPLODING)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("escalation ")]
    assert lines == [
        "escalation 1 of at most 3: amplifier -> fp32 (the replay finds 'amplifier' (Amplify, float16) non-finite); "
        "training again from step 4's checkpoint",
        "escalation 2 of at most 3: out -> fp32 (the replay finds 'amplifier' (Amplify, float32) beyond float16's "
        "max 65504 (overflows when cast to float16), then 'out' (Linear, float16) non-finite); training again from "
        "step 4's checkpoint"]
    recorded = rows(run / "escalations.jsonl")
    assert [(r["number"], r["step"], r["tripped_at"], r["raised"]) for r in recorded] == [
        (1, 4, 5, {"amplifier": "fp32"}), (2, 4, 5, {"out": "fp32"})]
    assert recorded[1]["rules"] == [{"match": "amplifier", "run_in": "fp32"}, {"match": "out", "run_in": "fp32"}]
    metrics = rows(run / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, 25))  # each abandoned timeline's rows set aside, not mixed
    assert not any(r["skipped"] for r in metrics)
    assert len(list(run.glob("metrics.jsonl.set-aside-*"))) == 2
    summary = json.loads((run / "summary.json").read_text())
    assert [e["raised"] for e in summary["escalations"]] == [{"amplifier": "fp32"}, {"out": "fp32"}]
    assert "escalated 2x: amplifier -> fp32, out -> fp32" in done.stdout
    final = torch.load(run / "checkpoints" / "step_00000024.pt", weights_only=True)
    assert final["config"]["precision"]["rules"][:2] == [{"run_in": "fp32", "match": "amplifier", "type": None},
                                                         {"run_in": "fp32", "match": "out", "type": None}]
    report = run_ampctl("report", str(run))
    assert report.returncode == 0 and "Escalations" in (run / "report.md").read_text()


def test_the_escalated_timeline_equals_the_engines_steps_from_its_checkpoint_with_its_rules(tmp_path):
    """The reference: the run's config with the two rules written by hand, its state built by the engine, the
    checkpoint at step 4 restored, fit() to step 24; every loss, scale and grad norm the same bits."""
    run = tmp_path / "run"
    assert train(run, *EXPLODING).returncode == 0
    config = json.loads((run / "identity.json").read_text())["config"]
    config["precision"]["rules"] = [{"match": "amplifier", "run_in": "fp32"}, {"match": "out", "run_in": "fp32"}]
    cfg = typed_config(OmegaConf.create(config))
    policy, recipe = check_config(cfg), build_recipe(cfg.recipe)
    source = run / "checkpoints" / "step_00000004.pt"
    with policy:
        state = build_state(cfg, policy, recipe)
        checkpoint.restore(checkpoint.load(source), state, source)
        telemetry = Telemetry(policy.device, 2, recipe.samples_per_batch, None,
                              [JsonlSink(tmp_path / "reference.jsonl")])
        fit(state, recipe, policy, StepSettings.of(cfg.train), telemetry, 24, cfg.train.seed)
        telemetry.close()
    keys = ("step", "loss", "loss_scale", "grad_norm", "skipped")
    escalated = [{k: r[k] for k in keys} for r in rows(run / "metrics.jsonl") if r["step"] > 4]
    assert escalated == [{k: r[k] for k in keys} for r in rows(tmp_path / "reference.jsonl")]


def test_a_resume_from_before_the_escalations_rules_keeps_them(tmp_path):
    """Resumed from the checkpoint the escalations went back to (written before them, without their rules), with the
    original command line (a requeued job names precision=fp16 again): the rules are applied, nothing trips, and the
    steps are the escalated run's, bit for bit."""
    run = tmp_path / "run"
    assert train(run, *EXPLODING).returncode == 0
    escalated = rows(run / "metrics.jsonl")
    again = train(run, *EXPLODING, f"resume={run / 'checkpoints' / 'step_00000004.pt'}")
    assert again.returncode == 0, again.stderr
    assert "escalation" not in again.stdout.replace("escalations.jsonl", "")
    keys = ("step", "loss", "loss_scale", "grad_norm")
    assert [{k: r[k] for k in keys} for r in rows(run / "metrics.jsonl")] == [{k: r[k] for k in keys}
                                                                             for r in escalated]
    assert len(rows(run / "escalations.jsonl")) == 2  # their step (4) is the resume's: kept


def test_a_run_stopped_inside_a_skip_streak_escalates_as_the_uninterrupted_one_after_its_resume(tmp_path):
    """Stopped at step 7 (steps 5-7 skipped, one short of max_consecutive_skips=4) and resumed: the streak goes on
    from the run's own rows, so step 8 trips naming step 5 and both escalations go back to step 4, as in the run
    that never stopped; the weights at the end are the same bits. (A constant learning rate: the stopped run's own
    schedule would be another.)"""
    constant = [*EXPLODING, "train.lr.schedule=constant"]
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    assert train(whole, *constant).returncode == 0
    assert train(stopped, *constant, "train.steps=7").returncode == 0
    resumed = train(stopped, *constant, "resume=auto")
    assert resumed.returncode == 0, resumed.stderr
    kept = ("number", "step", "tripped_at", "reason", "raised", "rules")
    assert [{k: r[k] for k in kept} for r in rows(stopped / "escalations.jsonl")] == [
        {k: r[k] for k in kept} for r in rows(whole / "escalations.jsonl")]
    assert [r["step"] for r in rows(stopped / "escalations.jsonl")] == [4, 4]
    final = [torch.load(run / "checkpoints" / "step_00000024.pt", weights_only=True)["model"]
             for run in (whole, stopped)]
    assert all(torch.equal(final[0][name], final[1][name]) for name in final[0])


def test_max_escalations_then_it_stops_as_a_stop_does(tmp_path):
    run = tmp_path / "run"
    done = train(run, *EXPLODING, "guard.max_escalations=1")
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "Not escalated: guard.max_escalations=1 escalations made already" \
        in done.stderr
    assert len(rows(run / "escalations.jsonl")) == 1
    assert json.loads((run / "diagnosis.json").read_text())["forward_problems"][1]["module"] == "out"


def test_a_finite_spike_that_is_precisions_is_escalated_by_the_layers_own_error(tmp_path):
    run = tmp_path / "run"
    done = train(run, *OFFSET_SPIKE)
    assert done.returncode == 0, done.stderr
    (row,) = rows(run / "escalations.jsonl")
    assert row["raised"] == {"center": "fp32"} and row["step"] == 50 and row["tripped_at"] == 60
    assert "fp32's loss is" in row["evidence"] and "'center' (Center)" in row["evidence"]
    assert rows(run / "metrics.jsonl")[59]["loss"] < 0.5  # step 60 again, with center in fp32: no spike


def test_a_spike_fp32_shares_is_not_escalated(tmp_path):
    """The MLP spike recipe multiplies a batch's inputs by 30: fp32's loss spikes as well; the run stops saying so."""
    run = tmp_path / "run"
    done = run_ampctl("train", "recipe=loss_spike",
                      "recipe.hidden=32", "recipe.norm=none", "recipe.spike_at=45", "guard.loss_spike=6",
                      "guard.loss_spike_window=20", "train.steps=60", "train.log_every=10", "precision=bf16",
                      "guard.on_trip=escalate", *QUIET, f"hydra.run.dir={run}")
    assert done.returncode == 1 and done.stderr.count("\n") == 1
    assert "fp32 spikes as well" in done.stderr and "not precision's" in done.stderr
    assert not (run / "escalations.jsonl").exists()


def test_a_resumed_run_watches_for_spikes_from_its_first_step(tmp_path):
    """The spike watch's window is filled from the run's own rows: a resume at step 50 catches the spike at 60,
    which a window warming up again over 20 steps would miss."""
    run = tmp_path / "run"
    args = [*OFFSET_SPIKE, "guard.on_trip=stop"]
    assert train(run, *args, "train.steps=50").returncode == 0
    resumed = train(run, *args, "train.steps=70", "resume=auto")
    assert resumed.returncode == 1 and "loss spike at step 60" in resumed.stderr


@pytest.mark.parametrize("args,said", [
    (["precision=fp32"], "guard.on_trip=escalate with precision=fp32: no layer runs in a half type or a "
                         "converter's format, so there is none a rule can raise"),
    (["guard.max_escalations=0"], "guard.max_escalations=0 is not allowed: expected an integer >= 1"),
    (["guard.on_trip=rollback"], "guard.on_trip"),
])
def test_what_cannot_escalate_is_refused_before_anything_is_written(tmp_path, args, said):
    run = tmp_path / "run"
    done = train(run, *OFFSET_SPIKE, *args)
    assert done.returncode == 2 and said in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert not run.exists()


def test_a_mirrored_escalated_run_continues_on_another_machine_with_its_escalations(tmp_path):
    """escalations.jsonl goes to the mirror with each checkpoint and comes back with the newest: the run continued
    elsewhere records its escalations and trains with their rules."""
    mirror = f"file://{tmp_path / 'mirror'}"
    assert train(tmp_path / "m1", *EXPLODING, f"train.checkpoint.mirror={mirror}").returncode == 0
    assert (tmp_path / "mirror" / "escalations.jsonl").read_bytes() == \
        (tmp_path / "m1" / "escalations.jsonl").read_bytes()
    pulled = train(tmp_path / "m2", *EXPLODING, "train.steps=30", f"train.checkpoint.mirror={mirror}",
                   "resume=auto")
    assert pulled.returncode == 0, pulled.stderr
    assert "escalation " not in pulled.stdout
    assert [r["raised"] for r in rows(tmp_path / "m2" / "escalations.jsonl")] == [{"amplifier": "fp32"},
                                                                                   {"out": "fp32"}]
    last = torch.load(tmp_path / "m2" / "checkpoints" / "step_00000030.pt", weights_only=True)
    assert [r["match"] for r in last["config"]["precision"]["rules"]] == ["amplifier", "out"]
