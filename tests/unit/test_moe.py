"""The MoE recipe's layer against a hand loop over experts (each token through its k experts' own matmuls), its
routing against the top-k of hand-computed scores, its balance loss against the formula, and the model's own rule
that keeps routers in fp32 after the mode's rules."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ampctl.conf.precision_schema import Dtype, LayerRule, PrecisionConfig
from ampctl.engine.precision.policy import with_model_rules
from ampctl.errors import ConfigError
from ampctl.recipes.moe import MoE, MoERecipe, MoESpec

D, HIDDEN, EXPERTS, TOP_K = 32, 48, 4, 2


def layer(score: str = "softmax", shared: int = 0, grouped: bool = True, route_norm: bool = True) -> MoE:
    torch.manual_seed(0)
    moe = MoE(D, MoESpec(EXPERTS, TOP_K, HIDDEN, shared, score, route_norm, grouped))
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


def test_torchs_cpu_autocast_leaves_grouped_mm_in_the_dtype_it_is_given():
    """Why the experts cast for autocast themselves (recipes/moe.grouped_matmul): pinned to the torch in use, so that a
    torch whose op lists cast grouped_mm is noticed (the cast would then be autocast's own, and harmless)."""
    x, w = torch.randn(8, 32), torch.randn(2, 16, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = F.grouped_mm(x, w.transpose(-2, -1), offs=torch.tensor([3, 8], dtype=torch.int32))
    assert out.dtype == torch.float32


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


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_a_format_on_the_grouped_gemm_is_each_experts_slice_quantized_by_hand(fmt):
    """Forward, input gradient and weight gradient of one grouped GEMM under the MX converter, against each expert's
    slice quantized by hand: blocks along each GEMM's reduction dimension within the expert, the weight gradient's
    along the expert's own tokens (7 of them: a group padded to whole blocks), an expert no token chose left out."""
    from ampctl.engine.precision.block_quantize import fake_quantize
    from ampctl.engine.precision.mx_emulated import MXEmulatedConverter, MXEmulatedOptions, MXFormat, block_formats
    from ampctl.recipes.moe import GroupedExperts

    options = MXEmulatedOptions(format=MXFormat(fmt))
    experts = GroupedExperts(3, 64, 32)
    torch.nn.init.normal_(experts.w1)
    converted = MXEmulatedConverter(options, torch.device("cpu")).convert(experts, "experts", fmt)
    assert type(converted).__name__ == "MXGroupedExperts" and converted is experts  # its parameters, its own
    counts = torch.tensor([3, 0, 7])
    x = torch.randn(10, 64, requires_grad=True)
    out = converted.grouped(x, converted.w1, counts)
    grad = torch.randn_like(out)
    out.backward(grad)

    fwd, grads = block_formats(options, fmt)
    w = converted.w1.detach()
    want_out, want_dx, want_dw = [], [], torch.zeros_like(w)
    for e, (start, end) in {0: (0, 3), 2: (3, 10)}.items():
        x_e, g_e = x.detach()[start:end], grad[start:end]
        want_out.append(fake_quantize(x_e, fwd) @ fake_quantize(w[e], fwd).t())  # reduces over the input dim
        want_dx.append(fake_quantize(g_e, grads) @ fake_quantize(w[e].t(), fwd).t())  # over the output dim
        want_dw[e] = fake_quantize(g_e.t(), grads) @ fake_quantize(x_e.t(), fwd).t()  # over the expert's tokens
    assert torch.equal(out, torch.cat(want_out))
    assert torch.equal(x.grad, torch.cat(want_dx))
    assert torch.equal(converted.w1.grad, want_dw) and not converted.w1.grad[1].any()


@pytest.mark.parametrize("scaling", ["current", "blockwise"])
def test_fp8_on_the_grouped_gemm_is_each_experts_slice_quantized_by_hand(scaling):
    from ampctl.engine.precision.fp8_emulated import (
        E4M3,
        TILE,
        Fp8EmulatedConverter,
        Fp8EmulatedOptions,
        Fp8Format,
        Fp8Scaling,
        backward_dtype,
        quantize_tensorwise,
        quantize_tiles,
    )
    from ampctl.recipes.moe import GroupedExperts

    options = Fp8EmulatedOptions(scaling=Fp8Scaling(scaling),
                                 format=Fp8Format.e4m3 if scaling == "blockwise" else Fp8Format.hybrid)
    experts = GroupedExperts(3, 64, 32)
    torch.nn.init.normal_(experts.w2)
    converted = Fp8EmulatedConverter(options, torch.device("cpu")).convert(experts, "experts", "fp8_emulated")
    assert type(converted).__name__ == "Fp8GroupedExperts"
    counts = torch.tensor([5, 4, 0])
    x = torch.randn(9, 32, requires_grad=True)
    out = converted.grouped(x, converted.w2, counts)
    grad = torch.randn_like(out)
    out.backward(grad)
    g_dtype = backward_dtype(options)
    w = converted.w2.detach()
    want_out, want_dx, want_dw = [], [], torch.zeros_like(w)
    for e, (start, end) in {0: (0, 5), 1: (5, 9)}.items():
        x_e, g_e = x.detach()[start:end], grad[start:end]
        if scaling == "current":  # one scale per tensor of the expert's GEMM
            qx, qw, qx_t = quantize_tensorwise(x_e, E4M3), quantize_tensorwise(w[e], E4M3), None
            qg = qg_t = quantize_tensorwise(g_e, g_dtype)
            qx_t = qx
        else:  # 1x128 tiles along each GEMM's reduction dimension, 128x128 for the weight
            qx, qw = quantize_tiles(x_e, E4M3, 1, TILE), quantize_tiles(w[e], E4M3, TILE, TILE)
            qx_t, qg, qg_t = (quantize_tiles(x_e, E4M3, TILE, 1), quantize_tiles(g_e, g_dtype, 1, TILE),
                              quantize_tiles(g_e, g_dtype, TILE, 1))
        want_out.append(qx @ qw.t())
        want_dx.append(qg @ qw)
        want_dw[e] = qg_t.t() @ qx_t
    assert torch.equal(out, torch.cat(want_out)) and torch.equal(x.grad, torch.cat(want_dx))
    assert torch.equal(converted.w2.grad, want_dw)


def test_fp8s_delayed_scaling_on_grouped_experts_is_refused_in_one_line():
    from ampctl.engine.precision.fp8_emulated import Fp8EmulatedConverter, Fp8EmulatedOptions, Fp8Scaling
    from ampctl.errors import UsageError
    from ampctl.recipes.moe import GroupedExperts

    converter = Fp8EmulatedConverter(Fp8EmulatedOptions(scaling=Fp8Scaling.delayed), torch.device("cpu"))
    with pytest.raises(UsageError, match="scaling=delayed with the grouped experts blocks.0.mlp.experts"):
        converter.convert(GroupedExperts(2, 32, 32), "blocks.0.mlp.experts", "fp8_emulated")


@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
def test_torchaos_mxfp8_grouped_gemm_equals_the_emulation_on_the_experts(scale_mode):
    """torchao 0.18's MXFP8 grouped path (quantize_ with MXFP8TrainingOpConfig on the experts: their (experts, out,
    in) weights used transposed, KernelPreference.EMULATED, token groups padded to 32) runs on a CPU in bf16; on
    bf16 values, its forward, input and weight gradients equal ampctl's emulation rounded to bf16, bit for bit."""
    pytest.importorskip("torchao")
    import copy

    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization import quantize_
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    from ampctl.engine.precision.mx_emulated import MXEmulatedConverter, MXEmulatedOptions, MXFormat, MXScaleMode
    from ampctl.recipes.moe import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(3, 64, 32)
    with torch.no_grad():
        for weight in (experts.w1, experts.w2, experts.w3):
            weight.copy_(torch.randn_like(weight).bfloat16().float())  # values both sides hold exactly
    theirs = copy.deepcopy(experts).bfloat16()
    config = MXFP8TrainingOpConfig(kernel_preference=KernelPreference.EMULATED, pad_token_groups_for_grouped_mm=True,
                                   scale_calculation_mode=ScaleCalculationMode(scale_mode))
    quantize_(theirs, config, filter_fn=lambda module, fqn: isinstance(module, GroupedExperts))
    options = MXEmulatedOptions(format=MXFormat.mxfp8, scale_mode=MXScaleMode(scale_mode))
    ours = MXEmulatedConverter(options, torch.device("cpu")).convert(experts, "experts", "mxfp8")
    counts = torch.tensor([3, 0, 7])  # groups of 3 and 7 tokens: padded to 32 by both
    x = torch.randn(10, 64).bfloat16()
    x_ours, x_theirs = x.float().requires_grad_(), x.clone().requires_grad_()
    out_ours, out_theirs = ours.grouped(x_ours, ours.w1, counts), theirs.grouped(x_theirs, theirs.w1, counts)
    grad = torch.randn_like(out_theirs)
    out_ours.backward(grad.float())
    out_theirs.backward(grad)
    assert torch.equal(out_ours.detach().bfloat16(), out_theirs.detach())
    assert torch.equal(x_ours.grad.bfloat16(), x_theirs.grad)
    assert torch.equal(ours.w1.grad.bfloat16(), theirs.w1.grad)


def test_inspects_ranges_per_expert_are_each_experts_own_outputs_gradients_and_weights():
    """RangeRecorder's rows `<experts>[e]`: expert e's activations are its own tokens' outputs computed by hand (count
    and largest magnitude), their gradients under loss = sum(out) the routing weights of its (token, k) pairs, its
    weights and weight gradients the e-th slices; the experts' rows together are the whole layer's values."""
    from ampctl.analysis.numerics import FORMATS, RangeStats
    from ampctl.analysis.ranges import RangeRecorder

    moe = layer()
    x = torch.randn(3, 5, D)
    recorder = RangeRecorder(moe, torch.device("cpu"), study_scale=1.0)
    with recorder:
        recorder.record_weights()
        moe(x).sum().backward()
    stats = recorder.stats
    tokens = x.reshape(-1, D)
    scores = torch.softmax(tokens @ moe.router.gate.weight.T, -1).detach()
    weights, chosen = scores.topk(TOP_K, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    for e in range(EXPERTS):
        row = f"experts[{e}]"
        mine = tokens[(chosen == e).any(-1)]
        out = (F.silu(mine @ w1[e].T) * (mine @ w3[e].T)) @ w2[e].T
        assert int(stats[(row, "activation")].total) == out.numel() > 0
        assert float(stats[(row, "activation")].max_abs) == pytest.approx(float(out.detach().abs().max()), rel=1e-5)
        assert float(stats[(row, "activation_grad")].max_abs) == pytest.approx(float(weights[chosen == e].max()))
        for kind, slices in (("weight", (w1[e], w3[e], w2[e])), ("weight_grad", (w1.grad[e], w3.grad[e], w2.grad[e]))):
            expected = RangeStats(torch.device("cpu"))
            for part in slices:
                expected.add(part.detach())
            got = stats[(row, kind)]
            assert int(got.total) == int(expected.total) and torch.equal(got.histogram, expected.histogram)
            assert all(torch.equal(got.counts[k], expected.counts[k]) for k in got.counts)
    assert not any(layer == "experts" for layer, _ in stats)  # the experts' rows, not a whole-layer one
    whole = RangeStats(torch.device("cpu"))
    whole.add(moe.experts(tokens[torch.argsort(chosen.reshape(-1), stable=True) // TOP_K],
                          torch.bincount(chosen.reshape(-1), minlength=EXPERTS)).detach())
    merged = RangeStats(torch.device("cpu"))
    for e in range(EXPERTS):
        merged.merge(stats[(f"experts[{e}]", "activation")])
    assert int(merged.total) == int(whole.total) and torch.equal(merged.histogram, whole.histogram)
    assert all(torch.equal(merged.counts[(f.name, False)], whole.counts[(f.name, False)]) for f in FORMATS)


def test_the_block_scales_log_observes_every_experts_gemm(tmp_path):
    """telemetry.blocks_every on converted grouped experts: their row in blocks.jsonl sums block_stats over each
    expert's operands as its three GEMMs quantize them (an expert no token chose has none), counted by hand."""
    from ampctl.analysis.block_scales import BlocksLog
    from ampctl.engine.precision.block_quantize import BLOCK_STATS, block_stats, fake_quantize
    from ampctl.engine.precision.mx_emulated import MXEmulatedConverter, MXEmulatedOptions, MXFormat
    from ampctl.recipes.moe import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(3, 32, 48)
    for weight in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(weight, std=0.1)
    MXEmulatedConverter(MXEmulatedOptions(format=MXFormat.mxfp8), torch.device("cpu")).convert(experts, "e", "mxfp8")
    model = torch.nn.ModuleDict({"experts": experts})
    written: list[dict] = []
    counts, x = torch.tensor([4, 0, 9]), torch.randn(13, 32)
    with BlocksLog(model, 1, tmp_path / "blocks.jsonl", written.append).around(1):
        experts(x, counts).sum().backward()
    fmt, weight_fmt = experts.ampctl_mx.forward_format, experts.ampctl_mx.weight_format
    activations, weights = [], []
    for e, rows in {0: slice(0, 4), 2: slice(4, 13)}.items():
        x_e = x[rows]
        w1, w3 = (fake_quantize(w[e].detach(), weight_fmt) for w in (experts.w1, experts.w3))
        h_e = F.silu(fake_quantize(x_e, fmt) @ w1.T) * (fake_quantize(x_e, fmt) @ w3.T)  # as the first GEMMs made it
        activations += [x_e, x_e, h_e.detach()]
        weights += [experts.w1[e].detach(), experts.w3[e].detach(), experts.w2[e].detach()]
    row = written[0]["layers"]["experts"]
    assert row["format"] == "mxfp8"
    assert row["weight"]["values"] == sum(w.numel() for w in weights)
    expected = sum(block_stats(w, weight_fmt)[:-1] for w in weights)
    assert row["weight"]["blocks"] == int(expected[BLOCK_STATS.index("blocks")])
    assert row["weight"]["error"] == pytest.approx(math.sqrt(float(expected[6] / expected[7])), rel=1e-9)
    assert row["activation"]["values"] == sum(a.numel() for a in activations)
    want = sum(block_stats(a, fmt)[:-1] for a in activations)
    assert row["activation"]["error"] == pytest.approx(math.sqrt(float(want[6] / want[7])), rel=1e-9)
    assert row["activation"]["flushed"] == float(want[2] / want[0])


def test_the_tokens_counted_stay_exact_in_a_model_cast_to_half():
    """O2 and bf16_true cast a model's floating buffers: the count is an integer buffer, exact past bf16's 256."""
    moe = layer().to(torch.bfloat16)
    for _ in range(3):
        moe(torch.randn(1, 300, D, dtype=torch.bfloat16))
    assert moe.tokens_per_expert.dtype == torch.long and int(moe.tokens_per_expert.sum()) == 3 * 300 * TOP_K


def test_deepseeks_expert_bias_chooses_the_experts_and_leaves_their_weights_to_the_scores():
    """With an expert bias, each token's experts are the top-k of scores + bias (by hand), their weights its scores
    for those experts, normalized; the balance step moves the bias by the speed toward the mean load, centered."""
    torch.manual_seed(0)
    moe = MoE(D, MoESpec(EXPERTS, TOP_K, HIDDEN, score="sigmoid", bias_update_speed=0.01))
    bias = torch.tensor([0.3, -0.2, 0.0, 0.1])
    moe.router.expert_bias.copy_(bias)
    assert "router.expert_bias" in moe.state_dict()  # a checkpoint resumes it
    tokens = torch.randn(40, D)
    _, weights, chosen = moe.router(tokens)
    scores = torch.sigmoid(tokens @ moe.router.gate.weight.T)
    want = (scores + bias).topk(TOP_K, dim=-1).indices
    assert torch.equal(chosen, want) and not torch.equal(want, scores.topk(TOP_K, dim=-1).indices)
    picked = scores.gather(-1, want)
    torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True))

    moe(tokens.view(2, 20, D))
    moe(tokens.view(2, 20, D)[:1])  # a step of two micro-batches: 60 tokens
    load = torch.zeros(EXPERTS)
    for t in torch.cat([want, want[:20]]).reshape(-1):
        load[t] += 1
    delta = 0.01 * torch.sign(load.mean() - load)
    moe.ampctl_after_step()
    torch.testing.assert_close(moe.router.expert_bias, bias + delta - delta.mean())
    assert not moe.tokens_this_step.any()  # counted afresh for the next step


def test_a_capacity_drops_each_experts_pairs_past_it_first_come_first_served():
    """capacity_factor: each expert keeps its first ceil(factor x pairs / experts) (token, k) pairs in token order; a
    dropped pair adds nothing to its token (a hand loop that skips it), nor to the experts' gradients; the drops per
    expert are counted, and the formats' scales do not see the dropped rows (they reach the experts as zeros)."""
    torch.manual_seed(0)
    moe = MoE(D, MoESpec(EXPERTS, TOP_K, HIDDEN, capacity_factor=0.75))
    for weight in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
        torch.nn.init.normal_(weight, std=0.1)
    with torch.no_grad():
        moe.router.gate.weight[0] += 0.5  # expert 0 wanted by most tokens: over its capacity
    x = torch.randn(2, 9, D, requires_grad=True)
    out = moe(x)
    tokens = x.reshape(-1, D)
    scores = torch.softmax(tokens @ moe.router.gate.weight.T, -1)
    weights, chosen = scores.topk(TOP_K, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    capacity = math.ceil(0.75 * tokens.shape[0] * TOP_K / EXPERTS)
    taken, dropped = [0] * EXPERTS, [0] * EXPERTS
    rows = []
    for t in range(tokens.shape[0]):
        row = torch.zeros(D)
        for j in range(TOP_K):
            e = int(chosen[t, j])
            if taken[e] == capacity:
                dropped[e] += 1
                continue
            taken[e] += 1
            h = F.silu(tokens[t] @ moe.experts.w1[e].T) * (tokens[t] @ moe.experts.w3[e].T)
            row = row + weights[t, j] * (h @ moe.experts.w2[e].T)
        rows.append(row)
    expected = torch.stack(rows).view(x.shape)
    assert dropped[0] > 0 and moe.dropped_per_expert.tolist() == dropped
    assert moe.load.tolist() == [taken[e] + dropped[e] for e in range(EXPERTS)]  # the load counts what was routed
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, moe.experts.w1, moe.experts.w2], grad)
    want = torch.autograd.grad(expected, [x, moe.experts.w1, moe.experts.w2], grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_the_load_row_says_the_share_of_pairs_each_layer_dropped():
    from ampctl.analysis.expert_load import expert_load_values, load_row

    row = load_row(5, {"a": [6, 2], "b": [4, 4]}, {"a": [2, 0]})
    assert row["layers"]["a"]["dropped"] == 2 / 8 and "dropped" not in row["layers"]["b"] and row["dropped"] == 0.25
    assert expert_load_values(row)["experts/a/dropped"] == 0.25 and expert_load_values(row)["experts/dropped"] == 0.25
    assert "dropped" not in load_row(5, {"a": [6, 2]})


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_dropped_pairs_are_zeros_at_the_end_of_their_experts_group_as_a_format_would_pad_it(fmt):
    """A capacity keeps each expert's first pairs, so its dropped ones are zero rows at the end of its group: in every
    format the kept rows' outputs and the weight gradients equal the experts run on the kept rows alone (a group's
    padding to whole blocks is zeros too; no amax sees a zero)."""
    from ampctl.engine.precision.mx_emulated import MXEmulatedConverter, MXEmulatedOptions, MXFormat
    from ampctl.recipes.moe import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(2, 32, 32)
    for weight in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(weight, std=0.1)
    MXEmulatedConverter(MXEmulatedOptions(format=MXFormat(fmt)), torch.device("cpu")).convert(experts, "e", fmt)
    kept = torch.randn(6, 32)  # expert 0's first 4 pairs, expert 1's 2
    padded = torch.cat([kept[:4], torch.zeros(3, 32), kept[4:], torch.zeros(1, 32)])  # 3 and 1 dropped
    grads = []
    for x, counts in ((padded, torch.tensor([7, 3])), (kept, torch.tensor([4, 2]))):
        out = experts(x, counts)
        rows = out if x is kept else torch.cat([out[:4], out[7:9]])
        rows.sum().backward()
        grads.append((rows.detach(), [w.grad.clone() for w in (experts.w1, experts.w2, experts.w3)]))
        experts.zero_grad()
    assert torch.equal(grads[0][0], grads[1][0])
    for with_zeros, alone in zip(grads[0][1], grads[1][1]):
        assert torch.equal(with_zeros, alone)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_pairs_dropped_stay_exact_in_a_model_cast_to_half(dtype):
    """O2/O3 (fp16) and bf16_true cast the layer: each forward's drops are the routed counts past the capacity,
    added up exactly past the half types' integer range (fp16's 2048, bf16's 256)."""
    moe = MoE(D, MoESpec(EXPERTS, TOP_K, HIDDEN, capacity_factor=1.0)).to(dtype)
    expected = torch.zeros(EXPERTS, dtype=torch.long)
    for _ in range(4):
        moe(torch.randn(1, 700, D, dtype=dtype))
        capacity = math.ceil(700 * TOP_K / EXPERTS)
        expected += moe.load - moe.load.clamp(max=capacity)
    assert moe.dropped_per_expert.dtype == torch.long and torch.equal(moe.dropped_per_expert, expected)
    assert int(moe.tokens_per_expert.sum()) == 4 * 700 * TOP_K
