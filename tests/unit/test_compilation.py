"""compile_model's CUDA-graph steps (engine/compilation.py): a mode that captures CUDA graphs marks a new step
before every forward of the model, counted here by the calls torch receives (no compilation runs)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampctl.engine.compilation import CUDA_GRAPH_MODES, compile_model


@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"])
def test_a_cuda_graph_mode_marks_a_step_before_each_forward_of_the_model(monkeypatch, mode):
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(len(marks)))
    model = nn.Sequential(nn.Linear(2, 2))
    unused_block = nn.Linear(1, 1)  # compiled lazily and never called: no compilation in this test
    assert compile_model(model, [unused_block], mode) == 1
    for _ in range(3):
        model(torch.ones(1, 2))
    with torch.no_grad():  # an evaluation's forward begins a step too
        model(torch.ones(1, 2))
    assert len(marks) == (4 if mode in CUDA_GRAPH_MODES else 0)
