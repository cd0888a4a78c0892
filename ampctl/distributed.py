"""Data parallelism under torchrun, on PyTorch's own engine: DistributedDataParallel over a process group
(nccl on CUDA, gloo on CPU). One process per device; torchrun sets RANK, WORLD_SIZE and LOCAL_RANK.

What the loop needs from it is small, so that the step has no distributed branches: the model to run the
forward on (the DDP wrapper), a context that turns gradient all-reduce off for all but the last micro-batch
(no_sync), the mean of the recorded loss over ranks, and agreement on host-side decisions (stop on a signal).
The loss scaler needs nothing: DDP's all-reduce makes every rank's gradients equal, so an inf on any rank is
an inf on all, and every rank takes the same skip decision.

Each rank's data: the recipe is built for the global batch (recipe.batch_size x world size) and each rank
keeps its own slice of every batch, so that N ranks of batch B see exactly what one process of batch N*B
sees. Every rank draws the global batch; for recipes whose data is generated or held in memory that costs
little next to the step.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Any, ContextManager, Iterator

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ampctl.errors import UsageError

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def is_main_process() -> bool:
    """Rank 0, or no torchrun: before any process group exists (the command line, Hydra's run dir)."""
    return int(os.environ.get("RANK", "0")) == 0


# Ranks other than 0 write nothing of their own: no Hydra run dir, .hydra files or log (they record into
# rank 0's run dir, which they learn from rank 0 once the process group is up).
NON_MAIN_HYDRA_OVERRIDES = ["hydra.output_subdir=null", "hydra/job_logging=disabled",
                            "hydra/hydra_logging=disabled", "hydra.run.dir=."]


def torchrun_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_device(device: torch.device, kind: str) -> torch.device:
    """Under torchrun with DDP on CUDA, each process owns the GPU of its local rank."""
    if kind == "ddp" and device.type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def check(cfg: DictConfig) -> None:
    """Refuse a distributed choice that does not match how the process was started."""
    kind = cfg.distributed.kind.value
    if kind == "none" and torchrun_world_size() > 1:
        raise UsageError(f"this process is one of {torchrun_world_size()} started by torchrun, but distributed=none: "
                         "add distributed=ddp")
    if kind != "none":
        missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
        if missing:
            raise UsageError(f"distributed={kind} runs under torchrun (no {', '.join(missing)} here): "
                             f"torchrun --nproc_per_node=N -m ampctl train distributed={kind} ...")


class SingleProcess:
    """No parallelism: every hook is the identity."""

    rank = 0
    world_size = 1
    is_main = True

    def wrap(self, model: nn.Module) -> None:
        pass

    def training_model(self, model: nn.Module) -> nn.Module:
        return model

    def main_value(self, value: Any) -> Any:
        """Rank 0's value of a picklable object, on every rank."""
        return value

    def grad_sync(self, last_micro_batch: bool) -> ContextManager:
        return contextlib.nullcontext()

    def mean_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def agree(self, flag: bool) -> bool:
        return flag

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


class DataParallel(SingleProcess):
    def __init__(self, device: torch.device, timeout_s: int) -> None:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        self.device, self.backend = device, backend
        self._ddp: nn.Module | None = None

    def wrap(self, model: nn.Module) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self._ddp = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def training_model(self, model: nn.Module) -> nn.Module:
        assert self._ddp is not None, "wrap() the model first"
        return self._ddp

    def main_value(self, value: Any) -> Any:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def grad_sync(self, last_micro_batch: bool) -> ContextManager:
        # Only the last micro-batch all-reduces: the others accumulate locally.
        return contextlib.nullcontext() if last_micro_batch else self._ddp.no_sync()  # type: ignore[union-attr]

    def mean_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Average over ranks in place, on the device: a collective, not a host sync."""
        dist.all_reduce(tensor)
        return tensor.div_(self.world_size)

    def agree(self, flag: bool) -> bool:
        """True on every rank if it is true on any: host-side decisions every rank must take together."""
        value = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def start(cfg: DictConfig, device: torch.device) -> SingleProcess:
    if cfg.distributed.kind.value == "none":
        return SingleProcess()
    return DataParallel(device, cfg.distributed.timeout_s)


def global_recipe_config(recipe_cfg: DictConfig, world_size: int) -> DictConfig:
    """The recipe config whose batch is the global batch of world_size ranks."""
    if world_size == 1:
        return recipe_cfg
    batch_size = recipe_cfg.get("batch_size")
    if not isinstance(batch_size, int):
        raise UsageError("distributed=ddp splits the recipe's batches over the ranks: the recipe needs an integer "
                         "recipe.batch_size")
    data = OmegaConf.to_container(recipe_cfg, resolve=True)
    data["batch_size"] = batch_size * world_size
    return OmegaConf.create(data)


class RankShard:
    """A recipe built for the global batch, seen by one rank: its slice of every batch, its share of the
    samples and tokens. Everything else is the recipe's own."""

    def __init__(self, recipe: Any, rank: int, world_size: int) -> None:
        self._recipe, self._rank, self._world = recipe, rank, world_size
        self.samples_per_batch = recipe.samples_per_batch // world_size
        tokens = recipe.tokens_per_batch
        self.tokens_per_batch = None if tokens is None else tokens // world_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._recipe, name)

    def batches(self, device: torch.device, seed: int) -> Iterator[Any]:
        for batch in self._recipe.batches(device, seed):
            yield _slice(batch, self._rank, self._world)


def _slice(batch: Any, rank: int, world_size: int) -> Any:
    if isinstance(batch, torch.Tensor):
        per_rank = batch.shape[0] // world_size
        return batch[rank * per_rank:(rank + 1) * per_rank]
    if isinstance(batch, (tuple, list)):
        return type(batch)(_slice(b, rank, world_size) for b in batch)
    if isinstance(batch, dict):
        return {k: _slice(v, rank, world_size) for k, v in batch.items()}
    return batch
