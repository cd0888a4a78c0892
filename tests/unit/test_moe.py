"""The MoE recipe's layer against a hand loop over experts (each token through its k experts' own matmuls), its
routing against the top-k of hand-computed scores, its balance loss against the formula, and the model's own rule
that keeps routers in fp32 after the mode's rules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ampctl.conf.precision_schema import Dtype, LayerRule, PrecisionConfig
from ampctl.engine.precision.policy import with_model_rules
from ampctl.errors import ConfigError
from ampctl.recipes.moe import MoE, MoERecipe

D, HIDDEN, EXPERTS, TOP_K = 32, 48, 4, 2


def layer(score: str = "softmax", shared: int = 0, grouped: bool = True, route_norm: bool = True) -> MoE:
    torch.manual_seed(0)
    moe = MoE(D, EXPERTS, TOP_K, HIDDEN, shared, score, route_norm, grouped)
    for weight in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
        torch.nn.init.normal_(weight, std=0.1)
    return moe


def by_hand(moe: MoE, x: torch.Tensor, score: str, route_norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token through each of its top-k experts' own matmuls, weighted; and the experts it chose."""
    tokens = x.reshape(-1, D)
    logits = tokens @ moe.router.gate.weight.T
    scores = torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)
    weights, chosen = scores.topk(TOP_K, dim=-1)
    if route_norm:
        weights = weights / weights.sum(-1, keepdim=True)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    rows = []
    for t in range(tokens.shape[0]):
        row = torch.zeros(D)
        for j in range(TOP_K):
            e = int(chosen[t, j])
            h = F.silu(tokens[t] @ w1[e].T) * (tokens[t] @ w3[e].T)
            row = row + weights[t, j] * (h @ w2[e].T)
        rows.append(row)
    out = torch.stack(rows)
    if moe.shared is not None:
        out = out + moe.shared(tokens)
    return out.view(x.shape), chosen


@pytest.mark.parametrize("score,shared,route_norm", [("softmax", 0, True), ("sigmoid", 1, True),
                                                     ("softmax", 0, False)])
def test_the_layer_equals_the_hand_loop_over_experts_and_so_do_its_gradients(score, shared, route_norm):
    moe = layer(score, shared, route_norm=route_norm)
    x = torch.randn(2, 7, D, requires_grad=True)
    out = moe(x)
    expected, chosen = by_hand(moe, x, score, route_norm)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    _, ours = torch.topk(moe.router(x.reshape(-1, D))[0], TOP_K)
    assert torch.equal(ours, chosen)  # the routing is the top-k of the hand-computed scores
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *moe.parameters()], grad)
    want = torch.autograd.grad(expected, [x, *moe.parameters()], grad, allow_unused=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, torch.zeros_like(g) if w is None else w, rtol=1e-4, atol=1e-6)


def test_the_grouped_gemm_and_the_loop_over_experts_agree():
    x = torch.randn(3, 5, D)
    torch.testing.assert_close(layer(grouped=True)(x), layer(grouped=False)(x), rtol=1e-6, atol=1e-7)


def test_an_expert_no_token_chose_is_an_empty_group():
    moe = layer()
    with torch.no_grad():
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[1] = 1.0  # every token's first choice: expert 1; the second: the lowest index left
        moe.router.gate.weight[2] = 0.5
    x = torch.rand(1, 6, D)  # positive inputs: experts 1 and 2 win every token
    out = moe(x)
    assert moe.load.tolist() == [0, 6, 6, 0]
    torch.testing.assert_close(out, by_hand(moe, x, "softmax")[0], rtol=1e-5, atol=1e-6)


def test_the_balance_loss_is_the_switch_transformers_formula():
    moe = layer()
    x = torch.randn(4, 8, D)
    moe(x)
    scores = torch.softmax(x.reshape(-1, D) @ moe.router.gate.weight.T, -1)
    chosen = scores.topk(TOP_K, dim=-1).indices.reshape(-1)
    share = torch.tensor([float((chosen == e).sum()) for e in range(EXPERTS)]) / chosen.numel()
    expected = EXPERTS * sum(share[e] * scores[:, e].mean() for e in range(EXPERTS))
    torch.testing.assert_close(moe.balance_loss, expected)
    assert moe.load.sum() == 4 * 8 * TOP_K and moe.load.tolist() == [int(s * chosen.numel()) for s in share]


def test_under_autocast_the_experts_compute_in_its_dtype():
    moe = layer()
    x = torch.randn(2, 6, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = moe(x)
    full = moe(x)
    assert low.dtype == torch.float32 and not torch.equal(low, full)  # bf16 matmuls: a bf16 rounding away from fp32
    torch.testing.assert_close(low, full, rtol=0.05, atol=0.02)


@pytest.mark.parametrize("fields,key", [({"top_k": 9}, "recipe.top_k"), ({"experts": 1}, "recipe.experts"),
                                        ({"d_model": 40, "n_heads": 4}, "recipe.d_model"),
                                        ({"expert_hidden": 20}, "recipe.expert_hidden"),
                                        ({"score": "relu"}, "recipe.score"), ({"balance_coeff": -1.0},
                                                                               "recipe.balance_coeff")])
def test_a_recipe_that_cannot_be_built_names_its_key(fields, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        MoERecipe(**{"max_corpus_bytes": 100_000, **fields})


def test_the_models_rule_keeps_routers_in_fp32_after_the_modes_own_rules():
    model = MoERecipe(max_corpus_bytes=100_000, n_layers=2, d_model=32, expert_hidden=32).build_model()
    bf16 = PrecisionConfig(name="bf16", autocast=True, dtype=Dtype.bfloat16)
    assert [r.as_record() for r in with_model_rules(bf16, model).rules] == [{"type": "Router", "run_in": "fp32"}]
    mine = LayerRule(run_in="bf16", match="blocks.0.mlp.router")
    ruled = with_model_rules(PrecisionConfig(name="bf16", autocast=True, dtype=Dtype.bfloat16, rules=[mine]), model)
    assert [r.as_record() for r in ruled.rules] == [mine.as_record(), {"match": "blocks.1.mlp.router",
                                                                        "run_in": "fp32"}]
    fp32 = PrecisionConfig(name="fp32")
    assert with_model_rules(fp32, model) is fp32  # every layer computes in fp32 already: no rule to show
