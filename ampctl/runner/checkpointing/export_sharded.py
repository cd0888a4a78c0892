"""`ampctl export` of a sharded (DCP) checkpoint as safetensors: its weights read and written through DCP itself
(its loader and its HuggingFaceStorageWriter), so that no process ever holds more of the model than its own part.

In one process every tensor is read whole and written as it is read. Under torchrun
(`torchrun --nproc-per-node=N -m ampctl export RUN ...`) each of the N ranks reads a row block of every tensor
(DTensors sharded on their first dimension; DCP reshards from however many ranks trained), rounds it to
export.dtype and writes it; rank 0 then consolidates the blocks into whole tensors (export.consolidate=true, DCP's
own consolidation, a file at a time). What is written is HuggingFace's sharded layout in either case:
`model-0000K-of-0000N.safetensors`, each holding at most export.max_file_mb of tensors (transformers'
save_pretrained's 5 GB by default), and `model.safetensors.index.json` naming each tensor's file: what
transformers' from_pretrained and safetensors read. export.consolidate=false leaves each rank's blocks as DCP's
writer wrote them (`shard-R-model-K-of-N.safetensors`, their offsets in each file's metadata, no index), which DCP's
HuggingFaceStorageReader reads, for a consolidation elsewhere.

The names are the recipe's model's own (built on the meta device: no memory), a tied weight once under its first
name (the embedding's, as transformers keeps it), checked against the checkpoint before anything is written.
"""

from __future__ import annotations

import datetime
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ampctl.conf.export_schema import ExportConfig, ExportWeights
from ampctl.engine.parallel import Parallel, init_process_group
from ampctl.errors import UsageError

INDEX = "model.safetensors.index.json"  # HuggingFace's name for the map of a sharded safetensors directory
PARTS = "sharded"  # where DCP's writer puts each rank's blocks before consolidating them


class Ranks(Parallel):
    """The export's ranks under torchrun (gloo, on the CPU): what rank_zero.told_to_every_rank needs of them."""

    def __init__(self) -> None:
        if not dist.is_initialized():
            init_process_group("gloo", datetime.timedelta(minutes=30))  # a consolidation of a large model is long
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0

    def main_value(self, value: Any) -> Any:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        dist.destroy_process_group()


def ranks_of_this_job() -> Parallel:
    """Ranks() under torchrun with more than one process, else the one process (Parallel's no-op)."""
    return Ranks() if int(os.environ.get("WORLD_SIZE", "1")) > 1 else Parallel()


def names_to_export(model: nn.Module) -> list[str]:
    """The model's state dict's names, a tied weight once: under the first name it has (the module that owns it)."""
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - \
        {name for name, _ in model.named_parameters()}
    return [name for name in model.state_dict() if name not in aliases]


def sources_of(source: Path, names: list[str], weights: ExportWeights) -> dict[str, tuple[str, Any]]:
    """Each exported name -> (its key in the checkpoint, its storage metadata): the weight average's tensor where
    export.weights=ema holds one (its parameters), the model's otherwise (its buffers). UsageError when the
    checkpoint lacks a name or the average."""
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(source)).read_metadata().state_dict_metadata
    if weights is ExportWeights.ema and not any(key.startswith("ema.") for key in stored):
        raise UsageError(f"export.weights=ema: {source} holds no weight average (the run was trained without "
                         "train.ema.decay); choose export.weights=model")
    found: dict[str, tuple[str, Any]] = {}
    for name in names:
        keys = ([f"ema.{name}"] if weights is ExportWeights.ema else []) + [f"model.{name}"]
        key = next((k for k in keys if k in stored and hasattr(stored[k], "size")), None)
        if key is not None:
            found[name] = (key, stored[key])
    missing = [name for name in names if name not in found]
    if missing:
        named = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise UsageError(f"the checkpoint lacks {len(missing)} of the recipe's model's tensors ({named}): it was not "
                         "written for this recipe's model")
    return found


def file_of_each(sizes: dict[str, int], max_bytes: int) -> dict[str, int]:
    """name -> the number (from 1) of the file it goes to: in order, a new file when the next tensor would take the
    current one past max_bytes (a tensor larger than that alone in its file), as transformers shards."""
    files: dict[str, int] = {}
    number, filled = 1, 0
    for name, size in sizes.items():
        if filled and filled + size > max_bytes:
            number, filled = number + 1, 0
        files[name] = number
        filled += size
    return files


def write(source: Path, sources: dict[str, tuple[str, Any]], tmp: Path, options: ExportConfig,
          ranks: Parallel) -> None:
    """This rank's part of every tensor read from the checkpoint, rounded to export.dtype, written into tmp by DCP's
    HuggingFace writer (a collective under torchrun); rank 0 consolidates the parts where asked."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    distributed = ranks.world_size > 1
    mesh = _mesh_of_every_rank() if distributed else None
    stored = {key: _empty(meta, mesh) for key, meta in sources.values()}
    dcp.load(stored, checkpoint_id=str(source), no_dist=not distributed)
    dtype = getattr(torch, options.dtype.value)
    weights = {}
    for name, (key, _) in sources.items():
        tensor = stored.pop(key)  # one copy at a time beside the rounded one
        weights[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    itemsize = dtype.itemsize
    sizes = {name: meta.size.numel() * (itemsize if meta.properties.dtype.is_floating_point else
                                         meta.properties.dtype.itemsize) for name, (_, meta) in sources.items()}
    files = file_of_each(sizes, int(options.max_file_mb * 2**20))
    writer = HuggingFaceStorageWriter(str(tmp), fqn_to_index_mapping=files, save_distributed=distributed,
                                      enable_consolidation=distributed and options.consolidate)
    dcp.save(weights, storage_writer=writer, no_dist=not distributed)
    if distributed and options.consolidate and ranks.is_main:
        shutil.rmtree(tmp / PARTS)  # consolidated: the blocks are in the whole files now


def _mesh_of_every_rank() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _empty(meta: Any, mesh: Any) -> torch.Tensor:
    """A tensor for DCP to load into, shaped and typed as stored; on a mesh (torchrun) this rank's row block of it."""
    if mesh is None:
        return torch.empty(meta.size, dtype=meta.properties.dtype)
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import empty as sharded_empty

    placement = Shard(0) if len(meta.size) else Replicate()  # a scalar has no rows to split
    return sharded_empty(meta.size, dtype=meta.properties.dtype, device_mesh=mesh, placements=[placement])
