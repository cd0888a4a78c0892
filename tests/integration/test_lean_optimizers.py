"""Memory-lean optimizers train under every precision mode (whole runs)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ampctl.errors import UsageError
from tests.support.training import train_here


@pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="torch.optim.Adafactor needs torch >= 2.5")
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_adafactor_trains(tmp_path, precision):
    summary, rows = train_here(tmp_path, "optimizer=adafactor", f"precision={precision}", "train.steps=60",
                         "optimizer.lr=0.05")
    assert summary["tail_loss"] < 0.85 * rows[0]["loss"]


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is an optional extra")
def test_adam8bit_trains_with_8bit_state(tmp_path):
    summary, rows = train_here(tmp_path, "optimizer=adam8bit", "precision=fp16", "train.steps=60", "recipe.hidden=128",
                         "optimizer.lr=0.005")
    assert summary["tail_loss"] < 0.85 * rows[0]["loss"]


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="checks the refusal without it")
def test_adam8bit_without_bitsandbytes_says_how_to_install(tmp_path):
    with pytest.raises(UsageError, match=r"bitsandbytes is not installed: pip install 'ampctl\[adam8bit\]'"):
        train_here(tmp_path, "optimizer=adam8bit")

