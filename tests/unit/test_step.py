"""The AMP step's traps: skipped steps leave everything untouched, are detected for fused and unfused
optimizers alike, do not advance the lr schedule; scale bounds; static scaling; gradient accumulation."""

from __future__ import annotations

import itertools

import pytest
import torch

from ampctl.engine.build import build_state
from ampctl.engine.loop import StepSettings, StepsHooks, run_steps
from ampctl.engine.scaler import AmpGradScaler
from ampctl.engine.telemetry import ListSink, Telemetry
from tests.support.training import build


def records_of_steps(state, policy, recipe, batches, steps=1, accum=1, clip=None):
    """engine.loop.run_steps on these batches, and the record of each step (as a run's sinks get them)."""
    sink = ListSink()
    telemetry = Telemetry(policy.device, max(steps, 1), recipe.samples_per_batch, None, [sink])
    run_steps(state, batches, steps, recipe, policy, StepSettings(accum, clip), StepsHooks(records=telemetry))
    return sink.records


def snapshot(state):
    params = [p.detach().clone() for p in state.weights.optimizer_params]
    opt_state = [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for s in state.optimizer.state.values()
    ]
    return params, opt_state


@pytest.mark.parametrize("fused", ["true", "false"])
def test_a_skipped_step_leaves_weights_and_optimizer_state_untouched(fused):
    cfg, policy, recipe = build("precision=fp16", "scaler.init_scale=1e20", f"optimizer.fused={fused}")
    with policy:
        state = build_state(cfg, policy, recipe)
        batches = recipe.batches(policy.device, 0)
        records_of_steps(state, policy, recipe, batches, steps=1)  # 1e20 overflows fp16: skipped
        # after one skipped step the optimizer has state only if a fused kernel ran; compare from here on
        params, opt_state = snapshot(state)
        state.scaler.update(1e20)  # force the next step to overflow too
        [record] = records_of_steps(state, policy, recipe, batches, steps=1)
    assert record.skipped
    after_params, after_state = snapshot(state)
    assert all(torch.equal(a, b) for a, b in zip(params, after_params))
    for before, after in zip(opt_state, after_state):
        assert before.keys() == after.keys()
        for key in before:
            assert torch.equal(torch.as_tensor(before[key]), torch.as_tensor(after[key])), key


def test_static_scaler_skips_a_nonfinite_step_and_keeps_its_scale():
    cfg, policy, recipe = build("precision=fp16", "scaler=static", "scaler.scale=256")
    with policy:
        state = build_state(cfg, policy, recipe)
        clean = recipe.batches(policy.device, 0)
        x, y = next(clean)
        poisoned = (x.clone().index_fill_(0, torch.tensor([0]), float("inf")), y)
        params, _ = snapshot(state)
        records = records_of_steps(state, policy, recipe, iter([poisoned, next(clean), next(clean)]), steps=3)
    assert [r.skipped for r in records] == [True, False, False]
    assert [r.loss_scale for r in records] == [256, 256, 256]
    assert records[-1].skipped_total == 1
    assert not all(torch.equal(a, b) for a, b in zip(params, snapshot(state)[0]))


class HugeGradientRecipe:
    """One weight whose true gradient, 1e5, fits fp16 only while the loss is scaled below 1."""

    samples_per_batch, tokens_per_batch = 1, None

    def build_model(self):
        model = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.ones_(model.weight)
        return model

    def batches(self, device, seed):
        return itertools.repeat(torch.ones(1, 1, device=device))

    def loss(self, model, x):
        return model(x).float().sum() * 1e5


@pytest.mark.parametrize("scaler", [["scaler=static", "scaler.scale=0.0625"],
                                    ["scaler=dynamic", "scaler.init_scale=0.0625"]], ids=["static", "dynamic"])
@pytest.mark.parametrize("fused", ["true", "false"])
def test_gradients_that_become_non_finite_when_unscaled_skip_the_step(scaler, fused):
    """O3's half gradient is 1e5 / 16 = 6250, finite, so GradScaler's check (made before unscaling) passes;
    unscaled in fp16 it is 1e5 > 65504 = inf. The step must be skipped, not applied."""
    cfg, policy, recipe = build("precision=O3", *scaler, f"optimizer.fused={fused}")
    recipe = HugeGradientRecipe()
    with policy:
        state = build_state(cfg, policy, recipe)
        [record] = records_of_steps(state, policy, recipe, recipe.batches(policy.device, 0), steps=1)
    assert record.skipped and record.skipped_total == 1
    assert state.model.weight.item() == 1.0  # untouched
    assert state.schedule.applied.item() == 0  # the lr schedule did not advance
    if "scaler=dynamic" in scaler:
        assert state.scaler.current_scale().item() == 0.0625 * 0.5  # backed off as after an overflow


