"""The checkpointing process's hand-over (runner/checkpointing/checkpoint_process.py), in this process: the states
copied into one
buffer of shared memory, DCP's save of them and its failures as the training process raises them. Its processes,
ranks and FSDP's DTensors: tests/integration/test_sharded_checkpoints.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ampctl.errors import write_refused
from ampctl.runner.checkpointing import checkpoint_process
from ampctl.runner.checkpointing.checkpoint_process import SHARED_MEMORY, _raised, _saved, _staged, _unstaged


def test_the_states_are_copied_into_shared_memory_and_saved_as_they_were(tmp_path):
    model = {"w": torch.randn(4, 3), "b": torch.arange(3, dtype=torch.bfloat16), "n": torch.tensor(7)}
    states = {"model": model, "optimizer": {"state": {0: {"step": torch.tensor(7.0)}}, "param_groups": [{"lr": 0.1}]}}
    before = {name: t.clone() for name, t in model.items()}
    staged, buffer = _staged(states, None)
    assert buffer.is_shared()
    model["w"].add_(1)  # training goes on: the staged copy does not move with it
    viewed = _unstaged(staged, buffer, None)
    assert all(torch.equal(viewed["model"][name], t) and viewed["model"][name].dtype == t.dtype
               for name, t in before.items())
    assert viewed["optimizer"]["param_groups"] == [{"lr": 0.1}]
    assert _saved(buffer, staged, str(tmp_path / "step.dcp"), None) is None
    back = {"model": {"w": torch.empty(4, 3), "b": torch.empty(3, dtype=torch.bfloat16), "n": torch.tensor(0)}}
    dcp.load(back, checkpoint_id=str(tmp_path / "step.dcp"), no_dist=True)
    assert all(torch.equal(back["model"][name], t) for name, t in before.items())


def test_one_buffer_and_one_file_descriptor_however_many_tensors_and_reused_by_the_next_save():
    """A shared tensor holds a file descriptor: one per tensor would pass a process's limit (often 1024)."""
    open_before = len(os.listdir("/proc/self/fd"))
    staged, buffer = _staged({str(i): torch.full((10,), float(i)) for i in range(2000)}, None)
    assert len(os.listdir("/proc/self/fd")) <= open_before + 2
    again, same = _staged({str(i): torch.full((10,), -float(i)) for i in range(2000)}, buffer)
    assert same is buffer and torch.equal(_unstaged(again, same, None)["7"], torch.full((10,), -7.0))
    larger, grown = _staged({"big": torch.ones(10**6)}, buffer)  # more than it holds: a new buffer
    assert grown is not buffer and grown.numel() >= 4 * 10**6


def test_a_refused_write_comes_back_as_the_oserror_it_was():
    staged, buffer = _staged({"w": torch.ones(3)}, None)
    answer = _saved(buffer, staged, "/sys/ampctl-test.dcp", None)  # a file system that refuses (as root too)
    assert answer is not None and answer[0] == "refused"
    raised = _raised(answer)
    assert isinstance(raised, OSError) and write_refused(raised) and raised.filename == "/sys/ampctl-test.dcp"
    failed = _raised(("failed", "ValueError: no"))
    assert isinstance(failed, RuntimeError) and "ValueError: no" in str(failed)


def test_full_shared_memory_is_a_refused_write_naming_it(monkeypatch):
    def full(self):
        raise RuntimeError("unable to resize file </torch_1_2_3> to the right size: No space left on device (28)")

    monkeypatch.setattr(torch.Tensor, "share_memory_", full)
    with pytest.raises(OSError) as raised:
        checkpoint_process._shared_bytes(64)
    assert write_refused(raised.value) and raised.value.filename == SHARED_MEMORY
    assert raised.value.strerror.startswith("No space left on device (the states are handed to the saving process")
    assert "distributed.async_checkpointer=thread" in raised.value.strerror

