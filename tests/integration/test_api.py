"""The Python API (ampctl.train / compare / inspect / memory / export): the command line's configs, overrides and
checks, the result back as a value; a refusal is an exception with the command line's one line."""

from __future__ import annotations

import json

import pytest

import ampctl
from ampctl.errors import UsageError

MLP = ["device=cpu", "recipe=mlp", "recipe.hidden=32", "recipe.batch_size=16", "train.console=quiet",
       "telemetry.profile_cpu_memory=false"]


def test_train_returns_the_summary_and_the_run_directory(tmp_path):
    run = ampctl.train([*MLP, "precision=bf16", "train.steps=6"], run_dir=tmp_path / "run")
    assert run.run_dir == tmp_path / "run" and run.summary == json.loads((run.run_dir / "summary.json").read_text())
    assert run.summary["precision"] == "bf16" and run.summary["steps"] == 6 and run.summary["recipe"] == "mlp"
    rows = (run.run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 6 and (run.run_dir / ".hydra" / "overrides.yaml").is_file()


def test_a_bad_value_raises_the_command_lines_one_line_and_leaves_nothing(tmp_path):
    with pytest.raises(UsageError, match=r"^precision=fp61: no such precision \(did you mean fp16\?\)"):
        ampctl.train([*MLP, "precision=fp61"], run_dir=tmp_path / "bad")
    with pytest.raises(UsageError, match=r"^train.steps=0 is not allowed: expected an integer >= 1$"):
        ampctl.train([*MLP, "train.steps=0"], run_dir=tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_compare_and_inspect_return_their_records(tmp_path):
    table = ampctl.compare([*MLP, "train.steps=4", "compare.precisions=[fp32]", "compare.warmup_steps=1",
                            "compare.rounds=1"], out_dir=tmp_path / "compare")
    assert [(r["precision"], r["status"]) for r in table.summary["rows"]] == [("fp32", "ok")]
    ranges = ampctl.inspect([*MLP, "precision=fp16", "inspect.steps=2"], out_dir=tmp_path / "inspect")
    assert ranges.summary["kind"] == "inspect" and ranges.summary["rows"]
    assert (tmp_path / "inspect" / "gradient_ranges.png").is_file()


def test_export_returns_its_directory_and_record_and_refuses_as_the_command_line(tmp_path):
    run = ampctl.train([*MLP, "train.steps=3", "train.ema.decay=0.5"], run_dir=tmp_path / "run")
    served = ampctl.export(run.run_dir, ["export.dtype=bfloat16", "export.weights=ema"])
    assert served.run_dir == tmp_path / "run" / "exports" / "step_00000003-ema-bfloat16"
    assert served.summary == json.loads((served.run_dir / "export.json").read_text())
    assert (served.summary["step"], served.summary["files"]) == (3, ["model.safetensors"])
    with pytest.raises(UsageError, match=r"exists already; choose another export.dir \(nothing was written\)$"):
        ampctl.export(run.run_dir, ["export.dtype=bfloat16", "export.weights=ema"])
