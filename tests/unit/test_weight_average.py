"""engine/weight_average.py against its definition computed by hand in float64: the average is the weights at
the start step, then ema <- decay * ema + (1 - decay) * w after every `every`-th step; kept in fp32 over half
weights; evaluated in the model's parameters and put back bit for bit; and never read from the device."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ampctl.engine import weight_average
from ampctl.engine.weight_average import WeightAverage


def model_of(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)).to(dtype)
    model[1].weight.requires_grad_(False)  # a frozen parameter is not averaged
    return model


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def step_weights(params: list[nn.Parameter], step: int) -> None:
    """What an optimizer step does to the weights: moves them (in their own dtype)."""
    generator = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=generator).to(p.dtype) * 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("start,every", [(0, 1), (3, 2)])
def test_the_average_is_the_ema_of_the_weights_computed_by_hand(dtype, start, every):
    model = model_of(dtype)
    params = trainable(model)
    decay = 0.8
    average = WeightAverage(model, params, decay, start_step=start, every=every)
    assert len(average.averages) == len(params) == 5 and {a.dtype for a in average.averages} == {torch.float32}
    expected = [p.detach().double() for p in params]  # the initial weights until the start step
    for step in range(1, 12):
        step_weights(params, step)
        average.after_step(step)
        if step == start:
            expected = [p.detach().double() for p in params]
        elif step > start and (step - start) % every == 0:
            expected = [decay * e + (1 - decay) * p.detach().double() for e, p in zip(expected, params)]
        for held, wanted in zip(average.averages, expected):
            torch.testing.assert_close(held.double(), wanted, rtol=1e-6, atol=1e-7)
    if dtype != torch.float32:  # fp32 keeps what the half weights cannot hold
        assert any(not torch.equal(a, a.to(dtype).float()) for a in average.averages)


def test_half_weights_are_cast_in_bounded_chunks_with_the_same_result(monkeypatch):
    model_a, model_b = model_of(torch.bfloat16), model_of(torch.bfloat16)
    whole = WeightAverage(model_a, trainable(model_a), 0.9)
    monkeypatch.setattr(weight_average, "_CAST_CHUNK_ELEMENTS", 20)  # a chunk per tensor or two
    chunked = WeightAverage(model_b, trainable(model_b), 0.9)
    for step in range(1, 4):
        step_weights(trainable(model_a), step)
        step_weights(trainable(model_b), step)
        whole.after_step(step)
        chunked.after_step(step)
    assert all(torch.equal(a, b) for a, b in zip(whole.averages, chunked.averages))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_average_is_swapped_into_the_model_and_the_weights_come_back_bit_for_bit(dtype):
    model = model_of(dtype)
    average = WeightAverage(model, trainable(model), 0.5)
    step_weights(trainable(model), 1)
    average.after_step(1)
    own = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randn(2, 8).to(dtype)
    with average.swapped_in():
        for name, held in zip(average.names, average.averages):
            assert torch.equal(model.get_parameter(name), held.to(dtype))
        assert torch.equal(model[1].weight, own["1.weight"])  # frozen: the model's own
        swapped_out = model(x)
    assert all(torch.equal(p, own[n]) for n, p in model.named_parameters())
    assert not torch.equal(swapped_out, model(x))
    with pytest.raises(RuntimeError), average.swapped_in():  # an evaluation that fails puts them back too
        raise RuntimeError("evaluation failed")
    assert all(torch.equal(p, own[n]) for n, p in model.named_parameters())


class DeviceReads(TorchDispatchMode):
    """Counts the ops that copy a value to the host (.item(), bool(), float() of a tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_updating_and_swapping_read_nothing_from_the_device():
    model = model_of(torch.bfloat16)
    average = WeightAverage(model, trainable(model), 0.9, start_step=1, every=1)
    with DeviceReads() as watched:
        for step in range(1, 4):
            average.after_step(step)
        with average.swapped_in():
            pass
    assert watched.reads == 0
    with DeviceReads() as control:  # the watch sees a read where there is one
        bool(average.averages[0].sum() > 0)
    assert control.reads == 1


def test_a_state_dict_round_trips_and_a_mismatched_one_is_refused():
    model = model_of(torch.float32)
    average = WeightAverage(model, trainable(model), 0.9)
    step_weights(trainable(model), 1)
    average.after_step(1)
    saved = {n: t.clone() for n, t in average.state_dict(whole=True).items()}
    other_model = model_of(torch.float32)
    other = WeightAverage(other_model, trainable(other_model), 0.9)
    other.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(average.averages, other.averages))
    with pytest.raises(ValueError, match=r"holds 3 tensors, this model 5 trainable parameters"):
        other.load_state_dict({n: t for n, t in list(saved.items())[:3]})
