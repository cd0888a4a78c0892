"""Every precision mode as a whole run: it trains, warns, restores global flags, prints its resolved options."""

from __future__ import annotations

import pytest

from ampctl.engine.precision import fp32_math
from tests.support.configs import MODES
from tests.support.simulated_cpu import AMX, AVX2_ONLY, AVX512_BF16, use_simulated
from tests.support.training import build, train_here


@pytest.mark.parametrize("overrides", MODES, ids=lambda o: " ".join(x.split("=")[1] for x in o))
def test_every_mode_trains_the_mlp(tmp_path, overrides):
    summary, rows = train_here(tmp_path, *overrides, "train.steps=60", "optimizer.lr=0.005")
    assert len(rows) == 60
    first = sum(r["loss"] for r in rows[:5]) / 5
    assert summary["tail_loss"] < 0.8 * first, (first, summary["tail_loss"])
    assert summary["skipped_total"] <= 3  # a scaler may back off once or twice from 65536, not more


def test_fp32_is_true_fp32_and_global_flags_are_restored(tmp_path):
    saved = fp32_math.snapshot()
    try:
        fp32_math.set_tf32(True)  # what a user's environment may have set before the run
        before = fp32_math.snapshot()
        _, policy, _ = build("precision=fp32")
        with policy:
            inside = fp32_math.snapshot()
        assert all(v in ("ieee", "highest", False) for v in inside.values()), inside
        train_here(tmp_path, "precision=fp32", "train.steps=2")
        assert fp32_math.snapshot() == before
    finally:
        fp32_math.restore(saved)


@pytest.mark.parametrize(
    "overrides,warning",
    [(["precision=bf16", "scaler=dynamic"], "rarely needed"), (["precision=fp16", "scaler=none"], "underflow"),
     # the same situation in other words: a disabled GradScaler is the identity
     (["precision=fp16", "scaler.enabled=false"], "runs in float16 without loss scaling: small gradients will"),
     (["precision=bf16", "scaler=static", "scaler.scale=1024"], "a loss scaler is rarely needed")],
)
def test_suspicious_combinations_warn_once(tmp_path, overrides, warning):
    from ampctl.runner.plan import plan_run
    from ampctl.runner.run import run_training
    from tests.support.training import FAST, compose_cfg

    lines: list[str] = []
    run_training(plan_run(compose_cfg(*FAST, *overrides, "train.steps=2"), tmp_path), echo=lines.append)
    warnings = [line for line in lines if line.startswith("warning:") and "slower than fp32" not in line]
    assert len(warnings) == 1 and warning in warnings[0]


@pytest.mark.parametrize("precision,bf16,fp16,warning", [
    ("fp16", 0.5, 30.0, "slower than fp32; precision=bf16 runs at fp32's speed or faster at 1024x1024x1024 here"),
    ("bf16", 16.0, 30.0, "bfloat16 matmuls are converted in software on this CPU, which has no AVX512-BF16 or "
                         "AMX-BF16 (measured: "),
    ("O2", 16.0, 30.0, "slower than fp32; precision=fp32 is the fastest mode on this CPU"),
    ("fp16", 0.5, 0.8, None),  # a CPU with AMX-FP16
    ("bf16", 0.5, 30.0, None),
])
def test_a_half_mode_slower_than_fp32_on_this_cpu_warns_at_start(monkeypatch, tmp_path, precision, bf16, fp16, warning):
    from ampctl.runner.plan import plan_run
    from ampctl.runner.run import run_training
    from tests.support.training import FAST, compose_cfg

    use_simulated(monkeypatch, bf16, fp16, AMX if fp16 < 1 else AVX512_BF16 if bf16 < 1 else AVX2_ONLY)
    lines: list[str] = []
    cfg = compose_cfg(*FAST, f"precision={precision}", "device=cpu", "train.steps=1")
    run_training(plan_run(cfg, tmp_path), echo=lines.append)
    slow = [line for line in lines if "slower than fp32" in line]
    assert (slow and warning in slow[0]) if warning else not slow


def test_the_resolved_options_are_printed_at_start(tmp_path):
    from ampctl.runner.plan import plan_run
    from ampctl.runner.run import run_training
    from tests.support.training import FAST, compose_cfg

    lines: list[str] = []
    run_training(plan_run(compose_cfg(*FAST, "precision=O2", "train.steps=1"), tmp_path), echo=lines.append)
    assert lines[0].startswith("Selected precision=O2: autocast=off, model_weights=float16, "
                               "master_weights=float32, rules=[type=norm run_in=fp32], tf32=off, loss_scale=dynamic")

