"""The AMP step's traps: skipped steps leave everything untouched, are detected for fused and unfused
optimizers alike, do not advance the lr schedule; scale bounds; static scaling; gradient accumulation."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from ampctl.engine.loop import train_step
from ampctl.engine.build import build_state
from ampctl.engine.scaler import AmpGradScaler
from ampctl.engine.telemetry import ListSink, Telemetry
from tests.conftest import build, train


def run_steps(state, policy, recipe, batches, steps=1, accum=1, clip=None):
    sink = ListSink()
    telemetry = Telemetry(policy.device, max(steps, 1), recipe.samples_per_batch, None, [sink])
    for step in range(steps):
        train_step(state, batches, recipe, policy, accum, clip, telemetry)
        telemetry.end_step(last=step == steps - 1)
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
        run_steps(state, policy, recipe, batches, steps=1)  # 1e20 overflows fp16: skipped
        # after one skipped step the optimizer has state only if a fused kernel ran; compare from here on
        params, opt_state = snapshot(state)
        scaler = state.scaler.scaler
        scaler.update(1e20)  # force the next step to overflow too
        [record] = run_steps(state, policy, recipe, batches, steps=1)
    assert record.skipped
    after_params, after_state = snapshot(state)
    assert all(torch.equal(a, b) for a, b in zip(params, after_params))
    for before, after in zip(opt_state, after_state):
        assert before.keys() == after.keys()
        for key in before:
            assert torch.equal(torch.as_tensor(before[key]), torch.as_tensor(after[key])), key


def test_skipped_steps_are_the_same_for_fused_and_unfused_optimizers(tmp_path):
    common = ["precision=fp16", "scaler.init_scale=1e20", "scaler.backoff_factor=0.001",
              "scaler.growth_interval=2", "scaler.growth_factor=1000", "train.steps=30"]
    _, fused = train(tmp_path / "fused", *common, "optimizer.fused=true")
    _, unfused = train(tmp_path / "unfused", *common, "optimizer.fused=false")
    assert [r["skipped"] for r in fused] == [r["skipped"] for r in unfused]
    assert [r["loss_scale"] for r in fused] == [r["loss_scale"] for r in unfused]
    assert 3 < sum(r["skipped"] for r in fused) < 30  # it overflows, backs off, regrows, overflows again
    # a fused step that "ran" while skipped must not have moved anything: losses agree to fp noise
    assert [r["loss"] for r in fused] == pytest.approx([r["loss"] for r in unfused], rel=1e-3)


@pytest.mark.parametrize("fused", ["true", "false"])
def test_the_lr_schedule_does_not_advance_on_skipped_steps(tmp_path, fused):
    _, rows = train(
        tmp_path, "precision=fp16", "scaler.init_scale=1e20", "scaler.backoff_factor=0.001",
        "train.lr_schedule=linear", "train.lr_warmup_steps=10", "train.steps=20", f"optimizer.fused={fused}",
    )
    skipped = [r["skipped"] for r in rows]
    assert any(skipped) and not all(skipped)
    applied = 0
    for row in rows:
        # linear warm-up over 10 applied steps, then linear decay to min_lr_ratio=0.1 at step 20
        warmup = min(1.0, (applied + 1) / 10)
        decay = 1 - 0.9 * min(1.0, max(0.0, (applied - 10) / 10))
        assert row["lr"] == pytest.approx(1e-3 * warmup * decay, rel=1e-6), row["step"]
        applied += not row["skipped"]


@pytest.mark.parametrize("fused", ["true", "false"])
def test_the_lr_recorded_is_the_lr_the_optimizer_used(tmp_path, fused):
    """Not its float32 rounding: 5e-05 through a float32 tensor reads back as 4.999999873689376e-05."""
    _, rows = train(tmp_path, "optimizer.lr=5e-05", "train.lr_schedule=constant", "train.steps=2",
                    f"optimizer.fused={fused}")
    assert [r["lr"] for r in rows] == [5e-05, 5e-05]


def test_scale_bounds_hold(tmp_path):
    _, rows = train(tmp_path / "min", "precision=fp16", "scaler.init_scale=1e20", "scaler.backoff_factor=0.001",
                    "scaler.min_scale=1e6", "guard.stop_at_min_scale=false", "train.steps=20")
    assert [r["loss_scale"] for r in rows][:6] == pytest.approx([1e20, 1e17, 1e14, 1e11, 1e8, 1e6])
    assert min(r["loss_scale"] for r in rows) == pytest.approx(1e6)
    _, rows = train(tmp_path / "max", "precision=fp16", "scaler.init_scale=8", "scaler.growth_interval=1",
                    "scaler.max_scale=64", "train.steps=10")
    assert [r["loss_scale"] for r in rows][:5] == [8, 16, 32, 64, 64]


def test_static_scaler_skips_a_nonfinite_step_and_keeps_its_scale():
    cfg, policy, recipe = build("precision=fp16", "scaler=static", "scaler.scale=256")
    with policy:
        state = build_state(cfg, policy, recipe)
        clean = recipe.batches(policy.device, 0)
        x, y = next(clean)
        poisoned = (x.clone().index_fill_(0, torch.tensor([0]), float("inf")), y)
        params, _ = snapshot(state)
        records = run_steps(state, policy, recipe, iter([poisoned, next(clean), next(clean)]), steps=3)
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
        [record] = run_steps(state, policy, recipe, recipe.batches(policy.device, 0), steps=1)
    assert record.skipped and record.skipped_total == 1
    assert state.model.weight.item() == 1.0  # untouched
    assert state.schedule.applied.item() == 0  # the lr schedule did not advance
    if "scaler=dynamic" in scaler:
        assert state.scaler.current_scale().item() == 0.0625 * 0.5  # backed off as after an overflow


def test_fused_sgd_whose_first_step_is_skipped_trains_as_unfused_sgd(tmp_path):
    """torch's fused SGD marks its empty_like momentum buffers initialised even when the scaler skips its first
    step (NaN weights afterwards); ampctl zeroes them first, which leaves every step bit-identical."""
    common = ["precision=fp16", "optimizer=sgd", "scaler.init_scale=4294967296", "scaler.backoff_factor=0.125",
              "train.steps=12"]
    _, fused = train(tmp_path / "fused", *common, "optimizer.fused=true")
    _, unfused = train(tmp_path / "unfused", *common, "optimizer.fused=false")
    assert fused[0]["skipped"] and not all(r["skipped"] for r in fused)
    assert [r["loss"] for r in fused] == [r["loss"] for r in unfused]
    assert all(math.isfinite(r["loss"]) for r in fused)


def test_fused_sgd_with_dampening_under_a_loss_scaler_is_refused():
    from ampctl.errors import UsageError
    from ampctl.engine.build import check_config
    from tests.conftest import FAST, compose_cfg

    cfg = compose_cfg(*FAST, "precision=fp16", "optimizer=sgd", "+optimizer.dampening=0.1")
    with pytest.raises(UsageError, match="optimizer.dampening=0.1 with optimizer.fused=true under a loss scaler"):
        check_config(cfg)
    check_config(compose_cfg(*FAST, "precision=bf16", "optimizer=sgd", "+optimizer.dampening=0.1"))  # no scaler


def test_a_disabled_dynamic_scaler_is_the_identity(tmp_path):
    _, rows = train(tmp_path, "precision=bf16", "scaler=dynamic", "scaler.enabled=false", "train.steps=3")
    assert [r["loss_scale"] for r in rows] == [1.0, 1.0, 1.0]


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
            [record] = run_steps(state, policy, recipe, iter(micro_batches), steps=1, accum=accum)
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
