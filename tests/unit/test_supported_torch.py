"""Supported torch versions. pyproject's floor is the oldest torch the suite has passed on (2.11, the GPU
image's, the GPU tests included; CI runs the newest). ampctl's loss scaler extends torch.amp.GradScaler
through its private state: those names are checked on whatever torch is installed, so that an upgrade which
moves them fails here, by name, not in the middle of a run."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"

# Every private GradScaler member ampctl/engine/scaler.py and runner/checkpointing/checkpoint.py read or override.
GRADSCALER_INTERNALS = ("_init_scale", "_scale", "_growth_tracker", "_growth_factor", "_backoff_factor",
                        "_growth_interval", "_enabled", "_per_optimizer_states", "_lazy_init_scale_growth_tracker",
                        "_unscale_grads_")


def test_the_gradscaler_internals_the_scaler_builds_on_exist():
    scaler = torch.amp.GradScaler("cpu")
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    assert [name for name in GRADSCALER_INTERNALS if not hasattr(scaler, name)] == []


def test_the_installed_torch_is_within_the_supported_range():
    floor = re.search(r'"torch>=([\d.]+)"', PYPROJECT.read_text()).group(1)
    assert Version(torch.__version__.split("+")[0]) >= Version(floor)
