"""train.checkpoint.save_top_k: the K best checkpoints by an evaluation metric, beside the newest ones: ranked as the
metric says (against the evaluations' own rows), written whole and checksummed, continued across a resume, set aside
with an abandoned timeline, and refused in one line when the metric does not exist."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from ampctl.cli import main
from tests.support.training import FAST, train_here

BEST = ["train.eval.every=5", "train.eval.batches=2", "train.checkpoint.save_top_k=2"]


def evals(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines()]


def index(run_dir) -> dict:
    return json.loads((run_dir / "checkpoints" / "best" / "best.json").read_text())


def expected_best(rows: list[dict], metric: str, k: int, largest: bool) -> list[int]:
    """The steps of the k best rows, ties to the earlier step."""
    ranked = sorted(rows, key=lambda r: ((-r[metric]) if largest else r[metric], r["step"]))
    return [r["step"] for r in ranked[:k]]


@pytest.mark.parametrize("monitor,largest", [("loss", False), ("accuracy", True)])
def test_the_k_best_by_the_monitored_metric_are_kept_whole_and_checksummed(tmp_path, monitor, largest):
    summary, _ = train_here(tmp_path, "train.steps=40", *BEST, f"train.checkpoint.monitor={monitor}",
                            "recipe.hidden=16")
    rows = evals(tmp_path)
    assert len(rows) == 8
    kept = index(tmp_path)
    assert kept["monitor"] == monitor and kept["mode"] == ("max" if largest else "min")
    steps = [e["step"] for e in kept["checkpoints"]]
    assert steps == expected_best(rows, f"eval/{monitor}", 2, largest)
    folder = tmp_path / "checkpoints" / "best"
    assert sorted(p.name for p in folder.glob("step_*.pt")) == sorted(f"step_{s:08d}.pt" for s in steps)
    for step in steps:
        path = folder / f"step_{step:08d}.pt"
        assert (folder / f"{path.name}.sha256").read_text().split()[0] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert torch.load(path, weights_only=True)["step"] == step
    assert summary["eval_best"]["step"] == steps[0]
    assert summary["eval_best"][monitor] == kept["checkpoints"][0]["value"]
    assert len(list((tmp_path / "checkpoints").glob("step_*.pt"))) >= 1  # the newest ones are kept beside them


def test_a_resumed_run_goes_on_ranking_and_an_abandoned_timelines_best_are_set_aside(tmp_path):
    common = [*BEST, "train.checkpoint.save_top_k=3", "train.checkpoint.every=10", "train.checkpoint.keep=5",
              "recipe.hidden=16"]
    train_here(tmp_path, "train.steps=20", *common)
    train_here(tmp_path, "train.steps=40", *common, "resume=auto")  # goes on from step 20
    whole = evals(tmp_path)
    assert [r["step"] for r in whole] == list(range(5, 41, 5))
    assert [e["step"] for e in index(tmp_path)["checkpoints"]] == expected_best(whole, "eval/loss", 3, False)
    # resumed from step 10 on purpose: the evaluations and best checkpoints after it belong to another timeline
    train_here(tmp_path, "train.steps=20", *common, f"resume={tmp_path / 'checkpoints' / 'step_00000010.pt'}")
    assert [r["step"] for r in evals(tmp_path)] == [5, 10, 15, 20]
    # ranked again among what exists: steps 5 and 10 had been displaced (and deleted) by the abandoned timeline's
    kept = [e["step"] for e in index(tmp_path)["checkpoints"]]
    assert kept == [20, 15] == expected_best(evals(tmp_path)[2:], "eval/loss", 3, False)
    aside = list((tmp_path / "checkpoints").glob("timeline*/step_*.pt"))
    assert aside and list(tmp_path.glob("evals.jsonl.set-aside-*"))


def test_a_monitor_the_recipe_does_not_give_is_one_line_and_nothing_is_recorded(tmp_path, restore_argv, capsys):
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *FAST, *BEST, "train.checkpoint.monitor=f1", "train.checkpoint.monitor_mode=max",
              "train.steps=10", f"hydra.run.dir={run}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == ("ampctl train: error: train.checkpoint.monitor=f1: the recipe's evaluation gives no such metric; "
                   "it gives accuracy, loss\n")
    assert not run.exists() or not any(p.name in ("metrics.jsonl", "evals.jsonl", "checkpoints")
                                       for p in run.iterdir())


@pytest.mark.parametrize("args,message", [
    (["train.checkpoint.save_top_k=2"],
     "train.checkpoint.save_top_k=2 is not allowed: expected 0 without train.eval.every"),
    (["train.eval.every=5", "train.checkpoint.save_top_k=1", "train.checkpoint.monitor=f1"],
     "train.checkpoint.monitor='f1' is not allowed: expected loss, perplexity, accuracy, or any metric of the "
     "recipe's with train.checkpoint.monitor_mode=min|max"),
    (["train.eval.every=0"], "train.eval.every=0 is not allowed: expected an integer >= 1, or null"),
    (["train.eval.every=5", "train.eval.batches=0"], "train.eval.batches=0 is not allowed: expected an integer >= 1"),
    (["precision=fp8_emulated", "train.eval.every=5", "train.eval.fp32=true"],
     "train.eval.fp32=true with precision=fp8_emulated: its converted layers compute in their format whatever autocast "
     "says"),
    (["precision=bf16", "precision.rules=[{match:'0',run_in:mxfp8}]", "train.eval.every=5", "train.eval.fp32=true"],
     "train.eval.fp32=true with precision=bf16: its converted layers compute in their format whatever autocast says"),
])
def test_bad_evaluation_settings_are_one_line(tmp_path, restore_argv, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *FAST, *args, f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing recorded


def test_a_garbled_index_is_said_set_aside_and_ranked_again_from_the_evaluations(tmp_path):
    """best.json garbled on disk: it was rebuilt without a word (its ranking lost); now said, kept beside, and the
    best checkpoints on disk ranked again from evals.jsonl, as an independent ranking of those rows gives."""
    common = [*BEST, "train.checkpoint.save_top_k=3", "train.checkpoint.every=10", "recipe.hidden=16"]
    train_here(tmp_path, "train.steps=20", *common)
    (tmp_path / "checkpoints" / "best" / "best.json").write_bytes(b"\x00{garbled")
    train_here(tmp_path, "train.steps=30", *common, "resume=auto")
    out = (tmp_path / "train.log").read_text()
    assert "best.json could not be read (garbled): set aside as best.json.set-aside-" in out
    assert list((tmp_path / "checkpoints" / "best").glob("best.json.set-aside-*"))
    assert [e["step"] for e in index(tmp_path)["checkpoints"]] == expected_best(evals(tmp_path), "eval/loss", 3, False)
