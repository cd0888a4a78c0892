"""engine/optimizer_states.py: torchao's AdamW with states in bf16, 8 bits, 4 bits or FP8, against references
computed here: one step by hand (torch's AdamW in fp32), stochastic rounding's expectation and its two neighbours,
and what is refused before anything is built. torchao's update runs eagerly in these tests (torch.compile an
identity: the same function, without seconds of compiling per shape); the compiled one is the runs'
(tests/integration/test_optimizer_states.py)."""

from __future__ import annotations

import pytest
import torch

from ampctl.errors import UnsupportedError, UsageError
from tests.support.training import build, compose_cfg

torchao_optim = pytest.importorskip("torchao.optim")

LOW_BIT = {"adamw_8bit": torchao_optim.AdamW8bit, "adamw_4bit": torchao_optim.AdamW4bit,
           "adamw_fp8": torchao_optim.AdamWFp8}


@pytest.fixture
def eager(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)


def one_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()
    optimizer.step()


@pytest.mark.parametrize("name", sorted(LOW_BIT))
def test_the_first_steps_are_adamws_within_what_the_format_keeps(name, eager):
    """Step 1 updates from the fp32 moments, as torch's AdamW does: equal to rounding. Later steps read moments
    back from 8/4-bit or FP8 blocks: each step's update stays within the format's error of AdamW's, and the weights
    after 5 steps are AdamW's to a small fraction of what the 5 updates moved them."""
    torch.manual_seed(0)
    weight = torch.randn(64, 128)  # 8192 elements: quantized
    grads = [torch.randn(64, 128) for _ in range(5)]
    ours, reference = weight.clone(), weight.clone()
    low_bit = LOW_BIT[name]([ours], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    adamw = torch.optim.AdamW([reference], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for step, grad in enumerate(grads):
        one_step(low_bit, [ours], [grad])
        one_step(adamw, [reference], [grad])
        if step == 0:
            torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-7)
    assert type(low_bit.state[ours]["exp_avg"]).__name__.startswith("OptimState")
    moved = (reference - weight).abs().mean()
    error = (ours - reference).abs().mean()
    assert 0 < error < {"adamw_4bit": 0.2, "adamw_8bit": 0.02, "adamw_fp8": 0.04}[name] * moved, (error, moved)


def test_stochastic_rounding_keeps_an_update_below_half_a_bf16_step_in_expectation(eager):
    """65536 bf16 weights of 1.0, one AdamW step of lr 1e-3 (the first step moves each by lr): 1 - 1e-3 lies between
    the bf16 neighbours 1 - 2^-8 and 1.0. Round to nearest loses the update (every weight stays 1.0); stochastic
    rounding takes the lower neighbour with probability 1e-3 / 2^-8 = 0.256, so the mean is 1 - 1e-3 within the
    sampling error, and every weight is one of the two neighbours."""
    n, lr, spacing = 65536, 1e-3, 2.0 ** -8
    means = {}
    for stochastic in (False, True):
        torch.manual_seed(0)
        weight = torch.ones(n, dtype=torch.bfloat16)
        optimizer = torchao_optim._AdamW([weight], lr=lr, weight_decay=0.0, bf16_stochastic_round=stochastic)
        one_step(optimizer, [weight], [torch.ones(n, dtype=torch.bfloat16)])
        assert set(weight.float().unique().tolist()) <= {1.0, 1.0 - spacing}
        means[stochastic] = weight.double().mean().item()
    p_down = lr / spacing
    sampling_error = spacing * (p_down * (1 - p_down) / n) ** 0.5
    assert means[False] == 1.0
    assert abs(means[True] - (1 - lr)) < 5 * sampling_error, (means[True], 1 - lr, sampling_error)


def test_stochastic_rounding_is_unbiased_at_every_fraction(eager):
    """The rounding itself (torchao's _fp32_to_bf16_sr): for values at 1/8 .. 7/8 of the way between two bf16
    neighbours, the fraction rounded up is that position, within the sampling error; never further than one step."""
    from torchao.optim.quant_utils import _fp32_to_bf16_sr

    torch.manual_seed(0)
    low, high = 1.0, 1.0 + 2.0 ** -7
    n = 100_000
    for eighth in range(1, 8):
        x = torch.full((n,), low + (high - low) * eighth / 8, dtype=torch.float32)
        rounded = _fp32_to_bf16_sr(x).float()
        assert set(rounded.unique().tolist()) <= {low, high}
        up = (rounded == high).double().mean().item()
        assert abs(up - eighth / 8) < 5 * (eighth / 8 * (1 - eighth / 8) / n) ** 0.5, (eighth, up)


@pytest.mark.parametrize("precision", [["precision=fp32"], ["precision=bf16"],
                                       ["precision=O2", "precision.dtype=bfloat16"], ["precision=O3"]])
def test_stochastic_rounding_is_refused_where_the_weights_stepped_on_are_not_bf16(precision):
    """torchao rounds only bf16 weights and says nothing otherwise: the choice would silently do nothing."""
    with pytest.raises(UsageError, match=r"optimizer.bf16_stochastic_round=true rounds the bfloat16 weights .* "
                                         r"use precision=bf16_true \(pure bf16"):
        build(*precision, "optimizer=adamw_bf16_sr")


def test_stochastic_rounding_in_pure_bf16_is_planned():
    cfg, policy, _ = build("precision=O3", "precision.dtype=bfloat16", "optimizer=adamw_8bit",
                           "optimizer.bf16_stochastic_round=true")
    assert cfg.optimizer.bf16_stochastic_round and policy.precision.cast_model


@pytest.mark.parametrize("override,match", [
    ("optimizer.block_size=100", r"optimizer.block_size=100 is not allowed: a power of two \(torchao's default for "
                                 r"AdamW8bit is 256\)"),
])
def test_what_the_quantized_states_cannot_do_is_refused(override, match):
    with pytest.raises((UsageError, UnsupportedError), match=match):
        build("optimizer=adamw_8bit", override)


def test_fsdp_with_whole_checkpoints_is_refused_for_quantized_states_only():
    """torchao's quantized states cannot be split: FSDP could write a whole checkpoint but never load it again
    (found by resuming one: aten.split is not implemented). bf16 states are plain tensors and shard."""
    from ampctl.engine import optimizer_states

    for name, refused in (("adamw_8bit", True), ("adamw_4bit", True), ("adamw_fp8", True), ("adamw_bf16_sr", False)):
        cfg = compose_cfg(f"optimizer={name}", "optimizer.bf16_stochastic_round=false").optimizer
        optimizer_states.check(cfg, "float32", False, fsdp_with_whole_checkpoints=False)
        if refused:
            with pytest.raises(UnsupportedError, match="use distributed.checkpoint_format=sharded"):
                optimizer_states.check(cfg, "float32", False, fsdp_with_whole_checkpoints=True)
        else:
            optimizer_states.check(cfg, "float32", False, fsdp_with_whole_checkpoints=True)


@pytest.mark.parametrize("name", sorted(LOW_BIT))
def test_a_quantized_state_is_kept_as_plain_tensors_and_rebuilt_bit_for_bit(name, eager):
    """What a whole checkpoint holds: torch.load(weights_only=True) reads it without torchao imported first."""
    import io

    from ampctl.engine import optimizer_states

    torch.manual_seed(0)
    weight = torch.randn(64, 128)
    optimizer = LOW_BIT[name]([weight], lr=1e-2)
    one_step(optimizer, [weight], [torch.randn(64, 128)])
    plain = optimizer_states.plain_states(optimizer.state_dict())
    buffer = io.BytesIO()
    torch.save(plain, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert all(type(t) is torch.Tensor for t in _tensors(loaded))
    rebuilt = optimizer_states.quantized_states(loaded, into_shards=False)
    fresh = LOW_BIT[name]([weight.clone()], lr=1e-2)
    fresh.load_state_dict(rebuilt)
    for key in ("exp_avg", "exp_avg_sq"):
        before, after = optimizer.state[weight][key], next(iter(fresh.state.values()))[key]
        assert type(after) is type(before)
        names, _ = before.__tensor_flatten__()
        assert all(torch.equal(getattr(before, n), getattr(after, n)) for n in names)
    with pytest.raises(UnsupportedError, match="resume it without distributed.kind=fsdp"):
        optimizer_states.quantized_states(loaded, into_shards=True)


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)


def test_without_torchao_the_install_is_named(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(UnsupportedError, match=r"torchao is not installed; pip install 'ampctl\[torchao\]'"):
        build("optimizer=adamw_4bit")


def test_the_lr_is_a_device_tensor_the_schedule_updates_in_place():
    """torchao turns a float lr into a CPU tensor; given one on the device, the schedule's update stays there."""
    from ampctl.engine.build import build_state

    cfg, policy, recipe = build("optimizer=adamw_8bit")
    with policy:
        state = build_state(cfg, policy, recipe)
    lr = state.optimizer.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.device == policy.device and lr.dtype == torch.float32
    assert state.schedule.on_device