def test_fused_sgd_with_dampening_under_a_loss_scaler_is_refused():
    from ampctl.errors import UsageError
    from ampctl.runner.plan import check_config
    from tests.support.training import FAST, compose_cfg

    cfg = compose_cfg(*FAST, "precision=fp16", "optimizer=sgd", "+optimizer.dampening=0.1")
    with pytest.raises(UsageError, match="optimizer.dampening=0.1 with optimizer.fused=true under a loss scaler"):
        check_config(cfg)
    check_config(compose_cfg(*FAST, "precision=bf16", "optimizer=sgd", "+optimizer.dampening=0.1"))  # no scaler


def test_gradscaler_state_round_trips():
    scaler = AmpGradScaler("cpu", init_scale=1024.0, growth_interval=7, min_scale=1.0)
    scaler.scale(torch.ones(()))  # materialize the device state
    restored = AmpGradScaler("cpu", min_scale=1.0)
    restored.load_state_dict(scaler.state_dict())
    assert restored.get_scale() == 1024.0 and restored.get_growth_interval() == 7


@pytest.mark.parametrize("precision", ["fp32", "fp16", "O2"])
def test_grad_accumulation_equals_one_big_batch(precision):
    """4 micro-batches of 8 under grad_accum_steps=4 take the same step as one batch of 32. With SGD, whose
    step is linear in the gradient (Adam's first step is ~lr*sign(g), which amplifies rounding noise)."""

    def one_step(accum, micro_batches):
        cfg, policy, recipe = build(
            f"precision={precision}", "recipe.batch_size=8", "train.clip_grad_norm=null", "optimizer=sgd"
        )
        with policy:
            state = build_state(cfg, policy, recipe)
            [record] = records_of_steps(state, policy, recipe, iter(micro_batches), steps=1, accum=accum)
        return record, [p.detach().clone() for p in state.weights.optimizer_params]

    _, _, recipe = build("recipe.batch_size=8")
    micro = list(itertools.islice(recipe.batches(torch.device("cpu"), 0), 4))
    whole = (torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro]))
    rec_accum, params_accum = one_step(4, micro)
    rec_whole, params_whole = one_step(1, [whole])
    assert rec_accum.loss == pytest.approx(rec_whole.loss, rel=1e-3)
    assert rec_accum.grad_norm == pytest.approx(rec_whole.grad_norm, rel=2e-2)
    for a, b in zip(params_accum, params_whole):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_the_recorded_lr_is_the_schedules_even_where_the_optimizer_keeps_a_float32_copy():
    """torchao's optimizers keep the lr as a float32 tensor (0.001 as 0.0010000000474974513): the schedule takes the
    lr as written, sets the optimizer's copy in its own dtype, and records its own float64 value."""
    from omegaconf import OmegaConf

    from ampctl.engine.optim import LRSchedule, as_written

    assert as_written(torch.tensor(0.001, dtype=torch.float32)) == 0.001
    assert as_written(torch.tensor(3e-4, dtype=torch.float32)) == 3e-4 and as_written(0.1) == 0.1
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=torch.tensor(0.001, dtype=torch.float32))
    lr = OmegaConf.create({"schedule": "linear", "warmup_steps": 4, "min_ratio": 0.0})
    from ampctl.conf.train_schema import Schedule

    lr.schedule = Schedule.linear
    schedule = LRSchedule(optimizer, lr, 10, torch.device("cpu"))
    for step in range(3):
        assert schedule.current_lr().item() == (step + 1) / 4 * 0.001  # the schedule's, in float64
        assert optimizer.param_groups[0]["lr"].dtype == torch.float32
        assert optimizer.param_groups[0]["lr"].item() == torch.tensor((step + 1) / 4 * 0.001).float().item()
        schedule.step(torch.zeros(()), can_skip=False)
