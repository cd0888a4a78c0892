"""`ampctl export PATH`: the weights of a checkpoint ampctl wrote (a whole file or a DCP directory), in the dtype
they are served in, weights only: safetensors (`model.safetensors`, written by safetensors' own save_model, which
keeps one copy of tied weights), `model.pt` (torch.save of the state dict) or, for recipe=hf_causal_lm, a
directory transformers' `from_pretrained` loads (its own save_pretrained). A sharded checkpoint's safetensors export
goes through DCP instead, a part at a time and, under torchrun, a part per rank
(runner/checkpointing/export_sharded.py).

The weights are the ones the optimizer stepped on, at their full precision: O2's fp32 masters rather than their
half copies, the fp32 weight average (export.weights=ema) rather than the model, each rounded once to export.dtype.
The model is built from the checkpoint's own recipe config and the weights loaded into it strictly, so what is
written is what that model holds (a converter's extra state, FP8 scales, is left out: weights only).

The export owns its directory: it must not exist; it is written beside it and renamed into place whole, and a
failure leaves nothing (not even the exports/ folder it made). Nothing else is touched.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from omegaconf import OmegaConf
from torch import nn

from ampctl import io
from ampctl.conf.export_schema import ExportConfig, ExportFormat, ExportWeights
from ampctl.engine.parallel import Parallel
from ampctl.errors import UsageError, naming_refused_writes
from ampctl.runner.checkpointing import checkpoint, export_sharded
from ampctl.runner.checkpointing.checkpoint_files import (
    cached_sha256,
    is_checkpoint,
    is_sharded,
    list_checkpoints,
    run_dir_of,
)
from ampctl.runner.rank_zero import told_to_every_rank

EXPORTS = "exports"  # the folder of a run's exports, beside its checkpoints
RECORD = "export.json"  # what an export holds and where it came from
HF_RECIPE = "HFCausalLMRecipe"


@dataclass(frozen=True)
class Exported:
    path: Path
    source: Path
    step: int
    parameters: int
    bytes: int
    is_main: bool = True  # this process is the export's rank 0 (under torchrun, the one that says it)


def find_checkpoint(path: Path, key: str = "PATH") -> Path:
    """A checkpoint as given (a file, a DCP directory, a best/ one); for a run directory its newest checkpoint that
    passes its check, newer ones that do not named. key: what the user called it (`PATH`, `diff.weights`)."""
    if is_checkpoint(path) or path.is_file():
        return path
    if not path.is_dir():
        raise UsageError(f"{key}={str(path)!r} does not exist; give a run directory or a checkpoint")
    found = list_checkpoints(path)
    if not found:
        raise UsageError(f"{key}={str(path)!r} holds no checkpoint (checkpoints/step_*.pt or .dcp); give a run "
                         "directory or a checkpoint")
    failures = []
    for candidate in reversed(found):
        try:
            checkpoint.verify(candidate)
            return candidate
        except UsageError as exc:
            failures.append(str(exc))
    raise UsageError(f"{key}={str(path)!r}: no checkpoint passes its check: {'; '.join(failures)}")


@dataclass
class SavedWeights:
    """A checkpoint's weights in fp32, by the names the recipe's model gives them (`ampctl diff` at a run's weights)."""

    state: dict[str, torch.Tensor]
    recipe: dict[str, Any]  # the run's recipe config, resolved
    step: int
    source: Path


def saved_weights(path: Path, key: str = "PATH") -> SavedWeights:
    """The weights of a checkpoint, or of a run directory's newest checkpoint that passes its check: the model's
    own in fp32, O2's fp32 masters where the model's are their half copies. key: what the user called the path."""
    source = find_checkpoint(path, key).resolve()
    payload = checkpoint.load(source, mmap=True)
    cfg = OmegaConf.create(payload["config"])
    model_state, _ = _saved_weights(source, payload, False)
    model = _model_holding(cfg, model_state, None, payload.get("weights", {}).get("masters"))
    recipe = OmegaConf.to_container(cfg.recipe, resolve=True)
    return SavedWeights(model.float().state_dict(), recipe, payload["step"], source)


def destination(source: Path, step: int, options: ExportConfig) -> Path:
    if options.dir is not None:
        return Path(options.dir).expanduser()
    suffix = "-hf" if options.format is ExportFormat.hf else ""
    return run_dir_of(source) / EXPORTS / f"step_{step:08d}-{options.weights.value}-{options.dtype.value}{suffix}"


PRUNED_TRIES = 3  # a run that checkpoints every step prunes its newest-but-keep as fast as an export picks one


def export(path: Path, options: ExportConfig, say: Callable[[str], None] = print) -> Exported:
    """The newest good checkpoint of a run directory (or the checkpoint given), exported. A run still training may
    prune the checkpoint chosen while it is read (train.checkpoint.keep): the export then takes the newest again, a
    few times, and otherwise says so in one line; what it wrote is removed either way."""
    for attempt in itertools.count(1):
        source = find_checkpoint(path).resolve()
        try:
            return _export(source, options, say)
        except (OSError, UsageError) as exc:
            if source.exists() or (isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError)):
                raise  # not a checkpoint that went away
            if is_checkpoint(path) or path.is_file() or attempt == PRUNED_TRIES:
                raise UsageError(f"{source} was removed while it was read ({attempt} "
                                 f"{'try' if attempt == 1 else 'tries'}): its run prunes its older checkpoints "
                                 "(train.checkpoint.keep); export a checkpoint the run keeps (checkpoints/best/...), "
                                 "or once it has stopped (nothing was written)") from None
            say(f"{source.name} was pruned by its run while it was read; taking the newest again")


