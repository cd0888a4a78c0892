"""Data parallelism under torchrun, on PyTorch's own engine: DistributedDataParallel or FSDP2 (fully_shard)
over a process group (nccl on CUDA, gloo on CPU). One process per device; torchrun sets RANK, WORLD_SIZE and LOCAL_RANK.

What the loop needs from it is small, so that the step has no distributed branches: the model to run the
forward on (the DDP wrapper), a context that turns gradient all-reduce off for all but the last micro-batch
(no_sync), the mean of the recorded loss over ranks, and agreement on host-side decisions (stop on a signal).
The loss scaler: DDP's all-reduce makes every rank's gradients equal, so an inf on any rank is an inf on all
and every rank takes the same skip decision; under FSDP each rank holds a shard of the gradients, so the
scaler all-reduces its found-inf (shards_gradients).

Each rank's data: the recipe is built for the global batch (recipe.batch_size x world size) and each rank
keeps its own slice of every batch, so that N ranks of batch B see exactly what one process of batch N*B
sees. Every rank draws the global batch; for recipes whose data is generated or held in memory that costs
little next to the step.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from typing import Any, ContextManager, Iterator

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn

from ampctl import io
from ampctl.conf.schema import CheckpointFormat, ParallelKind
from ampctl.engine.precision import converters
from ampctl.errors import UsageError
from ampctl.processes import torchrun_world_size
from ampctl.recipes.base import starts_anywhere

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def local_device(device: torch.device, kind: ParallelKind) -> torch.device:
    """Under torchrun on CUDA, each process owns the GPU of its local rank."""
    if kind is not ParallelKind.none and device.type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def check(cfg: DictConfig) -> None:
    """Refuse a distributed choice that does not match how the process was started."""
    kind = cfg.distributed.kind
    if kind is ParallelKind.none and torchrun_world_size() > 1:
        raise UsageError(f"this process is one of {torchrun_world_size()} started by torchrun, but distributed=none: "
                         "add distributed=ddp")
    if kind is ParallelKind.fsdp and cfg.precision.cast_model:
        raise UsageError(f"distributed=fsdp with precision={cfg.precision.name}: FSDP2 keeps fp32 sharded "
                         "parameters and casts them for compute (its MixedPrecisionPolicy is O2 for sharded "
                         "training); use precision=bf16 or fp16 (or fp32, tf32)")
    if (kind is ParallelKind.fsdp and cfg.precision.converter is not None
            and not converters.converter_class(cfg.precision.converter).shards_with_fsdp):
        raise UsageError(f"distributed=fsdp with precision={cfg.precision.name} is not supported: ampctl does not "
                         "yet shard its converted layers (or all-gather their weights in their format); use "
                         "distributed=ddp")
    if cfg.distributed.checkpoint_format is CheckpointFormat.sharded and cfg.precision.master_weights:
        raise UsageError(f"distributed.checkpoint_format=sharded with precision={cfg.precision.name}: a sharded "
                         "checkpoint holds the model's parameters and their optimizer state by name, and the fp32 "
                         "master weights the optimizer steps on are not the model's; use "
                         "distributed.checkpoint_format=full")


class Parallel:
    """The parallelism interface, and its no-op implementation (one process): every hook is the identity.
    DDPParallel and FSDP2Parallel implement it under torchrun; the loop calls the same hooks whatever runs."""

    rank = 0
    world_size = 1
    is_main = True
    shards_gradients = False  # each rank holds only a shard of the gradients (found-inf must be agreed)

    def describe(self) -> str:
        return ""

    def wrap(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        pass

    def full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """Model and optimizer state dicts, whole (not sharded): what a checkpoint holds."""
        return model.state_dict(), optimizer.state_dict()

    def load_full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                        optimizer_state: dict) -> None:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)

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


def init_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """torch's env:// process group, its store's keys under torchrun's attempt number. torchrun's agent keeps one
    store across `--max-restarts`, and a restarted group read the failed attempt's addresses from it: gloo's
    connect was refused or hung until the timeout (seen with torch 2.14, a plain script included). Each attempt's
    keys are its own here, as the agent's own rendezvous keeps them."""
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"ampctl/attempt_{attempt}", store), rank=rank,
                            world_size=world_size, timeout=timeout)


