"""Overrides that several test modules run with."""

from __future__ import annotations

import importlib.util
from importlib import resources

import pytest
from omegaconf import OmegaConf

TINY_GPT = ["recipe=gpt", "recipe.d_model=32", "recipe.n_layers=2", "recipe.n_heads=2", "recipe.block_size=32",
            "recipe.batch_size=8", "recipe.max_corpus_bytes=200000"]

MODES = [
    ["precision=fp32"],
    ["precision=O0"],
    ["precision=fp16"],
    ["precision=O1"],
    ["precision=bf16"],
    ["precision=O2"],
    ["precision=O3"],
    ["precision=O1", "precision.dtype=bfloat16"],
    ["precision=O2", "precision.dtype=bfloat16"],
    ["precision=O3", "precision.dtype=bfloat16"],
]


def optimizers_each_with_a_precision(installed_only: bool = False) -> list:
    """pytest params (optimizer, a precision it runs in) for every optimizer `ampctl list` names
    (ampctl/conf/optimizer/), those whose package is absent marked skipped; installed_only: the installed ones'
    (optimizer, precision) pairs alone."""
    params = []
    for path in sorted(resources.files("ampctl.conf").joinpath("optimizer").iterdir(), key=lambda p: p.name):
        if not path.name.endswith(".yaml"):
            continue
        node = OmegaConf.create(path.read_text())
        package = node["_target_"].split(".")[0]
        absent = importlib.util.find_spec(package) is None
        # an optimizer that rounds bf16 weights stochastically steps on pure bf16 weights only
        precision = "bf16_true" if node.get("bf16_stochastic_round") else "fp32"
        name = path.name[:-len(".yaml")]
        if installed_only:
            params += [] if absent else [(name, precision)]
        else:
            params.append(pytest.param(name, precision, marks=pytest.mark.skipif(
                absent, reason=f"{package} is an optional extra")))
    return params
