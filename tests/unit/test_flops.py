"""Model FLOPs against the formulas they must equal, and the peak a run is measured against."""

from __future__ import annotations

import pytest
import torch

from ampctl.analysis import flops
from ampctl.recipes.gpt import VOCAB_SIZE, GPTRecipe
from ampctl.recipes.mlp import MLPRecipe


def test_an_mlps_flops_are_its_matmuls_forward_and_backward():
    """Each Linear: 2*B*in*out forward, as much again for its weight gradient, and as much again for its input
    gradient except the first layer's (the batch needs no gradient)."""
    recipe = MLPRecipe(in_features=64, hidden=32, depth=3, num_classes=10, batch_size=16, norm="none")
    shapes = [(64, 32), (32, 32), (32, 32), (32, 10)]
    b = recipe.batch_size
    expected = sum(2 * b * i * o for i, o in shapes) * 2 + sum(2 * b * i * o for i, o in shapes[1:])
    batch = next(iter(recipe.batches(torch.device("cpu"), 0)))
    assert flops.model_flops_per_step(recipe, batch, grad_accum_steps=1) == expected
    assert flops.model_flops_per_step(recipe, batch, grad_accum_steps=3) == 3 * expected


def test_a_gpts_flops_are_6n_per_token_plus_attention():
    """The MFU formula of the PaLM paper (and nanoGPT's): 6 * N (matmul weights, the tied head counted as the
    matmul it is) + 12 * layers * d_model * context per token."""
    recipe = GPTRecipe(block_size=64, batch_size=4, d_model=64, n_layers=2, n_heads=2, max_corpus_bytes=100000)
    batch = next(iter(recipe.batches(torch.device("cpu"), 0)))
    model = recipe.build_model()
    embeddings = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    head = VOCAB_SIZE * recipe.d_model  # tied to the token embedding, a matmul all the same
    n = sum(p.numel() for p in model.parameters() if p.dim() >= 2) - embeddings + head
    tokens = recipe.batch_size * recipe.block_size
    formula = (6 * n + 12 * recipe.n_layers * recipe.d_model * recipe.block_size) * tokens
    assert flops.model_flops_per_step(recipe, batch, 1) == pytest.approx(formula, rel=0.01)


@pytest.mark.parametrize("options", [
    {}, {"depth": 1, "norm": "none"}, {"in_features": 7, "hidden": 33, "depth": 4, "num_classes": 3, "batch_size": 5},
    {"norm": "batchnorm", "batch_size": 2}])
def test_the_mlps_formula_is_the_flop_counters_count(options):
    recipe = MLPRecipe(**options)
    batch = next(iter(recipe.batches(torch.device("cpu"), 0)))
    assert flops.mlp_flops(recipe, batch) == flops.model_flops_per_step(recipe, batch, 1)


@pytest.mark.parametrize("options", [
    {}, {"block_size": 16, "batch_size": 3, "d_model": 24, "n_layers": 1, "n_heads": 3},
    {"block_size": 33, "batch_size": 2, "d_model": 32, "n_layers": 3, "n_heads": 8, "dropout": 0.1}])
def test_the_gpts_formula_is_the_flop_counters_count(options, tmp_path):
    corpus = tmp_path / "corpus.txt"  # a text of its own: reading the standard library's takes most of a second
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 2000)
    recipe = GPTRecipe(corpus=str(corpus), **options)
    batch = next(iter(recipe.batches(torch.device("cpu"), 0)))
    assert flops.gpt_flops(recipe, batch) == flops.model_flops_per_step(recipe, batch, 1)


def test_a_built_in_recipe_is_counted_by_formula_and_a_subclass_by_the_counter(monkeypatch):
    """A subclass (or a copy) of a built-in recipe may build another model: the formula is for the exact class."""
    monkeypatch.setattr(flops, "device_peak", lambda device, dtype: flops.Peak(None, "not measured in a unit test"))
    class Wider(MLPRecipe):
        def build_model(self) -> torch.nn.Module:
            return torch.nn.Sequential(torch.nn.Linear(self.in_features, 2 * self.hidden),
                                       torch.nn.Linear(2 * self.hidden, self.num_classes))

    cpu = torch.device("cpu")
    precision = type("Precision", (), {"converter": None, "autocast": False, "cast_model": False, "tf32": False})
    built_in = flops.count(MLPRecipe(batch_size=4), cpu, precision, 0, grad_accum_steps=2)
    assert built_in.source.startswith("mlp_flops") and built_in.per_step == 2 * flops.mlp_flops(
        MLPRecipe(batch_size=4), next(iter(MLPRecipe(batch_size=4).batches(cpu, 0))))
    wider = Wider(batch_size=4)
    counted = flops.count(wider, cpu, precision, 0, grad_accum_steps=1)
    assert counted.source.startswith("torch.utils.flop_counter")
    assert counted.per_step == 2 * 4 * (64 * 512 + 512 * 10) * 2 + 2 * 4 * 512 * 10


@pytest.mark.parametrize("name,dtype,tflops", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989.4),
    ("NVIDIA H100 PCIe", "float16", 756.0),
    ("NVIDIA H200", "float8", 1978.9),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
])
def test_gpu_peaks_are_the_datasheets_dense_figures(monkeypatch, name, dtype, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _device=None: name)
    peak = flops.device_peak(torch.device("cuda"), dtype)
    assert peak.tflops == tflops and name in peak.source


def test_an_unknown_gpu_has_no_peak_and_says_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _device=None: "NVIDIA Future 9000")
    peak = flops.device_peak(torch.device("cuda"), "bfloat16")
    assert peak.tflops is None and "not in ampctl's peak table" in peak.source


def test_the_matmul_dtype_of_each_mode():
    from omegaconf import OmegaConf

    from tests.support.training import compose_cfg

    def dtype(mode: str) -> str:
        return flops.matmul_dtype(OmegaConf.to_object(compose_cfg(f"precision={mode}").precision))

    assert [dtype(m) for m in ("fp32", "tf32", "bf16", "fp16", "O2", "O3", "fp8", "fp8_emulated")] == [
        "float32", "tf32", "bfloat16", "float16", "float16", "float16", "float8", "float32"]



@pytest.mark.parametrize("options", [{}, {"shared_experts": 1, "top_k": 1, "experts": 3, "score": "sigmoid"}])
def test_the_moes_formula_is_the_flop_counters_count_of_the_loop_over_experts(options, tmp_path):
    """torch.utils.flop_counter has no formula for grouped_mm: it counts the same experts run one at a time (real
    tensors: the routing decides the groups' sizes, which fake tensors cannot)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from ampctl.recipes.moe import MoERecipe

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 2000)
    recipe = MoERecipe(corpus=str(corpus), block_size=16, batch_size=2, d_model=32, n_layers=2, n_heads=2,
                       expert_hidden=48, grouped_mm=False, **options)
    batch = next(iter(recipe.batches(torch.device("cpu"), 0)))
    model = recipe.build_model()
    # attention as its math (two bmm's the counter counts): the CPU's fused kernel has no formula in the counter
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        recipe.loss(model, batch).backward()
    assert flops.moe_flops(recipe, batch) == counter.get_total_flops()
