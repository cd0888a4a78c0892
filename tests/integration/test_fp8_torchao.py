"""precision=fp8: torchao's float8 training. Refused on this CPU, as on any device without FP8 tensor cores;
with that one check lifted, the same torchao layers run here (torch._scaled_mm has a CPU kernel), so the
wiring (conversion, size filter, bf16 autocast, checkpoints) is tested without a GPU. Speed is the GPU's
part: tests/gpu/test_cuda.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampctl.cli import main
from ampctl.engine.precision import fp8_torchao
from tests.support.training import QUIET, train_here

pytest.importorskip("torchao", reason="torchao is the optional extra ampctl[fp8] (installed by [dev])")

GPT = ["recipe=gpt", "recipe.d_model=64", "recipe.n_layers=2", "recipe.n_heads=2", "recipe.block_size=32",
       "recipe.batch_size=4", "recipe.max_corpus_bytes=200000", "train.steps=30"]
# The tiny gpt's layers are far below torchao's size thresholds: convert them all; eager (train.compile's default:
# minutes of compiling for a test of the numerics).
EVERY_LINEAR = ["precision=fp8", "precision.options.auto_filter_small_kn=false"]


@pytest.fixture
def fp8_tensor_cores(monkeypatch):
    """Pretend this device has FP8 tensor cores: the one check a CPU fails; and torch's own CPU kernel for the FP8
    matmul (tests/support/fp8_anywhere.torchs_own_fp8_matmul: oneDNN's is ~500x slower here, bit for bit the same).
    """
    monkeypatch.setattr(fp8_torchao, "unsupported_reason", lambda _device: None)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)


def test_fp8_is_refused_without_fp8_tensor_cores_in_one_line(tmp_path, restore_argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "precision=fp8", "device=cpu", f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "precision=fp8 needs FP8 tensor cores (a CUDA GPU of compute capability 8.9+" in err
    assert "use precision=fp8_emulated" in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("recipe_name", ["tensorwise", "rowwise"])
def test_a_torchao_fp8_gpt_trains_within_a_tolerance_of_bf16(tmp_path, fp8_tensor_cores, recipe_name):
    _, bf16 = train_here(tmp_path / "bf16", *GPT, "precision=bf16", base=QUIET)
    recipe_arg = f"precision.options.recipe_name={recipe_name}"
    _, fp8 = train_here(tmp_path / "fp8", *GPT, *EVERY_LINEAR, recipe_arg, base=QUIET)
    losses = [r["loss"] for r in fp8]
    assert losses[-1] < losses[0] - 1.0  # it learns
    assert abs(losses[-1] - bf16[-1]["loss"]) < 0.05, (losses[-1], bf16[-1]["loss"])
    assert losses != [r["loss"] for r in bf16]  # and it is not bf16 under another name


def test_the_size_filter_keeps_small_and_named_layers_in_bf16():
    model = nn.Sequential()
    model.add_module("up", nn.Linear(1024, 2048))  # N=2048 > 1024: worth FP8 under tensorwise
    model.add_module("square", nn.Linear(1024, 1024))  # K <= 4096 and N <= 1024: slower in FP8
    model.add_module("odd", nn.Linear(1000, 2048))  # K not a multiple of 16: no FP8 matmul
    model.add_module("head", nn.Linear(1024, 2048))  # named in filter_fqns
    converter = fp8_torchao.TorchaoFp8Converter(
        fp8_torchao.Fp8TorchaoOptions(filter_fqns=["head"]), torch.device("cpu"))
    assert wanted(converter, model) == ["up"]
    converter.convert_model(model, {"up": "fp8"})
    assert [type(m).__name__ for m in model] == ["Float8Linear", "Linear", "Linear", "Linear"]
    # without the size heuristics, every layer the FP8 matmul accepts, less the named ones
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(30, 32))
    converter = fp8_torchao.TorchaoFp8Converter(
        fp8_torchao.Fp8TorchaoOptions(auto_filter_small_kn=False), torch.device("cpu"))
    assert wanted(converter, model) == ["0"]


def wanted(converter, model):
    return [fqn for fqn, module in model.named_modules() if fqn and converter.wants(module, fqn)]


def test_a_model_with_nothing_worth_fp8_is_refused_not_run_as_bf16(tmp_path, fp8_tensor_cores, restore_argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *QUIET, *GPT, "precision=fp8", f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "precision=fp8 would convert none of this model's 9 nn.Linear layers to FP8" in err, err
    assert "auto_filter_small_kn=false" in err and err.count("\n") == 1
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_fp8_run_resumes_exactly(tmp_path, fp8_tensor_cores):
    """Float8Linear keeps nn.Linear's parameter names and tensorwise scaling keeps no state across steps:
    the checkpoint is the bf16 one, and a resumed run continues bit for bit. (A constant lr: the cosine
    schedule of a 3-step run is not the first half of a 6-step one.)"""
    args = [*GPT, *EVERY_LINEAR, "train.steps=6", "train.lr.schedule=constant"]
    _, whole = train_here(tmp_path / "whole", *args, base=QUIET)
    train_here(tmp_path / "resumed", *args, "train.steps=3", base=QUIET)
    _, resumed = train_here(tmp_path / "resumed", *args, "resume=auto", base=QUIET)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]


def test_compare_lists_fp8_as_skipped_with_the_reason_on_this_cpu(tmp_path, restore_argv, capsys):
    main(["compare", *GPT, "device=cpu", "train.steps=3", "compare.warmup_steps=1", "compare.rounds=1",
          "compare.precisions=[bf16,fp8]",
          f"hydra.run.dir={tmp_path / 'cmp'}"])
    out = capsys.readouterr().out
    assert "fp8" in out and "needs FP8 tensor cores" in out, out


FSDP_FP8 = ["device=cpu", *GPT, *EVERY_LINEAR, "train.steps=6", "train.log_every=3", "train.checkpoint.every=3",
            "train.console=plain", "distributed=fsdp", "telemetry.profile_cpu_memory=false", "train.ema.decay=0.5"]


@pytest.mark.slow
def test_fp8_under_fsdp_all_gathers_fp8_weights_and_checkpoints_plain_tensors_that_resume_on_one_process(
        tmp_path, fp8_tensor_cores, restore_argv):
    """Two ranks (gloo): torchao's FP8 all-gather (its weights are DTensors of WeightWithDynamicFloat8CastTensor,
    their scales precomputed after each step), with the fp32 weight average kept beside; a whole checkpoint holds
    plain tensors (loads with weights_only, without torchao's classes); the sharded one resumes on one process
    (another world size: DCP reshards) and continues as the whole one does, its average too."""
    import json
    import os
    import subprocess
    import sys

    from tests.support.runs import REPO

    def torchrun(run_dir, *args):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               "-m", "tests.support.fp8_anywhere", "train", *FSDP_FP8, *args,
                               f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=600,
                              cwd=tmp_path, env=env)

    sharded = torchrun(tmp_path / "sharded")
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert "fsdp_float8_all_gather=true" in (tmp_path / "sharded" / "train.log").read_text()
    full = torchrun(tmp_path / "full", "distributed.checkpoint_format=full")
    assert full.returncode == 0, full.stderr[-3000:]
    rows = {run: [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
            for run in ("sharded", "full")}
    assert [r["loss"] for r in rows["sharded"]] == [r["loss"] for r in rows["full"]]
    assert rows["full"][-1]["loss"] < rows["full"][0]["loss"]
    payload = torch.load(tmp_path / "full" / "checkpoints" / "step_00000006.pt", weights_only=True)
    assert all(type(t) is torch.Tensor for t in [*payload["model"].values(), *payload["ema"].values()])  # not
    # torchao's float8 wrapper: the weights and their fp32 average
    for run in ("sharded", "full"):
        ext = "dcp" if run == "sharded" else "pt"
        main(["train", f"resume={tmp_path / run / 'checkpoints' / f'step_00000003.{ext}'}", "distributed=none",
              "train.console=quiet", "telemetry.profile_cpu_memory=false", f"hydra.run.dir={tmp_path / 'other'}"])
    resumed = {run: [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
               for run in ("sharded", "full")}
    assert [r["step"] for r in resumed["sharded"]] == list(range(1, 7))
    assert [r["loss"] for r in resumed["sharded"][3:]] == [r["loss"] for r in resumed["full"][3:]]
    averages = {run: torch.load(tmp_path / run / "checkpoints" / "step_00000006.pt", weights_only=True)["ema"]
                for run in ("sharded", "full")}
    assert all(torch.equal(averages["sharded"][n], averages["full"][n]) for n in averages["full"])


def test_under_fsdp_a_tied_weight_stays_out_of_fp8_and_every_other_linear_is_converted():
    """torchao's FP8 all-gather wraps each converted weight in a parameter of its own: GPT's head, which shares the
    embedding's weight, would come untied (found by resuming such a run on one process). Sharded, it stays bf16;
    on one process (no all-gather) it is converted as before."""
    from ampctl.recipes.gpt import GPTRecipe

    model = GPTRecipe(d_model=64, n_layers=2, n_heads=2, block_size=32, batch_size=4,
                      max_corpus_bytes=200000).build_model()
    linears = {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    alone = fp8_torchao.TorchaoFp8Converter(fp8_torchao.Fp8TorchaoOptions(auto_filter_small_kn=False),
                                            torch.device("cpu"))
    assert all(alone.wants(m, fqn) for fqn, m in linears.items())
    sharded = fp8_torchao.TorchaoFp8Converter(fp8_torchao.Fp8TorchaoOptions(auto_filter_small_kn=False),
                                              torch.device("cpu"))
    sharded.shard_with_fsdp(model)
    assert [fqn for fqn, m in linears.items() if not sharded.wants(m, fqn)] == ["lm_head"]
    rowwise = fp8_torchao.TorchaoFp8Converter(fp8_torchao.Fp8TorchaoOptions(
        recipe_name=fp8_torchao.Float8RecipeName.rowwise, auto_filter_small_kn=False), torch.device("cpu"))
    rowwise.shard_with_fsdp(model)
    assert not rowwise.all_gathers_in_fp8 and rowwise.wants(linears["lm_head"], "lm_head")  # all-gathered as is