class DDPParallel(Parallel):
    """DistributedDataParallel: every rank holds the whole model; gradients are all-reduced in backward."""

    def __init__(self, device: torch.device, timeout_s: int) -> None:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        init_process_group(backend, datetime.timedelta(seconds=timeout_s))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        self.device, self.backend = device, backend
        self._ddp: nn.Module | None = None
        self._model: nn.Module | None = None

    def describe(self) -> str:
        return f"ddp over {self.world_size} ranks ({self.backend})"

    def wrap(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        self._ddp = DistributedDataParallel(model, device_ids=device_ids)

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
        self._ddp = self._model = None
        if dist.is_initialized():
            dist.destroy_process_group()
        # The run's model, optimizer and hooks hold the group's C++ backend (and its worker threads) through
        # reference cycles. Collect them now, while the interpreter is whole: a backend destroyed during
        # interpreter shutdown can abort the process ("terminate called without an active exception").
        gc.collect()


class FSDP2Parallel(DDPParallel):
    """FSDP2: fully_shard on each recipe block, then on the root. Parameters stay fp32 and sharded (the
    optimizer steps on them: they are the master weights); the MixedPrecisionPolicy gathers them in the
    compute dtype and reduces gradients in fp32."""

    shards_gradients = True

    def __init__(self, device: torch.device, timeout_s: int, param_dtype: torch.dtype | None,
                 reshard_after_forward: bool) -> None:
        super().__init__(device, timeout_s)
        self._param_dtype, self._reshard = param_dtype, reshard_after_forward

    def describe(self) -> str:
        param = "float32" if self._param_dtype is None else str(self._param_dtype).removeprefix("torch.")
        return (f"fsdp over {self.world_size} ranks ({self.backend}): param_dtype={param} reduce_dtype=float32, "
                f"reshard_after_forward={self._reshard}")

    def wrap(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        fully_shard, policy_class = _fsdp2()
        policy = policy_class(param_dtype=self._param_dtype, reduce_dtype=torch.float32)
        for block in blocks:
            fully_shard(block, mp_policy=policy, reshard_after_forward=self._reshard)
        fully_shard(model, mp_policy=policy, reshard_after_forward=self._reshard)
        self._model = model

    def training_model(self, model: nn.Module) -> nn.Module:
        return model  # fully_shard changed the model in place

    @contextlib.contextmanager
    def _gradient_sync(self, enabled: bool) -> Iterator[None]:
        assert self._model is not None, "wrap() the model first"
        self._model.set_requires_gradient_sync(enabled)  # off: accumulate unsharded, reduce-scatter later
        yield

    def grad_sync(self, last_micro_batch: bool) -> ContextManager:
        return self._gradient_sync(last_micro_batch)

    def full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        # A collective: every rank calls it; rank 0 gets the whole state on the CPU, the others nothing.
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_state_dict,
        )

        return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                        optimizer_state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_state_dict,
        )

        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                       options=StateDictOptions(full_state_dict=True))


def _fsdp2():
    """fully_shard and MixedPrecisionPolicy: public in torch >= 2.6, under _composable before."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard  # type: ignore
    return fully_shard, MixedPrecisionPolicy


def start(cfg: DictConfig, device: torch.device, compute_dtype: torch.dtype | None = None) -> Parallel:
    """The parallelism of this process. compute_dtype: the precision mode's half dtype, if it has one."""
    kind = cfg.distributed.kind
    if kind is ParallelKind.none:
        return Parallel()
    if kind is ParallelKind.ddp:
        return DDPParallel(device, cfg.distributed.timeout_s)
    return FSDP2Parallel(device, cfg.distributed.timeout_s, compute_dtype, cfg.distributed.reshard_after_forward)


def global_recipe_config(recipe_cfg: DictConfig, world_size: int, kind: ParallelKind) -> DictConfig:
    """The recipe config whose batch is the global batch of world_size ranks (kind: ddp or fsdp, for messages)."""
    if world_size == 1:
        return recipe_cfg
    batch_size = recipe_cfg.get("batch_size")
    if not isinstance(batch_size, int):
        raise UsageError(f"distributed={kind.value} splits the recipe's batches over the ranks: the recipe needs an "
                         "integer recipe.batch_size")
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
        if starts_anywhere(recipe):  # its slices too (found through __getattr__, it would give whole batches)
            self.batches_from = self._sliced_from

    def __getattr__(self, name: str) -> Any:
        if name == "batches_from":  # set in __init__ when the recipe has one
            raise AttributeError(name)
        return getattr(self._recipe, name)

    def batches(self, device: torch.device, seed: int) -> Iterator[Any]:
        for batch in self._recipe.batches(device, seed):
            yield _slice(batch, self._rank, self._world)

    def _sliced_from(self, device: torch.device, seed: int, position: int) -> Iterator[Any]:
        for batch in self._recipe.batches_from(device, seed, position):
            yield _slice(batch, self._rank, self._world)


def unsharded(recipe: Any) -> Any:
    """The recipe a RankShard wraps (itself when it is none)."""
    return recipe._recipe if isinstance(recipe, RankShard) else recipe


def _slice(batch: Any, rank: int, world_size: int) -> Any:
    """This rank's share of every tensor in the batch, along the first dimension."""
    def share(t: torch.Tensor) -> torch.Tensor:
        per_rank = t.shape[0] // world_size
        return t[rank * per_rank:(rank + 1) * per_rank]

    return io.map_tensors(batch, share)
