"""The models people train, one override away: a timm CNN and ViT, transformers' GPT-2 and Llama, in tiny
configurations, through whole runs: each precision mode, an exact resume, `ampctl inspect` naming their layers,
a local image folder. Skipped when the optional package is absent ([dev] installs both)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ampctl.analysis.flops import model_flops_per_step
from ampctl.cli import main
from tests.support.training import QUIET, train_here

TIMM = ["recipe=timm", "recipe.image_size=32", "recipe.batch_size=4", "recipe.num_classes=10"]
HF = ["recipe=hf_causal_lm", "recipe.block_size=32", "recipe.batch_size=4", "recipe.max_corpus_bytes=200000",
      "+recipe.config.num_hidden_layers=2", "+recipe.config.hidden_size=64"]
MODELS = {
    "timm_cnn": ("timm", [*TIMM, "recipe.model=test_resnet"], "layer1.0.conv1"),
    "timm_vit": ("timm", [*TIMM, "recipe.model=test_vit"], "blocks.0.attn.qkv"),
    "gpt2": ("transformers", [*HF, "recipe.model_type=gpt2"], "transformer.h.0.attn.c_attn"),
    "llama": ("transformers", [*HF, "recipe.model_type=llama"], "model.layers.0.self_attn.q_proj"),
}


def overrides(model: str) -> list[str]:
    package, args, _layer = MODELS[model]
    pytest.importorskip(package)
    return args


@pytest.mark.parametrize("model", MODELS)
def test_each_model_trains_in_fp32_bf16_and_fp16_from_the_same_start(tmp_path, model):
    """Three steps per mode. Same seed, same first batch: the first loss of bf16 and fp16 lies within their
    rounding of fp32's (the forward is all that differs at step 1), and every loss is finite."""
    first = {}
    for mode in ("fp32", "bf16", "fp16"):
        summary, rows = train_here(tmp_path / mode, *overrides(model), f"precision={mode}", "train.steps=3",
                              "train.log_every=3", base=QUIET)
        assert [r["step"] for r in rows] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in rows)
        assert summary["steps"] == 3 and summary["parameters"] > 0
        first[mode] = rows[0]["loss"]
    assert first["bf16"] == pytest.approx(first["fp32"], rel=2e-2)  # bf16 keeps 8 bits of mantissa
    assert first["fp16"] == pytest.approx(first["fp32"], rel=5e-3)  # fp16 keeps 11


def rows_of(run_dir) -> list[dict]:
    keys = ("step", "loss", "loss_scale", "skipped", "grad_norm", "lr")
    return [{k: r[k] for k in keys} for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.parametrize("model", MODELS)
def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(tmp_path, model, restore_argv):
    """fp16 with a dynamic scale that grows every step, so the scaler's state is part of what must come back. The
    first half stops at step 2 by its train.steps, so the lr is constant: a schedule over train.steps would
    differ between the halves by design."""
    run = [*overrides(model), *QUIET, "precision=fp16", "scaler.growth_interval=1", "train.log_every=1",
           "train.checkpoint.every=2", "train.lr.schedule=constant"]
    main(["train", *run, "train.steps=4", f"hydra.run.dir={tmp_path / 'straight'}"])
    main(["train", *run, "train.steps=2", f"hydra.run.dir={tmp_path / 'resumed'}"])
    main(["train", *run, "train.steps=4", f"hydra.run.dir={tmp_path / 'resumed'}", "resume=auto"])
    assert rows_of(tmp_path / "resumed") == rows_of(tmp_path / "straight")
    assert len({r["loss_scale"] for r in rows_of(tmp_path / "straight")}) > 1
    weights = [torch.load(tmp_path / run / "checkpoints" / "step_00000004.pt", weights_only=True)["model"]
               for run in ("straight", "resumed")]
    assert weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][k], weights[1][k])
                                                          for k in weights[0])


