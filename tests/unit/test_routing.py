"""ampctl diff's routing flips (analysis/routing.py) against a hand count on the same batches and weights, and a
router built to flip (near-tied scores): in bf16 it sends tokens elsewhere by itself, kept in fp32 it sends none."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from ampctl.analysis.layer_errors import Side, measure
from ampctl.analysis.routing import RoutingWatch
from ampctl.recipes.moe import MoE, MoESpec, Router

D, EXPERTS, TOP_K = 32, 8, 2


def near_tied_moe() -> nn.Module:
    """Every expert's gate row the same but for a part in 10^4: scores tied to within bf16's rounding."""
    torch.manual_seed(0)
    moe = MoE(D, MoESpec(EXPERTS, TOP_K, 32))
    for weight in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
        nn.init.normal_(weight, std=0.1)
    with torch.no_grad():
        base = torch.randn(D)
        moe.router.gate.weight.copy_(base + 1e-4 * torch.randn(EXPERTS, D))
    return nn.Sequential(moe)


def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


def router_in_fp32(model: nn.Module) -> nn.Module:
    for router in (m for m in model.modules() if isinstance(m, Router)):
        def in_fp32(x: torch.Tensor, forward=router.forward) -> tuple:
            with torch.autocast("cpu", enabled=False):
                return forward(x.float())
        router.forward = in_fp32
    return model


def sides(candidate: nn.Module, reference: nn.Module) -> tuple[Side, Side]:
    plain = contextlib.nullcontext
    return (Side(reference, plain, lambda: torch.autocast("cpu", enabled=False)),
            Side(candidate, plain, lambda: torch.autocast("cpu", dtype=torch.bfloat16)))


def chosen_of(model: nn.Module, batch: torch.Tensor, autocast: bool) -> torch.Tensor:
    seen = {}
    handle = model[0].router.register_forward_hook(lambda m, a, out: seen.update(chosen=out[2]))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(batch)
    handle.remove()
    return seen["chosen"]


def test_the_flips_are_the_hand_count_of_tokens_whose_experts_differ():
    reference = near_tied_moe()
    candidate = copy.deepcopy(reference)
    batches = [torch.randn(4, 16, D) for _ in range(3)]
    watch = RoutingWatch(reference, candidate)
    measure(*sides(candidate, reference), loss, batches, per_layer=False, routing=watch)
    by_hand = 0
    for batch in batches:
        ours, theirs = chosen_of(reference, batch, False).tolist(), chosen_of(candidate, batch, True).tolist()
        by_hand += sum(set(a) != set(b) for a, b in zip(ours, theirs))
    [result] = watch.results()
    assert result["router"] == "0.router" and result["tokens"] == 3 * 4 * 16
    assert result["flipped"] == by_hand / result["tokens"] and by_hand > 0


def test_a_near_tied_router_flips_tokens_by_itself_in_bf16_and_none_in_fp32():
    reference = near_tied_moe()
    low, kept = copy.deepcopy(reference), router_in_fp32(copy.deepcopy(reference))
    batches = [torch.randn(4, 16, D) for _ in range(2)]
    in_bf16, in_fp32 = RoutingWatch(reference, low), RoutingWatch(reference, kept)
    measure(*sides(low, reference), loss, batches, per_layer=False, routing=in_bf16)
    measure(*sides(kept, reference), loss, batches, per_layer=False, routing=in_fp32)
    [bf16], [fp32] = in_bf16.results(), in_fp32.results()
    assert bf16["own_flipped"] > 0.05  # bf16's rounding of near-tied scores alone reorders the top-k
    assert fp32["own_flipped"] == 0.0 and fp32["scores_error"] is not None


def test_each_experts_own_error_is_its_rows_run_again_on_the_references_routing():
    reference = near_tied_moe()
    candidate = copy.deepcopy(reference)
    batch = torch.randn(2, 12, D)
    layers, _ = measure(*sides(candidate, reference), loss, [batch])
    errors = layers["0.experts"].per_expert
    seen = {}
    handle = reference[0].experts.register_forward_hook(lambda m, args, out: seen.update(args=args))
    with torch.no_grad():
        reference(batch)
    handle.remove()
    x, counts = seen["args"]
    with torch.no_grad():
        exact = reference[0].experts(x, counts)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = candidate[0].experts(x, counts)
    rows = counts.tolist()
    for e, (c, r) in enumerate(zip(torch.split(low.double(), rows), torch.split(exact.double(), rows))):
        if rows[e]:
            assert errors[e].rel_rms == pytest.approx(float((c - r).norm() / r.norm()), rel=1e-9)
        else:
            assert not errors[e].values  # an expert no token chose has no rows to measure