def _export(source: Path, options: ExportConfig, say: Callable[[str], None]) -> Exported:
    payload = checkpoint.load(source, mmap=True)
    step = payload["step"]
    out = destination(source, step, options)
    cfg = OmegaConf.create(payload["config"])
    target = str(cfg.recipe.get("_target_", ""))
    through_dcp = is_sharded(source) and options.format is ExportFormat.safetensors
    ranks = export_sharded.ranks_of_this_job() if through_dcp else _one_process()
    record = {
        "source": str(source), "source_sha256": _sha256_of(source), "step": step,
        "run_id": payload.get("run_id"), "weights": options.weights.value, "dtype": options.dtype.value,
        "format": options.format.value,
        "recipe": OmegaConf.to_container(cfg.recipe, resolve=True),
        "trained_in": cfg.precision.name,
    }
    try:  # a refusal too ends the ranks' process group
        if out.exists():
            raise UsageError(f"export.dir={out} exists already; choose another export.dir (nothing was written)")
        if options.format is ExportFormat.hf and not target.endswith(HF_RECIPE):
            raise UsageError(f"export.format=hf is for recipe=hf_causal_lm (a transformers model); this run's recipe "
                             f"is {target}: choose export.format=safetensors or pt")
        if through_dcp:
            write_files, parameters = _through_dcp(source, cfg, options, ranks)
        else:
            write_files, parameters = _through_one_model(source, payload, cfg, options, record)
        ranks.barrier()  # every rank checked the export's directory absent before rank 0 claims it
        if ranks.is_main:
            say(f"exporting step {step} of {source} ({options.weights.value} weights as {options.dtype.value}, "
                f"{options.format.value}{f', {ranks.world_size} ranks' if ranks.world_size > 1 else ''})")
        record["parameters"] = parameters
        written = _write(out, record, write_files, ranks)
    finally:
        ranks.close()
    return Exported(out, source, step, parameters, written, ranks.is_main)


def _one_process() -> Parallel:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("ampctl export under torchrun is for a sharded checkpoint (a .dcp directory) as "
                         "export.format=safetensors, each rank writing its part; run this export as one process")
    return Parallel()


def _through_one_model(source: Path, payload: dict[str, Any], cfg: Any, options: ExportConfig,
                       record: dict[str, Any]) -> tuple[Callable[[Path], None], int]:
    """The recipe's model holding the checkpoint's weights, in export.dtype; what writes it into a directory."""
    ema = options.weights is ExportWeights.ema
    model_state, average = _saved_weights(source, payload, ema)
    if ema and average is None:
        raise UsageError(f"export.weights=ema: {source} holds no weight average (the run was trained without "
                         "train.ema.decay); choose export.weights=model")
    model = _model_holding(cfg, model_state, average if ema else None,
                           payload.get("weights", {}).get("masters"))
    model.to(getattr(torch, options.dtype.value))
    return (lambda tmp: _write_model(model, tmp, options, record)), sum(p.numel() for p in model.parameters())


def _through_dcp(source: Path, cfg: Any, options: ExportConfig, ranks: Parallel
                 ) -> tuple[Callable[[Path], None], int]:
    """A sharded checkpoint read and written a part at a time by DCP (runner/checkpointing/export_sharded.py), its
    names checked
    against the recipe's model built on the meta device (no memory)."""
    from ampctl.recipes.base import build_recipe, building_model

    recipe = build_recipe(cfg.recipe)
    with building_model(recipe), torch.device("meta"):
        model = recipe.build_model()
    sources = export_sharded.sources_of(source, export_sharded.names_to_export(model), options.weights)
    return (lambda tmp: export_sharded.write(source, sources, tmp, options, ranks)), \
        sum(p.numel() for p in model.parameters())


