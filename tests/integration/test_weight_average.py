"""train.ema.decay in real runs, in every kind of precision mode: the average each checkpoint holds equals the
EMA computed by hand, in float64, from the weights the optimizer stepped on as the checkpoints recorded them (the
model's, or O2's fp32 masters); its evaluation equals the held-out loss of a model holding it, computed by hand;
a resumed run's average equals the uninterrupted one's bit for bit, in whole and sharded checkpoints."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from ampctl.cli import main
from ampctl.recipes.mlp import MLPRecipe

RUN = ["device=cpu", "recipe=mlp", "recipe.hidden=32", "recipe.batch_size=16", "train.log_every=1",
       "train.console=quiet", "telemetry.profile_cpu_memory=false"]
MODES = {"fp32": [], "bf16": ["precision=bf16"], "O2 fp16": ["precision=O2"],
         "O3 bf16": ["precision=O3", "precision.dtype=bfloat16"]}
DECAY, START, EVERY, STEPS = 0.75, 2, 2, 8


def checkpoint(run_dir, step: int) -> dict:
    return torch.load(run_dir / "checkpoints" / f"step_{step:08d}.pt", weights_only=True)


def stepped_weights(payload: dict, names: list[str]) -> dict[str, torch.Tensor]:
    """The weights the optimizer stepped on, by name: the model's, with O2's fp32 masters for its half ones (in
    the order of the model's parameters, fp32 ones being their own)."""
    model = payload["model"]
    if "masters" not in payload["weights"]:
        return {name: model[name].double() for name in names}
    masters = iter(payload["weights"]["masters"])
    return {name: (model[name] if model[name].dtype == torch.float32 else next(masters)).double() for name in names}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_each_checkpoints_average_is_the_ema_of_the_recorded_weights_computed_by_hand(tmp_path, restore_argv, mode):
    run_dir = tmp_path / "run"
    main(["train", *RUN, *MODES[mode], f"train.steps={STEPS}", "train.checkpoint.every=1", "train.checkpoint.keep=20",
          f"train.ema.decay={DECAY}", f"train.ema.start_step={START}", f"train.ema.every={EVERY}",
          f"hydra.run.dir={run_dir}"])
    payloads = {step: checkpoint(run_dir, step) for step in range(START, STEPS + 1)}
    names = list(payloads[STEPS]["ema"])
    assert {t.dtype for t in payloads[STEPS]["ema"].values()} == {torch.float32}  # whatever the weights' dtype
    expected = stepped_weights(payloads[START], names)  # at the start step: the weights themselves
    for step in range(START, STEPS + 1):
        if step > START and (step - START) % EVERY == 0:
            weights = stepped_weights(payloads[step], names)
            expected = {n: DECAY * expected[n] + (1 - DECAY) * weights[n] for n in names}
        held = payloads[step]["ema"]
        for name in names:
            torch.testing.assert_close(held[name].double(), expected[name], rtol=1e-6, atol=1e-7,
                                       msg=f"{mode}, step {step}, {name}")
    if mode == "O3 bf16":  # the average is not the bf16 weights rounded: fp32 keeps what bf16 cannot
        last = payloads[STEPS]
        assert any(not torch.equal(last["ema"][n], last["ema"][n].bfloat16().float()) for n in names)


@pytest.mark.parametrize("mode", ["fp32", "O3 bf16"])
def test_the_averages_evaluation_is_the_held_out_loss_of_a_model_holding_it(tmp_path, restore_argv, mode):
    run_dir = tmp_path / "run"
    main(["train", *RUN, *MODES[mode], "train.steps=6", "train.eval.every=3", "train.eval.batches=2",
          "train.ema.decay=0.5", f"hydra.run.dir={run_dir}"])
    evals = [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines()]
    assert [row["step"] for row in evals] == [3, 6]
    payload = checkpoint(run_dir, 6)
    recipe = MLPRecipe(hidden=32, batch_size=16)
    model = recipe.build_model()
    # the model holds the average in its own dtype (O3: bf16), as the run evaluated it, autocast as the run's
    dtype = next(iter(payload["model"].values())).dtype
    model.to(dtype).load_state_dict({n: t.to(dtype) for n, t in payload["ema"].items()}, strict=False)
    model.eval()
    sums = torch.zeros((), dtype=torch.float64)
    count = 0
    with torch.no_grad():
        for batch in itertools.islice(recipe.eval_batches(torch.device("cpu")), 2):
            x, y = batch
            x = x.to(dtype)
            logits = model(x).float()
            sums += torch.nn.functional.cross_entropy(logits, y, reduction="sum").double()
            count += len(y)
    assert evals[-1]["eval/ema_loss"] == pytest.approx(sums.item() / count, rel=1e-5)
    assert evals[-1]["eval/ema_loss"] != evals[-1]["eval/loss"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval"]["eval/ema_loss"] == evals[-1]["eval/ema_loss"]


@pytest.mark.parametrize("checkpoint_format", ["full", "sharded"])
def test_a_resumed_runs_average_equals_the_uninterrupted_ones_bit_for_bit(tmp_path, restore_argv, checkpoint_format):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = [*RUN, "precision=O3", "precision.dtype=bfloat16", "train.ema.decay=0.9", "train.ema.every=2",
              "train.eval.every=5", "train.eval.batches=1", "train.checkpoint.every=5",
              f"distributed.checkpoint_format={checkpoint_format}"]
    main(["train", *common, "train.steps=10", f"hydra.run.dir={straight}"])
    main(["train", *common, "train.steps=5", f"hydra.run.dir={resumed}"])
    main(["train", *common, "train.steps=10", f"hydra.run.dir={resumed}", "resume=auto"])
    assert (resumed / "evals.jsonl").read_text().splitlines()[-1].split('"seconds"')[0] == \
        (straight / "evals.jsonl").read_text().splitlines()[-1].split('"seconds"')[0]
    if checkpoint_format == "full":
        a, b = checkpoint(straight, 10)["ema"], checkpoint(resumed, 10)["ema"]
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


FSDP = ["device=cpu", "recipe=mlp", "recipe.hidden=64", "recipe.batch_size=16", "train.steps=8", "train.log_every=4",
        "train.checkpoint.every=4", "train.console=plain", "distributed=fsdp", "telemetry.profile_cpu_memory=false",
        "train.ema.decay=0.5", "train.ema.start_step=4", "train.ema.every=4", "train.eval.every=4",
        "train.eval.batches=1"]


@pytest.mark.slow
def test_under_fsdp_each_rank_averages_its_shards_and_a_checkpoint_holds_the_whole_average(tmp_path, restore_argv):
    """Two ranks, each averaging its own shards (DTensors, no communication): the whole checkpoint's average
    (gathered) is the EMA of its whole weights computed by hand; the sharded checkpoint's (each rank's shard,
    read back whole by torch's converter) is the same; resumed on one process (DCP reshards it), both continue
    alike."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tests.support.runs import torchrun

    sharded = torchrun(tmp_path / "sharded", *FSDP)
    assert sharded.returncode == 0, sharded.stderr
    full = torchrun(tmp_path / "full", *FSDP, "distributed.checkpoint_format=full")
    assert full.returncode == 0, full.stderr
    at_4, at_8 = checkpoint(tmp_path / "full", 4), checkpoint(tmp_path / "full", 8)
    for name, average in at_8["ema"].items():
        expected = 0.5 * at_4["model"][name].double() + 0.5 * at_8["model"][name].double()
        torch.testing.assert_close(average.double(), expected, rtol=1e-6, atol=1e-7)
        assert torch.equal(at_4["ema"][name], at_4["model"][name])  # the start step: the weights
    dcp_to_torch_save(tmp_path / "sharded" / "checkpoints" / "step_00000008.dcp", tmp_path / "converted.pt")
    converted = torch.load(tmp_path / "converted.pt", weights_only=True)["ema"]
    assert converted.keys() == at_8["ema"].keys() and all(torch.equal(converted[n], at_8["ema"][n]) for n in converted)
    for run in ("sharded", "full"):
        ext = "dcp" if run == "sharded" else "pt"
        main(["train", f"resume={tmp_path / run / 'checkpoints' / f'step_00000004.{ext}'}", "distributed=none",
              "train.console=quiet", "telemetry.profile_cpu_memory=false", f"hydra.run.dir={tmp_path / 'other'}"])
    evals = {run: (tmp_path / run / "evals.jsonl").read_text().splitlines() for run in ("sharded", "full")}
    continued = {run: [json.loads(e) for e in lines] for run, lines in evals.items()}  # rows past 4 set aside
    assert [r["step"] for r in continued["sharded"]] == [4, 8]
    assert continued["sharded"][1]["eval/ema_loss"] == continued["full"][1]["eval/ema_loss"]


def test_the_best_checkpoints_can_be_ranked_by_the_averages_metric(tmp_path, restore_argv):
    run_dir = tmp_path / "run"
    main(["train", *RUN, "train.steps=12", "train.eval.every=2", "train.eval.batches=1", "train.ema.decay=0.6",
          "train.checkpoint.save_top_k=2", "train.checkpoint.monitor=ema_loss", f"hydra.run.dir={run_dir}"])
    evals = [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines()]
    ranked = sorted(evals, key=lambda row: (row["eval/ema_loss"], row["step"]))[:2]
    index = json.loads((run_dir / "checkpoints" / "best" / "best.json").read_text())
    assert [entry["step"] for entry in index["checkpoints"]] == [row["step"] for row in ranked], index
    assert index["monitor"] == "ema_loss" and index["mode"] == "min"  # min: loss's direction, without monitor_mode
    assert [entry["value"] for entry in index["checkpoints"]] == [row["eval/ema_loss"] for row in ranked]
