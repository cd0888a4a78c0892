"""train.diff.every (runner/layer_error_log.py): each layer's error against fp32 every N steps, at the run's
weights. The measurement leaves training bit for bit as it was (losses, the loss scale, BatchNorm's statistics);
its row at a step is what `ampctl diff` measures at that step's checkpoint; the run's report draws the heatmap;
what it cannot measure is refused in one line before anything is written."""

from __future__ import annotations

import json

import pytest

import ampctl
from tests.support.in_process import run_ampctl

MLP = ["device=cpu", "recipe=mlp", "recipe.hidden=32", "recipe.batch_size=16", "train.console=quiet",
       "train.lr.warmup_steps=0"]


def rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("precision,norm", [("bf16", "layernorm"), ("fp16", "batchnorm")])
def test_the_measurement_leaves_training_bit_for_bit_as_it_was(tmp_path, precision, norm):
    args = [*MLP, f"precision={precision}", f"recipe.norm={norm}", "train.steps=12"]
    plain = ampctl.train(args, run_dir=tmp_path / "plain")
    watched = ampctl.train([*args, "train.diff.every=4"], run_dir=tmp_path / "watched")
    keys = ("loss", "loss_scale", "grad_norm", "skipped")
    assert [{k: r[k] for k in keys} for r in rows(plain.run_dir / "metrics.jsonl")] == \
        [{k: r[k] for k in keys} for r in rows(watched.run_dir / "metrics.jsonl")]
    measured = rows(watched.run_dir / "diffs.jsonl")
    assert [r["step"] for r in measured] == [4, 8, 12] and all(r["gradient_error"] > 0 for r in measured)


def test_a_row_is_what_ampctl_diff_measures_at_that_steps_checkpoint(tmp_path):
    run = ampctl.train([*MLP, "precision=bf16", "train.steps=10", "train.diff.every=10"], run_dir=tmp_path / "run")
    logged = rows(run.run_dir / "diffs.jsonl")[0]
    diff = ampctl.diff([*MLP, "precision=bf16", "diff.batches=2", f"diff.weights={run.run_dir}"],
                       out_dir=tmp_path / "diff")
    assert diff.summary["model"]["gradient_error"] == pytest.approx(logged["gradient_error"], rel=1e-9)
    for row in diff.summary["rows"]:
        for key in ("out_local", "dgrad_local", "wgrad_local"):
            if row[key] is not None:
                assert row[key] == pytest.approx(logged["layers"][row["layer"]][key], rel=1e-9), (row["layer"], key)


def test_a_mixture_of_experts_row_has_its_routing_and_experts_as_ampctl_diff_measures_them(tmp_path):
    """recipe=moe in mxfp8: the row's routers (tokens sent to other experts, by the router alone, the scores' error)
    and each expert's own output error equal `ampctl diff`'s at that step's checkpoint; the trackers' diff/routing."""
    moe = ["device=cpu", "recipe=moe", "recipe.n_layers=2", "recipe.d_model=32", "recipe.n_heads=2",
           "recipe.experts=4", "recipe.expert_hidden=32", "recipe.block_size=32", "recipe.batch_size=8",
           "recipe.max_corpus_bytes=200000", "train.console=quiet", "precision=mxfp8"]
    run = ampctl.train([*moe, "train.steps=4", "train.diff.every=4", "logger=csv"], run_dir=tmp_path / "run")
    logged = rows(run.run_dir / "diffs.jsonl")[0]
    diff = ampctl.diff([*moe, "diff.batches=2", f"diff.weights={run.run_dir}"], out_dir=tmp_path / "diff")
    routing = {r["router"]: r for r in diff.summary["routing"]}
    assert [r["router"] for r in logged["routing"]] == list(routing) == ["blocks.0.mlp.router", "blocks.1.mlp.router"]
    assert any(r["flipped"] > 0 for r in logged["routing"])
    for row in logged["routing"]:
        for key in ("tokens", "flipped", "own_flipped"):
            assert row[key] == routing[row["router"]][key], (row["router"], key)
        assert row["scores_error"] == pytest.approx(routing[row["router"]]["scores_error"], rel=1e-9)
    for layer, errors in diff.summary["experts"].items():
        assert logged["layers"][layer]["per_expert_out"] == pytest.approx(errors, rel=1e-9)
    header = (run.run_dir / "metrics_diff.csv").read_text().splitlines()[0]
    assert "diff/routing/blocks.0.mlp.router" in header


def test_the_runs_report_draws_its_layers_over_the_steps(tmp_path):
    run = ampctl.train([*MLP, "precision=bf16", "train.steps=6", "train.diff.every=2"], run_dir=tmp_path / "run")
    shown = run_ampctl("report", str(run.run_dir), cwd=tmp_path)
    assert shown.returncode == 0 and "layer_errors.png" in shown.stdout, shown.stderr
    assert (run.run_dir / "layer_errors.png").stat().st_size > 0


def test_what_it_cannot_measure_is_refused_before_anything_is_written(tmp_path):
    refused = run_ampctl("train", *MLP, "train.diff.every=2", "train.compile.enabled=true",
                         f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "train.diff.every with train.compile.enabled=true" in refused.stderr
    assert not (tmp_path / "run").exists()
    bad = run_ampctl("train", *MLP, "train.diff.every=2", "train.diff.batches=1", f"hydra.run.dir={tmp_path / 'r2'}",
                     cwd=tmp_path)
    assert bad.returncode == 2 and "train.diff.batches=1 is not allowed: expected an integer >= 2" in bad.stderr
