"""`ampctl export` of a sharded (DCP) checkpoint through DCP's own HuggingFace writer: HuggingFace's sharded
layout (model-K-of-N.safetensors, each under export.max_file_mb, and its index), read back by safetensors and
compared tensor for tensor with the export of the same run's whole checkpoint, from one process and from two torchrun
ranks that each read and write only their row block of every tensor (consolidated by rank 0, or left as DCP's
parts, which DCP's HuggingFaceStorageReader reads back)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.in_process import run_ampctl
from tests.support.runs import torchrun

REPO = Path(__file__).resolve().parents[2]
# a GPT: its embedding and output weights are one tensor (tied), and its rows do not split evenly over 2 ranks
# for every tensor (LayerNorm's 64, the position table's 128 rows); EMA for export.weights=ema
RUN = ["device=cpu", "recipe=gpt", "recipe.n_layers=2", "recipe.d_model=64", "recipe.batch_size=4",
       "precision=bf16", "train.steps=2", "train.checkpoint.every=2", "train.ema.decay=0.9",
       "telemetry.profile_cpu_memory=false", "train.console=quiet"]


def read_export(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export, read as safetensors reads it: through the index where there is one."""
    index = out / "model.safetensors.index.json"
    if not index.exists():
        return load_file(out / "model.safetensors")
    weight_map = json.loads(index.read_text())["weight_map"]
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(weight_map.values())):
        tensors.update(load_file(out / name))
    assert sorted(tensors) == sorted(weight_map)  # each tensor where the index says, and nothing more
    return tensors


def export_of(run_dir: Path, *args: str) -> Path:
    result = run_ampctl("export", str(run_dir), *args)
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.strip().splitlines()[-1].rsplit(" to ", 1)[1])


def torchrun_export(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "ampctl", "export", str(run_dir), *args],
                          capture_output=True, text=True, timeout=300, cwd=run_dir.parent, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One run twice, its checkpoint whole (step_N.pt) and sharded (step_N.dcp, one process)."""
    root = tmp_path_factory.mktemp("export_sharded")
    for fmt in ("full", "sharded"):
        result = run_ampctl("train", *RUN, f"distributed.checkpoint_format={fmt}", f"hydra.run.dir={root / fmt}")
        assert result.returncode == 0, result.stderr
    return {fmt: root / fmt for fmt in ("full", "sharded")}


@pytest.mark.parametrize("weights,dtype", [("model", "float32"), ("ema", "bfloat16")])
def test_one_process_writes_the_sharded_layout_equal_to_the_whole_checkpoints_export(runs, tmp_path, weights, dtype):
    whole = read_export(export_of(runs["full"], f"export.weights={weights}", f"export.dtype={dtype}",
                                  f"export.dir={tmp_path / 'whole'}"))
    out = export_of(runs["sharded"], f"export.weights={weights}", f"export.dtype={dtype}", "export.max_file_mb=0.1",
                    f"export.dir={tmp_path / 'sharded'}")
    files = sorted(p.name for p in out.iterdir())
    assert len(files) > 3 and files[0] == "export.json" and files[-1] == "model.safetensors.index.json"
    assert all(p.stat().st_size <= 0.1 * 2**20 + 2**16 or len(load_file(p)) == 1  # a file over it holds one tensor
               for p in out.glob("model-*.safetensors"))
    tensors = read_export(out)
    # the tied output weight once, under the embedding's name (as transformers keeps it); the whole export's
    # save_model keeps the other name of the same tensor
    assert "wte.weight" in tensors and "lm_head.weight" not in tensors
    renamed = {("wte.weight" if name == "lm_head.weight" else name): t for name, t in whole.items()}
    assert sorted(renamed) == sorted(tensors)
    assert all(tensors[name].dtype == getattr(torch, dtype) and torch.equal(tensors[name], renamed[name])
               for name in tensors)
    record = json.loads((out / "export.json").read_text())
    # the GPT has no buffers: its parameters are the tensors written, the tied one once
    assert record["files"] == [f for f in files if f != "export.json"]
    assert record["parameters"] == sum(t.numel() for t in tensors.values())


@pytest.mark.slow
def test_two_ranks_each_write_their_rows_and_rank_0_consolidates_them(runs, tmp_path):
    fsdp = tmp_path / "fsdp"
    trained = torchrun(fsdp, *RUN, "distributed=fsdp")  # sharded over 2 ranks: each rank wrote its shard
    assert trained.returncode == 0, trained.stderr
    one_process = read_export(export_of(fsdp, "export.dtype=bfloat16", f"export.dir={tmp_path / 'one'}"))

    result = torchrun_export(fsdp, "export.dtype=bfloat16", "export.max_file_mb=0.05", f"export.dir={tmp_path / 'two'}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("exported ") == 1 and "2 ranks" in result.stdout, result.stdout  # said once
    out = tmp_path / "two"
    assert not (out / "sharded").exists() and len(list(out.glob("model-*-of-*.safetensors"))) > 1
    tensors = read_export(out)
    assert sorted(tensors) == sorted(one_process)
    assert all(torch.equal(tensors[name], one_process[name]) for name in tensors)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".two.tmp")]  # nothing of the writing left

    parts = torchrun_export(fsdp, "export.dtype=bfloat16", "export.consolidate=false",
                            f"export.dir={tmp_path / 'parts'}")
    assert parts.returncode == 0, parts.stderr
    written = sorted(p.name for p in (tmp_path / "parts").iterdir())
    assert "shard-00001-model-00001-of-00001.safetensors" in written
    assert "shard-00002-model-00001-of-00001.safetensors" in written
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    read_back = {name: torch.empty_like(t) for name, t in one_process.items()}
    dcp.load(read_back, storage_reader=HuggingFaceStorageReader(str(tmp_path / "parts")), no_dist=True)
    assert all(torch.equal(read_back[name], one_process[name]) for name in one_process)


def test_refused_in_one_line_with_nothing_written(runs, tmp_path):
    for args, expected in [
        (["export.max_file_mb=0"], "export.max_file_mb=0"),
        (["export.weights=ema", "export.consolidate=maybe"], "export.consolidate"),
    ]:
        result = run_ampctl("export", str(runs["sharded"]), *args, f"export.dir={tmp_path / 'out'}")
        assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
        assert expected in result.stderr and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_under_torchrun_a_whole_checkpoint_is_refused_on_every_rank(runs, tmp_path):
    result = torchrun_export(runs["full"], f"export.dir={tmp_path / 'out'}")
    assert result.returncode != 0
    # ampctl's one line first, from the node's first rank (what follows is torchrun's own report of its workers)
    assert result.stderr.startswith("ampctl export: error: ampctl export under torchrun is for a sharded checkpoint")
    assert result.stderr.count("ampctl export: error:") == 1, result.stderr
    assert not (tmp_path / "out").exists()