def _saved_weights(source: Path, payload: dict[str, Any], with_average: bool
                   ) -> tuple[dict[str, torch.Tensor], Optional[dict[str, torch.Tensor]]]:
    """The model's state dict and the weight average (None without one), from a file or a DCP directory."""
    if not is_sharded(source):
        return payload["model"], payload.get("ema")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    # tensors to load into, shaped as DCP's metadata records them ("model.<name>", "ema.<name>")
    wanted = ("model", "ema") if with_average else ("model",)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, meta in dcp.FileSystemReader(str(source)).read_metadata().state_dict_metadata.items():
        part, _, name = key.partition(".")
        if part in wanted and isinstance(meta, TensorStorageMetadata):
            state.setdefault(part, {})[name] = torch.empty(meta.size, dtype=meta.properties.dtype)
    dcp.load(state, checkpoint_id=str(source), no_dist=True)
    return state["model"], state.get("ema")


def _model_holding(cfg: Any, model_state: dict[str, torch.Tensor], average: Optional[dict[str, torch.Tensor]],
                   masters: Optional[list[torch.Tensor]]) -> nn.Module:
    """The recipe's model (fp32, on the CPU) holding the checkpoint's weights: the average's where given, else
    O2's fp32 masters where the model's own weights are their half copies."""
    from ampctl.recipes.base import build_recipe, building_model

    recipe = build_recipe(cfg.recipe)
    with building_model(recipe):
        model = recipe.build_model()
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]  # a tied weight once
    state = dict(model_state)
    if average is not None:
        state.update(average)
    elif masters:
        half = [name for name in trainable if name in state and state[name].dtype != torch.float32]
        if len(half) != len(masters):
            raise UsageError(f"the checkpoint holds {len(masters)} fp32 master weights for {len(half)} half weights of "
                             f"the recipe's model: it was not written for this recipe's model")
        state.update(zip(half, masters))
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - \
        {name for name, _ in model.named_parameters()}  # the second name of a tied weight: loaded once, as the first
    own = [name for name in model.state_dict() if name not in aliases]
    missing = [name for name in own if name not in state]
    if missing:
        named = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise UsageError(f"the checkpoint lacks {len(missing)} of the recipe's model's tensors ({named}): it was not "
                         "written for this recipe's model")
    model.load_state_dict({name: state[name] for name in own}, strict=False)
    return model


def _write_model(model: nn.Module, tmp: Path, options: ExportConfig, record: dict[str, Any]) -> None:
    if options.format is ExportFormat.safetensors:
        from safetensors.torch import save_model

        save_model(model, str(tmp / "model.safetensors"), metadata={
            "format": "pt", **{f"ampctl_{k}": str(record[k]) for k in ("step", "weights", "dtype", "source")}})
    elif options.format is ExportFormat.pt:
        with open(tmp / "model.pt", "wb") as file:  # a Python file: a full disk is its OSError
            torch.save(model.state_dict(), file)
    else:
        model.save_pretrained(tmp, safe_serialization=True)


def _write(out: Path, record: dict[str, Any], write_files: Callable[[Path], None], ranks: Parallel) -> int:
    """The export into a directory beside out (every rank its part), renamed into place whole by rank 0 with its
    record; its bytes. Nothing is left on failure, on any rank's."""
    made = [parent for parent in reversed(out.parents) if not parent.exists()]
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")

    def claim() -> None:
        out.mkdir(parents=True)  # claimed: an export that appears meanwhile is not replaced
        tmp.mkdir()

    try:
        told_to_every_rank(ranks, "claiming the export's directory", claim)
        tmp = ranks.main_value(tmp)  # rank 0's name for it
        with naming_refused_writes(out):  # safetensors' and torch's writers carry a full disk inside their errors
            write_files(tmp)
        told_to_every_rank(ranks, "finishing the export", lambda: _finish(tmp, out, record))
    except BaseException:
        if ranks.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            if out.is_dir() and not any(out.iterdir()):
                out.rmdir()
            for parent in reversed(made):
                if parent.is_dir() and not any(parent.iterdir()):
                    parent.rmdir()
        raise
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


def _finish(tmp: Path, out: Path, record: dict[str, Any]) -> None:
    """Rank 0, every part written: the record of what the export holds, then the rename into place."""
    record["files"] = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    with naming_refused_writes(out):
        io.atomic_write_text(tmp / RECORD, json.dumps(record, indent=2) + "\n")
    os.replace(tmp, out)  # over the empty directory claimed above


def _sha256_of(source: Path) -> Optional[str]:
    return None if is_sharded(source) else cached_sha256(source)
