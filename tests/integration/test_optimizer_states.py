"""torchao's state-precision optimizers in real runs (their update compiled, as a user's run compiles it): a run
stopped and resumed equals the uninterrupted one bit for bit, stochastic rounding's draws included (torch's
generator, which the checkpoint saves); the checkpoint holds plain tensors only."""

from __future__ import annotations

import pytest
import torch

from ampctl.cli import main
from tests.support.runs import rows

pytest.importorskip("torchao.optim")

# hidden=64: the three 64x64 weights are quantized (4096 elements), the rest keep plain states
RUN = ["device=cpu", "recipe=mlp", "recipe.hidden=64", "recipe.batch_size=32", "train.log_every=1",
       "train.checkpoint.every=6", "train.console=quiet", "telemetry.profile_cpu_memory=false"]
STATES = {"adamw_8bit": ["optimizer=adamw_8bit"],
          "adamw_bf16_sr": ["optimizer=adamw_bf16_sr", "precision=O3", "precision.dtype=bfloat16"]}


def checkpoint(run_dir, step: int) -> dict:
    return torch.load(run_dir / "checkpoints" / f"step_{step:08d}.pt", weights_only=True)


@pytest.mark.parametrize("name", sorted(STATES))
def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(tmp_path, restore_argv, name):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    main(["train", *RUN, *STATES[name], "train.steps=12", f"hydra.run.dir={straight}"])
    main(["train", *RUN, *STATES[name], "train.steps=6", f"hydra.run.dir={resumed}"])
    main(["train", *RUN, *STATES[name], "train.steps=12", f"hydra.run.dir={resumed}", "resume=auto"])
    assert [r["loss"] for r in rows(resumed)] == [r["loss"] for r in rows(straight)]
    a, b = checkpoint(straight, 12), checkpoint(resumed, 12)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    states_a, states_b = a["optimizer"]["state"], b["optimizer"]["state"]
    for key in states_a:
        for part, value in states_a[key].items():
            if isinstance(value, dict):  # a quantized state, as its plain tensors
                assert value["torchao_optim_state"].startswith("OptimState")
                assert all(torch.equal(t, states_b[key][part]["tensors"][n]) for n, t in value["tensors"].items())
            else:
                assert torch.equal(value, states_b[key][part])
    quantized = [v for s in states_a.values() for v in s.values() if isinstance(v, dict)]
    assert len(quantized) == (6 if name == "adamw_8bit" else 0)  # 3 weights x 2 moments
    if name == "adamw_bf16_sr":
        assert {v.dtype for v in a["model"].values()} == {torch.bfloat16}  # pure bf16: what SR rounds
