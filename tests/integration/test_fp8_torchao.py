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
from tests.conftest import QUIET, train

pytest.importorskip("torchao", reason="torchao is the optional extra ampctl[fp8] (installed by [dev])")

GPT = ["recipe=gpt", "recipe.d_model=64", "recipe.n_layers=2", "recipe.n_heads=2", "recipe.block_size=32",
       "recipe.batch_size=4", "recipe.max_corpus_bytes=200000", "train.steps=30"]
# The tiny gpt's layers are far below torchao's size thresholds: convert them all; eager (train.compile's default:
# minutes of compiling for a test of the numerics). 128 tokens a step: torch._scaled_mm's CPU kernel is a reference
# one, ~0.2 s for a 512x64x256 matmul (4.5 s a step at 512 tokens, 2.5 minutes for a test).
EVERY_LINEAR = ["precision=fp8", "precision.options.auto_filter_small_kn=false"]


@pytest.fixture
def fp8_tensor_cores(monkeypatch):
    """Pretend this device has FP8 tensor cores: the one check a CPU fails."""
    monkeypatch.setattr(fp8_torchao, "unsupported_reason", lambda _device: None)


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
    _, bf16 = train(tmp_path / "bf16", *GPT, "precision=bf16", base=QUIET)
    recipe_arg = f"precision.options.recipe_name={recipe_name}"
    _, fp8 = train(tmp_path / "fp8", *GPT, *EVERY_LINEAR, recipe_arg, base=QUIET)
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
    args = [*GPT, *EVERY_LINEAR, "train.steps=6", "train.lr_schedule=constant"]
    _, whole = train(tmp_path / "whole", *args, base=QUIET)
    train(tmp_path / "resumed", *args, "train.steps=3", base=QUIET)
    _, resumed = train(tmp_path / "resumed", *args, "resume=auto", base=QUIET)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]


def test_compare_lists_fp8_as_skipped_with_the_reason_on_this_cpu(tmp_path, restore_argv, capsys):
    main(["compare", *GPT, "device=cpu", "train.steps=3", "compare.warmup_steps=1", "compare.rounds=1",
          "compare.precisions=[bf16,fp8]",
          f"hydra.run.dir={tmp_path / 'cmp'}"])
    out = capsys.readouterr().out
    assert "fp8" in out and "needs FP8 tensor cores" in out, out