@pytest.mark.parametrize("model", MODELS)
def test_inspect_names_the_models_own_layers(tmp_path, model, restore_argv):
    layer = MODELS[model][2]
    main(["inspect", *overrides(model), "device=cpu", "precision=fp16", "inspect.steps=1",
          f"hydra.run.dir={tmp_path}"])
    ranges = json.loads((tmp_path / "ranges.json").read_text())
    text = json.dumps(ranges)
    assert f'"{layer}"' in text, f"{layer} not among the layers inspect recorded"


def test_timm_trains_on_a_local_image_folder_with_the_models_transforms(tmp_path):
    """recipe.data=imagefolder: torchvision's ImageFolder (one folder per class) through timm's training
    transforms at recipe.image_size, in DataLoader worker processes; the classes are the folder's."""
    pytest.importorskip("timm")
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    for label in ("cat", "dog", "fox"):
        (tmp_path / "images" / label).mkdir(parents=True)
        for i in range(4):
            pixels = torch.randint(0, 256, (40, 48, 3), dtype=torch.uint8, generator=generator).numpy()
            Image.fromarray(pixels).save(tmp_path / "images" / label / f"{i}.png")
    summary, rows = train_here(tmp_path / "run", *TIMM, "recipe.model=test_resnet", "recipe.num_classes=null",
                          "recipe.data=imagefolder", f"recipe.data_root={tmp_path / 'images'}", "recipe.num_workers=2",
                          "train.steps=4", "train.log_every=2", base=QUIET)
    assert len(rows) == 4 and all(math.isfinite(r["loss"]) for r in rows)
    assert rows[0]["loss"] == pytest.approx(math.log(3), rel=0.5)  # a 3-way head from the folder's classes


def test_a_resumed_image_folder_run_reads_no_image_twice_and_matches_the_uninterrupted_run(tmp_path):
    """The loader of a resumed run starts at the checkpoint's batch (recipes/images.py): it loads only the images of
    the steps it trains (it loaded and augmented every earlier batch again, at every resume), and the run's weights
    are bit for bit those of the run that was never stopped. (In the training process, where the images it opens
    can be counted; tests/unit/test_data_position.py checks the same stream from worker processes.)"""
    pytest.importorskip("timm")
    from PIL import Image

    from tests.support.in_process import run_ampctl

    generator = torch.Generator().manual_seed(0)
    for label in ("cat", "dog"):
        (tmp_path / "images" / label).mkdir(parents=True)
        for i in range(5):
            pixels = torch.randint(0, 256, (40, 48, 3), dtype=torch.uint8, generator=generator).numpy()
            Image.fromarray(pixels).save(tmp_path / "images" / label / f"{i}.png")
    run = [*TIMM, "recipe.model=test_resnet", "recipe.num_classes=null", "recipe.data=imagefolder",
           f"recipe.data_root={tmp_path / 'images'}", "recipe.num_workers=0", "train.lr.schedule=constant",
           "train.console=quiet", "telemetry.profile_cpu_memory=false", "device=cpu"]
    assert run_ampctl("train", *run, "train.steps=7", "hydra.run.dir=whole", cwd=tmp_path).returncode == 0
    assert run_ampctl("train", *run, "train.steps=5", "hydra.run.dir=part", cwd=tmp_path).returncode == 0
    opened: list[str] = []
    real_open = Image.open

    def counting_open(path, *args, **kwargs):  # in this process: the stream's first batch is what it reads
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    Image.open = counting_open
    try:
        resumed = run_ampctl("train", *run, "train.steps=7", "resume=auto", "hydra.run.dir=part", cwd=tmp_path)
    finally:
        Image.open = real_open
    assert resumed.returncode == 0, resumed.stderr
    # 10 images, 2 full batches of 4 an epoch: steps 6 and 7 are the first two batches of epoch 2 (8 images), and
    # the FLOP count's one batch drawn from the stream's start (4); replayed, steps 1-5 read 20 images more
    assert len(opened) == 12, len(opened)
    final = [torch.load(tmp_path / d / "checkpoints" / "step_00000007.pt", weights_only=False)["model"]
             for d in ("whole", "part")]
    assert all(torch.equal(final[0][key], final[1][key]) for key in final[0])


