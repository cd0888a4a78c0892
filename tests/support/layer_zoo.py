"""A model of every layer type autocast treats differently on some device, and the check of ampctl's layer table
against forward hooks on it (tests/integration/test_layer_rules.py on the CPU, tests/gpu on CUDA)."""

from __future__ import annotations

import torch
from torch import nn

from tests.support.training import build


class LayerZoo(nn.Module):
    """One of each layer type autocast treats differently on some device: matmuls and convolutions, the norms, a
    PReLU, a GRU, an embedding, each fed what the layer before gives it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.lin = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.rms = nn.RMSNorm(8)
        self.conv = nn.Conv1d(8, 8, 1)
        self.gn = nn.GroupNorm(2, 8)
        self.bn = nn.BatchNorm1d(8)
        self.inorm = nn.InstanceNorm1d(8, affine=True)
        self.prelu = nn.PReLU()
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.head = nn.Linear(8, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.rms(self.ln(self.lin(self.embed(tokens))))
        h = self.inorm(self.bn(self.gn(self.conv(h.unsqueeze(-1).expand(-1, -1, 4)))))
        out, _ = self.gru(self.prelu(h.mean(-1)).unsqueeze(1))
        return self.head(out[:, 0])


def check_the_layer_table_against_hooks(*overrides: str) -> None:
    """Each row of the resolved table against a forward hook on each of its layers, in one forward of the prepared
    model: a dtype is the layer's output dtype; `as input` is the dtype it was given (a norm on a CPU after a
    half layer is half, after an fp32 one fp32). Hooks go first, before ampctl's own casts around O2's layers."""
    cfg, policy, recipe = build(f"precision={overrides[0]}", *overrides[1:])
    seen: dict[str, tuple[torch.dtype, torch.dtype]] = {}

    def record(name: str):
        def hook(module, args, out):
            given = next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
            seen[name] = (given, (out[0] if isinstance(out, tuple) else out).dtype)
        return hook

    with policy:
        model = policy.convert_module(LayerZoo())
        for name, module in model.named_modules():
            if name:
                module.register_forward_hook(record(name), prepend=True)
        with policy.forward_context():
            model(torch.tensor([1, 2, 3], device=policy.device))
    checked = 0
    for row in policy.layer_rows:
        for name in row.names:
            given, out = seen[name]
            module = model.get_submodule(name)
            if row.converter != "-" or getattr(module, "ampctl_outputs_fp32", False):
                continue  # a converted layer's format; a ruled layer whose outputs return to fp32 (tested above)
            if row.compute == "as input":
                assert out == given, (name, row, seen[name])
            else:
                assert str(out).removeprefix("torch.") == row.compute, (name, row, seen[name])
            checked += 1
    assert checked >= 8, policy.layer_rows
