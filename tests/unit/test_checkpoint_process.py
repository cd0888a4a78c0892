"""The checkpointing process's hand-over (runner/checkpoint_process.py), in this process: the states copied into
shared memory, DCP's save of them and its failures as the training process raises them. Its processes, ranks and
FSDP's DTensors: tests/integration/test_sharded_checkpoints.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ampctl.errors import write_refused
from ampctl.runner import checkpoint_process
from ampctl.runner.checkpoint_process import SHARED_MEMORY, _raised, _saved, _staged


def test_the_states_are_copied_into_shared_memory_and_saved_as_they_were(tmp_path):
    model = {"w": torch.randn(4, 3), "b": torch.arange(3.0)}
    states = {"model": model, "optimizer": {"state": {0: {"step": torch.tensor(7.0)}}, "param_groups": [{"lr": 0.1}]}}
    staged = _staged(states)
    assert staged["model"]["w"].is_shared() and staged["model"]["w"].data_ptr() != model["w"].data_ptr()
    before = model["w"].clone()
    model["w"].add_(1)  # training goes on: the staged copy does not move with it
    assert torch.equal(staged["model"]["w"], before)
    assert _saved(staged, str(tmp_path / "step.dcp"), None) is None
    back = {"model": {"w": torch.empty(4, 3), "b": torch.empty(3)}}
    dcp.load(back, checkpoint_id=str(tmp_path / "step.dcp"), no_dist=True)
    assert torch.equal(back["model"]["w"], before) and torch.equal(back["model"]["b"], model["b"])


def test_a_refused_write_comes_back_as_the_oserror_it_was():
    answer = _saved({"w": torch.ones(3)}, "/sys/ampctl-test.dcp", None)  # a file system that refuses (as root too)
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
        checkpoint_process._shared_copy(torch.ones(2))
    assert write_refused(raised.value) and raised.value.filename == SHARED_MEMORY
    assert raised.value.strerror.startswith("No space left on device (the states are handed to the saving process")
    assert "distributed.async_checkpointer=thread" in raised.value.strerror


def test_the_next_save_copies_into_the_same_shared_memory_where_the_shapes_hold():
    first = _staged({"w": torch.ones(3), "b": torch.ones(2), "step": 1, "groups": [{"lr": 0.1}]})
    second = _staged({"w": torch.full((3,), 2.0), "b": torch.ones(4), "step": 2, "groups": [{"lr": 0.2}]}, first)
    assert second["w"].data_ptr() == first["w"].data_ptr() and torch.equal(second["w"], torch.full((3,), 2.0))
    assert second["b"].shape == (4,) and second["b"].is_shared()  # another shape: a new shared tensor
    assert second["step"] == 2 and second["groups"] == [{"lr": 0.2}]  # what is not a tensor is taken as it is now