@pytest.mark.parametrize("model", MODELS)
def test_each_library_model_is_evaluated_on_held_out_batches(tmp_path, model):
    """timm: held-out synthetic batches (loss, accuracy); transformers: the corpus's held-out tenth (loss,
    next-token accuracy, perplexity = exp(loss))."""
    summary, _ = train_here(tmp_path, *overrides(model), "train.steps=2", "train.eval.every=2", "train.eval.batches=2",
                       base=QUIET)
    held_out = summary["eval"]
    assert held_out["step"] == 2 and math.isfinite(held_out["eval/loss"]) and 0 <= held_out["eval/accuracy"] <= 1
    if MODELS[model][0] == "transformers":
        assert held_out["eval/perplexity"] == pytest.approx(math.exp(held_out["eval/loss"]))


def test_timm_evaluates_the_held_out_folder_and_refuses_evaluation_without_one(tmp_path, restore_argv, capsys):
    pytest.importorskip("timm")
    from PIL import Image

    from ampctl.cli import main

    generator = torch.Generator().manual_seed(0)
    for folder, per_class in (("images", 4), ("held_out", 2)):
        for label in ("cat", "dog", "fox"):
            (tmp_path / folder / label).mkdir(parents=True)
            for i in range(per_class):
                pixels = torch.randint(0, 256, (40, 48, 3), dtype=torch.uint8, generator=generator).numpy()
                Image.fromarray(pixels).save(tmp_path / folder / label / f"{i}.png")
    folder = [*TIMM, "recipe.model=test_resnet", "recipe.num_classes=null", "recipe.data=imagefolder",
              f"recipe.data_root={tmp_path / 'images'}", "recipe.num_workers=0", "train.steps=2",
              "train.eval.every=2"]
    summary, _ = train_here(tmp_path / "run", *folder, f"recipe.eval_root={tmp_path / 'held_out'}", base=QUIET)
    assert round(summary["eval"]["eval/accuracy"] * 6) == pytest.approx(summary["eval"]["eval/accuracy"] * 6)  # k of 6
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *folder, *QUIET, f"hydra.run.dir={tmp_path / 'refused'}"])
    assert exit_info.value.code == 2
    assert "train.eval.every with recipe.data=imagefolder needs recipe.eval_root" in capsys.readouterr().err
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()  # refused before the first step


# FLOP counts of the libraries' models (here, not in tests/unit: importing timm and transformers takes seconds)

def test_transformers_llama_and_gpt2_flops_are_6n_per_token_plus_attention():
    """The same formula for transformers' own models, counted through fake tensors (their causal masks check
    values on the host, which a meta tensor cannot): N counts every matmul weight, the head included (GPT-2's
    is tied to the token embedding, Llama's is its own)."""
    pytest.importorskip("transformers")
    from ampctl.recipes.hf_causal_lm import HFCausalLMRecipe

    for model_type in ("llama", "gpt2"):
        recipe = HFCausalLMRecipe(model_type=model_type, block_size=32, batch_size=2, max_corpus_bytes=100_000)
        model = recipe.build_model()
        config = model.config
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        n = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in embeddings)
        if config.tie_word_embeddings:  # the head is the token embedding: a matmul all the same
            n += config.vocab_size * config.hidden_size
        tokens = recipe.batch_size * recipe.block_size
        formula = (6 * n + 12 * config.num_hidden_layers * config.hidden_size * recipe.block_size) * tokens
        batch = next(iter(recipe.batches(torch.device("cpu"), 0)))
        assert model_flops_per_step(recipe, batch, 1) == formula, model_type


def test_timm_resnet18_counts_as_torchvisions():
    """timm's resnet18 is torchvision's architecture: the same FLOPs, channels_last and all."""
    pytest.importorskip("timm")
    from ampctl.recipes.resnet import ResNetRecipe
    from ampctl.recipes.timm_models import TimmRecipe

    counts = []
    for recipe in (TimmRecipe(model="resnet18", image_size=32, batch_size=4),
                   ResNetRecipe(data="synthetic", image_size=32, batch_size=4)):
        batch = next(iter(recipe.batches(torch.device("cpu"), 0)))
        counts.append(model_flops_per_step(recipe, batch, 1))
    assert counts[0] == counts[1] > 0
