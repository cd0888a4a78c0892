"""train.compile: every mode compiles, the compiled run trains as the eager one does, compile time is
reported on its own and left out of the step times, a compiled run's checkpoint resumes eagerly, recompiling
steps are named, and compare runs each mode both ways when asked."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from ampctl.cli import main
from ampctl.engine.compilation import CUDA_GRAPH_MODES, compile_model

TINY_GPT = ["device=cpu", "recipe=gpt", "recipe.d_model=32", "recipe.n_layers=2", "recipe.n_heads=2",
            "recipe.block_size=32", "recipe.batch_size=4", "recipe.max_corpus_bytes=100000", "train.steps=8",
            "train.log_every=4", "train.console=plain", "telemetry.profile_cpu_memory=false"]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run(run_dir: Path, *args: str) -> dict:
    main(["train", *args, f"hydra.run.dir={run_dir}"])
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize("mode", ["fp32", "fp16"])  # fp16: autocast and the dynamic loss scaler, compiled
def test_a_compiled_run_trains_as_the_eager_one_and_reports_its_compile_time(tmp_path, restore_argv, capsys, mode):
    """Each block is compiled with activation checkpointing inside it; the losses, loss scales and skipped
    steps match the eager run's (fused kernels round differently: a relative tolerance on the loss)."""
    args = [*TINY_GPT, f"precision={mode}", "train.activation_checkpointing=true",
            *(["scaler.init_scale=1e9"] if mode == "fp16" else [])]
    eager = run(tmp_path / "eager", *args)
    compiled = run(tmp_path / "compiled", *args, "train.compile.enabled=true", "train.timing_warmup_steps=0")
    out = capsys.readouterr().out
    assert [r["loss"] for r in rows(tmp_path / "compiled")] == pytest.approx(
        [r["loss"] for r in rows(tmp_path / "eager")], rel=1e-3)
    assert ([(r["loss_scale"], r["skipped"]) for r in rows(tmp_path / "compiled")]
            == [(r["loss_scale"], r["skipped"]) for r in rows(tmp_path / "eager")])
    assert eager["compiled"] is False and eager["compile_s"] is None
    assert compiled["compiled"] is True and compiled["compile_mode"] == "default"
    assert compiled["compile_s"] > 0 and compiled["compilations"] >= 1  # the backward too when not cached
    # the step that compiled is not timed, even with no warm-up steps
    assert compiled["timed_steps"] == 8 - 1
    assert f"compiled in {compiled['compile_s']:.1f} s (not in the step times)" in out


def test_a_compiled_runs_checkpoint_resumes_eagerly(tmp_path, restore_argv, capsys):
    """Module.compile() works in place: parameter names and the checkpoint are the eager model's."""
    run_dir = tmp_path / "run"
    run(run_dir, *TINY_GPT, "train.compile.enabled=true")
    main(["train", f"resume={run_dir}", "train.steps=10", "train.compile.enabled=false"])
    assert "changed: train.compile.enabled: True -> False" in capsys.readouterr().out
    assert [r["step"] for r in rows(run_dir)] == list(range(1, 11))


def test_steps_that_recompile_are_named_and_left_out_of_the_timings(tmp_path, restore_argv, capsys):
    summary = run(tmp_path / "run", "device=cpu", "recipe=mlp",
                  "recipe._target_=tests.support.shape_changing_recipe.ShapeChangingRecipe",
                  "recipe.hidden=32", "recipe.batch_size=16", "train.steps=6", "train.log_every=3",
                  "train.console=plain", "telemetry.profile_cpu_memory=false", "train.compile.enabled=true",
                  "train.timing_warmup_steps=0")
    out = capsys.readouterr().out
    assert "warning: torch.compile compiled" in out and "more time(s) after step 1 (at step 2" in out, out
    assert "TORCH_LOGS=recompiles" in out
    assert summary["timed_steps"] == 6 - 2  # steps 1 and 2 compiled


def test_compare_runs_each_mode_eager_and_compiled_and_the_table_says_which(tmp_path, restore_argv):
    out = tmp_path / "cmp"
    main(["compare", "device=cpu", "recipe=mlp", "recipe.hidden=32", "recipe.batch_size=16", "train.steps=6",
          "train.log_every=3", "telemetry.profile_cpu_memory=false", "compare.precisions=[fp32]",
          "compare.warmup_steps=2", "compare.rounds=2", "compare.compile=[false,true]", f"hydra.run.dir={out}"])
    table = list(csv.DictReader((out / "comparison.csv").open()))
    assert [(r["precision"], r["compiled"]) for r in table] == [("fp32", "False"), ("fp32+compile", "True")]
    assert float(table[1]["compile_s"]) > 0 and table[0]["compile_s"] == ""
    # against this CPU's measured matmul peak, where it has one: a probe taken on a busy machine gives none, and the
    # runs say so instead of a figure
    sources = {json.loads(p.read_text())["peak_source"] for p in out.rglob("summary.json")}
    assert all(0 < float(row["mfu"]) <= 1.5 for row in table) or (
        all(row["mfu"] == "" for row in table) and sources and all("was busy" in s for s in sources)), sources


def test_fp8_without_compile_is_warned_about():
    import torch
    from omegaconf import OmegaConf

    from ampctl.analysis import mode_advice
    from ampctl.engine.precision.policy import PrecisionPolicy
    from tests.support.training import compose_cfg

    policy = PrecisionPolicy(OmegaConf.to_object(compose_cfg("precision=fp8").precision), torch.device("cpu"))
    assert "add train.compile.enabled=true" in mode_advice.speed_warnings(policy, compiled=False)[0]


@pytest.mark.slow
def test_fsdp_shards_compiled_blocks_and_trains_as_eager_fsdp(tmp_path):
    """Compiled blocks (activation checkpointing inside), then fully_shard on them: two ranks train as the
    eager sharded job does."""
    from tests.support.runs import torchrun

    args = [*TINY_GPT, "distributed=fsdp", "train.activation_checkpointing=true"]
    eager = torchrun(tmp_path / "eager", *args)
    compiled = torchrun(tmp_path / "compiled", *args, "train.compile.enabled=true")
    assert eager.returncode == 0 and compiled.returncode == 0, compiled.stderr[-2000:]
    assert "torch.compile (mode=default): each of the recipe's 2 blocks" in compiled.stdout
    assert [r["loss"] for r in rows(tmp_path / "compiled")] == pytest.approx(
        [r["loss"] for r in rows(tmp_path / "eager")], rel=1e-3)
    assert json.loads((tmp_path / "compiled" / "summary.json").read_text())["compile_s"] > 0


@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"])
def test_a_cuda_graph_mode_marks_a_step_before_each_forward_of_the_model(monkeypatch, mode):
    """compile_model's CUDA-graph steps, counted by the calls torch receives (no compilation runs: the block
    compiled is never called). Here, not in tests/unit: Module.compile imports Dynamo (2-4 s)."""
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(len(marks)))
    model = nn.Sequential(nn.Linear(2, 2))
    unused_block = nn.Linear(1, 1)  # compiled lazily and never called: no compilation in this test
    assert compile_model(model, [unused_block], mode) == 1
    for _ in range(3):
        model(torch.ones(1, 2))
    with torch.no_grad():  # an evaluation's forward begins a step too
        model(torch.ones(1, 2))
    assert len(marks) == (4 if mode in CUDA_GRAPH_MODES else 0)
