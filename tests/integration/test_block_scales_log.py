"""telemetry.blocks_every: every N steps, per block-scaled layer and operand, its block scales' figures in
blocks.jsonl, every tracker and `ampctl report`'s heatmap; the figures against the quantizer's own definitions and
a hand count, and a resumed run's rows equal to the uninterrupted one's."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from ampctl import run_files
from ampctl.analysis.block_scales import BlocksLog
from ampctl.cli import main
from ampctl.engine.precision.block_quantize import BLOCK_STATS, block_stats, fake_quantize
from ampctl.engine.precision.mx_emulated import MXEmulatedConverter, MXEmulatedOptions, MXFormat, block_formats
from ampctl.runner.trackers.base import block_scale_values

RUN = ["device=cpu", "recipe=mlp", "recipe.hidden=40", "recipe.batch_size=24", "precision=nvfp4_recipe",
       "train.steps=4", "train.grad_accum_steps=2", "train.checkpoint.every=2", "telemetry.blocks_every=2",
       "train.console=quiet", "telemetry.profile_cpu_memory=false", "logger=csv"]


def by_hand(matrix: torch.Tensor, fmt) -> dict[str, float]:
    """block_stats' figures of a 1D NVFP4 quantization, block by block in Python."""
    x = matrix.double()
    q = fake_quantize(matrix, fmt).double()
    tensor_scale = float(matrix.abs().max()) / (448.0 * 6.0)
    blocks = clipped = raised = 0
    headroom = math.inf
    for row in x:
        for start in range(0, len(row), 16):
            amax = float(row[start:start + 16].abs().max())
            raw = amax / 6.0 / tensor_scale
            blocks += 1
            clipped += raw > 464.0
            raised += 0 < amax and raw < 2.0**-6
            headroom = min(headroom, math.log2(448.0 / raw)) if raw > 0 else headroom
    return {"values": x.numel(), "flushed": int(((x != 0) & (q == 0)).sum()), "blocks": blocks,
            "scale_saturated": clipped, "scale_underflow": raised, "error_sq": float((q - x).square().sum()),
            "value_sq": float(x.square().sum()), "scale_headroom_log2": headroom}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_block_stats_are_the_quantizations_figures_counted_by_hand(dtype):
    """In every dtype an operand arrives in (a rule's nvfp4 layer under bf16 or fp16 autocast): the figures of the
    values as that dtype holds them."""
    torch.manual_seed(0)
    fmt = block_formats(MXEmulatedOptions(MXFormat.nvfp4), "nvfp4")[0]
    scale = torch.logspace(-12 if dtype != torch.float16 else -6, 2, 64)  # far below the per-tensor scale: raised
    x = (torch.randn(12, 64) * scale).to(dtype)
    x[3, :16] = 0.0  # an all-zero block is not raised
    ours = dict(zip(BLOCK_STATS, block_stats(x, fmt).tolist()))
    hand = by_hand(x.float(), fmt)
    assert ours["scale_underflow"] > 0 and ours["flushed"] > 0
    for name, value in hand.items():
        assert ours[name] == pytest.approx(value, rel=1e-9, abs=1e-300), name


def test_the_log_sums_a_steps_micro_batches_and_records_only_its_steps(tmp_path):
    torch.manual_seed(0)
    converter = MXEmulatedConverter(MXEmulatedOptions(MXFormat.nvfp4), torch.device("cpu"))
    layer = converter.convert(nn.Linear(32, 48), "fc", "nvfp4")
    model = nn.Sequential(layer)
    written: list[dict] = []
    log = BlocksLog(model, 2, tmp_path / "blocks.jsonl", written.append)
    inputs = [torch.randn(5, 32), torch.randn(7, 32) * 100]
    for step in (1, 2):
        with log.around(step):
            for x in inputs:
                model(x).sum().backward()
    assert [row["step"] for row in written] == [2] and not layer.observers  # step 1 unobserved, observers gone
    fmt = layer.forward_format
    expected = sum(block_stats(x, fmt)[:-1] for x in inputs)
    recorded = written[0]["layers"]["0"]["activation"]
    assert recorded["values"] == int(expected[0]) and recorded["flushed"] == expected[2].item() / expected[0].item()
    assert recorded["error"] == pytest.approx(math.sqrt(expected[6].item() / expected[7].item()), rel=1e-12)
    assert json.loads((tmp_path / "blocks.jsonl").read_text()) == written[0]


def blocks_rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / run_files.BLOCKS).read_text().splitlines()]


def test_a_run_records_its_block_scales_to_its_trackers_and_report_and_a_resume_continues_them(tmp_path,
                                                                                                  restore_argv):
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    main(["train", *RUN, f"hydra.run.dir={whole}"])
    main(["train", *RUN, "train.steps=2", f"hydra.run.dir={halves}"])
    main(["train", *RUN, f"hydra.run.dir={halves}", "resume=auto"])
    rows = blocks_rows(whole)
    assert [row["step"] for row in rows] == [2, 4] and rows == blocks_rows(halves)
    layer = rows[0]["layers"]["0"]  # the MLP's first Linear
    assert layer["format"] == "nvfp4" and set(layer) == {"format", "activation", "weight", "gradient"}
    assert layer["weight"]["blocks"] == math.ceil(40 / 16) * math.ceil(layer["weight"]["values"] / 40 / 16)  # tiles
    with (whole / "metrics_blocks.csv").open(newline="") as f:
        table = list(csv.DictReader(f))
    expected = [block_scale_values(row) for row in rows]
    assert [{k: float(v) for k, v in r.items()} for r in table] == [{k: float(v) for k, v in e.items()}
                                                                     for e in expected]
    main(["report", str(whole)])
    assert (whole / "block_scales.png").stat().st_size > 10_000


def test_block_scales_on_a_mode_without_blocks_are_one_line(tmp_path, capsys, restore_argv):
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *RUN, "precision=bf16", f"hydra.run.dir={run_dir}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and not run_dir.exists()
    assert "telemetry.blocks_every=2 with precision=bf16: no layer computes in a block-scaled format" in err
