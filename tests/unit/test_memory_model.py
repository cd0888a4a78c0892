"""The memory model against hand-computed bytes, and against the state torch really allocates."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampctl.analysis.memory.model import (
    ActivationLine,
    SavedTensorCounter,
    estimate_model_states,
    largest_batch,
    parse_size,
)
from ampctl.engine.build import build_state
from ampctl.errors import UsageError
from tests.support.training import build

# The default mlp recipe: Linear(64,256), LayerNorm, GELU, Linear(256,256), LayerNorm, GELU,
# Linear(256,256), LayerNorm, GELU, Linear(256,10): 8 Linear tensors and 6 LayerNorm tensors.
MLP = ["recipe.hidden=256", "recipe.batch_size=128"]
P_LINEAR = (64 * 256 + 256) + 2 * (256 * 256 + 256) + (256 * 10 + 10)
P_NORM = 3 * (256 + 256)
P = P_LINEAR + P_NORM
STEP_PER_TENSOR = 4  # AdamW keeps `step` as a float32 scalar tensor per parameter tensor
STEP = STEP_PER_TENSOR * 14  # AdamW's float32 `step` tensor per parameter tensor

HAND_COMPUTED = {
    # precision: (weights, gradients, fp32 masters, AdamW states)
    "fp32": (4 * P, 4 * P, 0, 8 * P + STEP),
    "fp16": (4 * P, 4 * P, 0, 8 * P + STEP),  # autocast leaves the model (and its states) in fp32
    "bf16": (4 * P, 4 * P, 0, 8 * P + STEP),
    # the fp32 master gradients (4 P_LINEAR) replace the half ones (2 P_LINEAR): the larger set counts
    "O2": (2 * P_LINEAR + 4 * P_NORM, 4 * P, 4 * P_LINEAR, 8 * P + STEP),
    "O3": (2 * P, 2 * P, 0, 4 * P + STEP),  # no masters: the moments are half too
}


@pytest.mark.parametrize("precision", sorted(HAND_COMPUTED))
def test_model_states_equal_the_hand_computed_bytes(precision):
    cfg, policy, recipe = build(f"precision={precision}", *MLP)
    with policy:
        state = build_state(cfg, policy, recipe)
    s = estimate_model_states(state.model, state.weights.optimizer_params, cfg.optimizer)
    assert (s.weights, s.gradients, s.master_weights, s.optimizer_states) == HAND_COMPUTED[precision]
    if precision == "O2":
        # 2 half weights + 4 fp32 masters + 4 fp32 gradients + 8 moments; fp32 norm layers: 4 + 4 + 8
        assert s.total == 18 * P_LINEAR + 16 * P_NORM + STEP


@pytest.mark.parametrize("precision", ["fp32", "O2", "O3"])
def test_the_weight_average_is_4_bytes_per_parameter_and_the_bytes_its_tensors_hold(precision):
    """train.ema.decay: one fp32 copy of the trainable weights whatever the mode (O3's bf16 weights included),
    equal to the bytes of the average's own tensors."""
    cfg, policy, recipe = build(f"precision={precision}", *MLP, "train.ema.decay=0.99")
    with policy:
        state = build_state(cfg, policy, recipe)
    s = estimate_model_states(state.model, state.weights.optimizer_params, cfg.optimizer, weight_average=True)
    assert s.weight_average == 4 * P == sum(a.numel() * a.element_size() for a in state.ema.averages)
    assert s.total == sum(HAND_COMPUTED[precision]) + 4 * P


@pytest.mark.parametrize("precision", ["fp32", "O2", "O3"])
def test_gradient_bytes_are_the_most_that_a_real_step_holds_at_once(precision):
    """The reference: every .grad alive in a real step, summed after backward (half, under O2) and after
    they become the optimizer's (fp32 masters under O2, the half ones freed)."""
    cfg, policy, recipe = build(f"precision={precision}", *MLP)
    with policy:
        state = build_state(cfg, policy, recipe)
        everything = list(state.model.parameters()) + list(state.weights.optimizer_params)
        alive = lambda: sum(p.grad.numel() * p.grad.element_size()  # noqa: E731
                            for p in {id(p): p for p in everything}.values() if p.grad is not None)
        with policy.forward_context():
            loss = recipe.loss(state.model, next(recipe.batches(policy.device, 0)))
        state.scaler.scale(loss).backward()
        after_backward = alive()
        state.weights.grads_to_masters()
        after_handover = alive()
    s = estimate_model_states(state.model, state.weights.optimizer_params, cfg.optimizer)
    assert s.gradients == max(after_backward, after_handover)
    if precision == "O2":
        assert after_handover > after_backward  # fp32 masters' gradients, the half ones gone


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(storage_bytes(v) for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


def storage_bytes(tensor: torch.Tensor) -> int:
    """The bytes behind a tensor: a tensor subclass (torchao's quantized states) by the tensors it is made of."""
    if type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(storage_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd", "adafactor"])
@pytest.mark.parametrize("precision", ["fp32", "O2", "O3"])
def test_optimizer_states_equal_what_torch_allocates(optimizer, precision):
    cfg, policy, recipe = build(f"precision={precision}", f"optimizer={optimizer}", "recipe.hidden=32")
    with policy:
        state = build_state(cfg, policy, recipe)
        for p in state.weights.optimizer_params:
            p.grad = torch.zeros_like(p)
        state.optimizer.step()
    estimate = estimate_model_states(state.model, state.weights.optimizer_params, cfg.optimizer)
    assert estimate.optimizer_states == optimizer_state_bytes(state.optimizer)


@pytest.mark.parametrize("optimizer", ["adamw_bf16_sr", "adamw_8bit", "adamw_4bit", "adamw_fp8"])
@pytest.mark.parametrize("precision", ["fp32", "O3", "O3_fp16"])
def test_torchao_optimizer_states_equal_the_bytes_behind_them(optimizer, precision, monkeypatch):
    """hidden=128: Linear weights of 8192 and 16384 elements are quantized, the smaller tensors keep their moments in
    the weights' dtype. The states are what torchao allocates at its first step; its update is run eagerly here
    (torch.compile an identity: the states do not depend on it, and compiling costs seconds per shape)."""
    pytest.importorskip("torchao")
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    precisions = {"O3": ["precision=O3", "precision.dtype=bfloat16"], "O3_fp16": ["precision=O3"],
                  "fp32": ["precision=fp32"]}[precision]
    if optimizer == "adamw_bf16_sr" and precision != "O3":
        precisions.append("optimizer.bf16_stochastic_round=false")
    cfg, policy, recipe = build(*precisions, f"optimizer={optimizer}", "recipe.hidden=128")
    with policy:
        state = build_state(cfg, policy, recipe)
        for p in state.weights.optimizer_params:
            p.grad = torch.ones_like(p)
        state.optimizer.step()
    kinds = {type(v).__name__ for s in state.optimizer.state.values() for v in s.values()}
    assert len(kinds) == (1 if optimizer == "adamw_bf16_sr" else 2), kinds  # quantized and plain both counted
    estimate = estimate_model_states(state.model, state.weights.optimizer_params, cfg.optimizer)
    assert estimate.optimizer_states == optimizer_state_bytes(state.optimizer)


def test_saved_tensor_count_leaves_out_parameters():
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU())
    counter = SavedTensorCounter(model)
    with counter.counting():
        model(torch.randn(32, 64))
    # addmm saves its input (the weight too, but that is a parameter); GELU saves its input.
    assert counter.bytes == 32 * 64 * 4 + 32 * 256 * 4


def test_largest_batch_from_the_activation_line():
    line = ActivationLine.through(8, 1000 + 8 * 100, 4, 1000 + 4 * 100)
    assert (line.fixed, line.per_sample) == (1000, 100)
    assert largest_batch(10_000, 2_000, line) == 70
    assert largest_batch(2_500, 2_000, line) == 0


@pytest.mark.parametrize("text,expected", [("80GB", 80 * 10**9), ("16GiB", 16 * 2**30), ("512 MiB", 512 * 2**20),
                                           ("1.5TB", 1.5e12), ("4096", 4096), ("2kb", 2000)])
def test_budget_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["80XB", "GB", "-1GB", "0", "eighty", "1e9", ""])
def test_bad_budget_is_refused_naming_the_value(text):
    with pytest.raises(UsageError, match=r"memory.budget=.* is not allowed: expected a size such as 80GB"):
        parse_size(text)


# recipe=moe at these sizes: per block a router gate (Linear(32, 4), no bias) and grouped experts w1, w3 (4, 48, 32)
# and w2 (4, 32, 48); the rest is the GPT's embeddings, attention, norms and head.
MOE = ["recipe=moe", "recipe.n_layers=2", "recipe.d_model=32", "recipe.n_heads=2", "recipe.experts=4",
       "recipe.expert_hidden=48", "recipe.block_size=16", "recipe.max_corpus_bytes=100000"]
P_EXPERTS, P_ROUTERS = 2 * 3 * 4 * 48 * 32, 2 * 32 * 4


@pytest.mark.parametrize("precision", ["bf16", "O2", "bf16_true"])
def test_a_mixture_of_experts_states_per_part_are_the_hand_counted_bytes_and_add_up_to_the_whole(precision):
    """The experts' and routers' parameters counted by hand from the recipe's shapes: under O2 the experts are half
    with fp32 masters and the routers (kept fp32 by the model's rule, in every mode) their own masters; bf16_true holds
    the experts and their moments in bf16. Every part's field sums to the whole model's."""
    from ampctl.analysis.memory.model import states_by_part

    cfg, policy, recipe = build(f"precision={precision}", base=[*MOE, "device=cpu"])
    with policy:
        state = build_state(cfg, policy, recipe)
    whole = estimate_model_states(state.model, state.weights.optimizer_params, cfg.optimizer)
    parts = {p.name: p for p in states_by_part(state.model, state.weights.optimizer_params, cfg.optimizer)}
    assert list(parts) == ["experts", "routers", "the rest"]
    assert parts["experts"].parameters == P_EXPERTS and parts["routers"].parameters == P_ROUTERS
    assert sum(p.parameters for p in parts.values()) == sum(p.numel() for p in state.model.parameters())
    half = {"bf16": 4, "O2": 2, "bf16_true": 2}[precision]
    experts, routers = parts["experts"].states, parts["routers"].states
    assert experts.weights == half * P_EXPERTS and routers.weights == 4 * P_ROUTERS  # fp32 by the model's rule
    assert experts.master_weights == (4 * P_EXPERTS if precision == "O2" else 0) and routers.master_weights == 0
    moments = 2 if precision == "bf16_true" else 4  # Adam's two moments in the stepped weights' dtype
    assert experts.optimizer_states == 2 * moments * P_EXPERTS + STEP_PER_TENSOR * 3 * 2
    for field in ("weights", "gradients", "master_weights", "optimizer_states", "total"):
        assert sum(getattr(p.states, field) for p in parts.values()) == getattr(whole, field), field


def test_a_model_without_experts_has_no_parts():
    from ampctl.analysis.memory.model import states_by_part

    cfg, policy, recipe = build("precision=bf16", *MLP)
    with policy:
        state = build_state(cfg, policy, recipe)
    assert states_by_part(state.model, state.weights.optimizer_params, cfg.optimizer) == []
