"""`ampctl inspect` end to end on the CPU: its table, files and plots, and bad input."""

from __future__ import annotations

import csv
import json
import re

import pytest
from PIL import Image

from ampctl.cli import main

GPT = ["device=cpu", "recipe=gpt", "recipe.d_model=32", "recipe.n_layers=2", "recipe.n_heads=2",
       "recipe.block_size=32", "recipe.batch_size=4", "recipe.max_corpus_bytes=100000", "inspect.steps=2"]
MLP = ["device=cpu", "recipe=mlp", "recipe.hidden=32", "recipe.batch_size=16", "inspect.steps=2"]


@pytest.mark.parametrize("args", [GPT, [*MLP, "precision=fp16", "scaler.init_scale=1024"]],
                         ids=["gpt-fp32", "mlp-fp16"])
def test_inspect_writes_its_table_and_plots(tmp_path, restore_argv, capsys, args):
    out = tmp_path / "inspect"
    main(["inspect", *args, f"hydra.run.dir={out}"])
    printed = capsys.readouterr().out
    assert "value ranges by tensor kind" in printed and "largest loss scale keeping every gradient" in printed
    # progress while it measures: a line per finished phase, with its seconds
    assert re.search(r"^    built the model, hooks on \d+ leaf modules \(\d+\.\d s\)$", printed, flags=re.MULTILINE)
    assert re.findall(r"^    recorded step (\d)/2 \(", printed, flags=re.MULTILINE) == ["1", "2"]
    rows = list(csv.DictReader((out / "ranges.csv").open()))
    kinds = {r["kind"] for r in rows}
    assert kinds == {"activation", "activation_grad", "weight_grad", "weight"}
    for r in rows:
        for fmt in ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2"):
            assert 0.0 <= float(r[f"{fmt}_to_zero"]) <= 1.0 and 0.0 <= float(r[f"{fmt}_overflow"]) <= 1.0
    data = json.loads((out / "ranges.json").read_text())
    if "scaler.init_scale=1024" in args:
        # the fp16 run scaled its loss by 1024 (its gradients were divided by it) and that scale is studied
        assert data["study_scale"] == 1024 and set(data["run_scales"]) <= {1024.0, 512.0, 2048.0}
    else:
        assert data["study_scale"] == 65536 and data["run_scales"] == [1.0, 1.0]
    for image in ("gradient_ranges.png", "underflow_heatmap.png"):
        with Image.open(out / image) as png:
            assert png.format == "PNG" and png.size[0] > 400


def test_gradients_are_recorded_as_true_values_whatever_the_loss_scale(tmp_path, restore_argv):
    """The same fp32 step with the loss scaled by 2^10 (static scaler) records the same gradients."""
    maxima = {}
    for name, extra in (("plain", []), ("scaled", ["scaler=static", "scaler.scale=1024"])):
        out = tmp_path / name
        main(["inspect", *MLP, "inspect.steps=1", *extra, f"hydra.run.dir={out}"])
        rows = list(csv.DictReader((out / "ranges.csv").open()))
        maxima[name] = {(r["layer"], r["kind"]): float(r["max_abs"]) for r in rows if r["kind"].endswith("_grad")}
    assert maxima["plain"] == pytest.approx(maxima["scaled"], rel=1e-6)


@pytest.mark.parametrize("args,message", [
    (["inspect.loss_scale=1000"], "inspect.loss_scale=1000 is not allowed: expected a power of two"),
    (["inspect.steps=0"], "inspect.steps=0 is not allowed: expected an integer >= 1"),
    (["distributed=ddp"], "distributed=ddp: ampctl inspect runs on one device"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, restore_argv, capsys, args, message):
    out = tmp_path / "inspect"
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", "device=cpu", "recipe=mlp", *args, f"hydra.run.dir={out}"])  # the default MLP underflows
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_ranges_every_records_into_the_run_directory_without_changing_the_run(tmp_path):
    from tests.support.training import train_here

    base = ["precision=fp16", "train.steps=6"]
    _, plain = train_here(tmp_path / "plain", *base)
    _, watched = train_here(tmp_path / "watched", *base, "telemetry.ranges_every=3")
    assert [r["loss"] for r in watched] == [r["loss"] for r in plain]  # the hooks only read
    assert not (tmp_path / "plain" / "ranges.jsonl").exists()
    lines = [json.loads(line) for line in (tmp_path / "watched" / "ranges.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [3, 6]
    first_layer = next(iter(lines[0]["layers"].values()))
    assert {"activation", "activation_grad", "weight_grad", "weight"} <= set(first_layer)
    assert "fp16_to_zero_scaled" in first_layer["activation_grad"] and "fp8_e4m3_overflow" in first_layer["weight"]


def test_report_renders_an_inspect_directory_again_without_rerunning(tmp_path, restore_argv, capsys):
    out = tmp_path / "inspect"
    main(["inspect", *MLP, "precision=fp16", f"hydra.run.dir={out}"])
    first = capsys.readouterr().out
    written = {name: (out / name).read_bytes() for name in ("ranges.csv", "ranges.json", "report.md")}
    for image in ("gradient_ranges.png", "underflow_heatmap.png"):
        (out / image).unlink()
    main(["report", str(out)])
    again = capsys.readouterr().out
    assert {name: (out / name).read_bytes() for name in written} == written
    assert (out / "gradient_ranges.png").is_file() and (out / "underflow_heatmap.png").is_file()
    table = lambda text: text[text.index("value ranges by tensor kind"):]  # noqa: E731
    assert table(again) == table(first)


def test_fp32_and_fp16_report_the_same_true_underflow_fractions(tmp_path, restore_argv):
    """fp16's gradients are stored multiplied by the loss scale; with it divided out (exactly, in float64)
    they flush to zero in fp16 as fp32's do. Divided in fp16, the flushed values used to vanish from the count."""
    mlp = ["device=cpu", "recipe=mlp", "inspect.steps=1"]
    fractions = {}
    for name, extra in (("fp32", []), ("fp16", ["precision=fp16", "scaler.init_scale=1024"])):
        main(["inspect", *mlp, *extra, f"hydra.run.dir={tmp_path / name}"])
        summary = {r["kind"]: r for r in json.loads((tmp_path / name / "ranges.json").read_text())["summary"]}
        fractions[name] = summary["activation_grad"]["fp16_to_zero"]
    assert fractions["fp32"] > 1e-4  # this model has gradients below fp16's reach
    assert fractions["fp16"] == pytest.approx(fractions["fp32"], rel=0.15)  # autocast changes values a little


def test_ranges_every_counts_scaled_half_gradients_as_their_true_values(tmp_path):
    from tests.support.training import train_here

    layers = {}
    for name, extra in (("fp32", []), ("fp16", ["precision=fp16", "scaler.init_scale=1024"])):
        train_here(tmp_path / name, "recipe.hidden=256", "recipe.batch_size=128", "train.steps=1",
              "telemetry.ranges_every=1", *extra)
        line = json.loads((tmp_path / name / "ranges.jsonl").read_text().splitlines()[0])
        layers[name] = {layer: kinds["activation_grad"]["fp16_to_zero"] for layer, kinds in line["layers"].items()
                        if "activation_grad" in kinds}
    assert sum(layers["fp32"].values()) > 0
    assert sum(layers["fp16"].values()) == pytest.approx(sum(layers["fp32"].values()), rel=0.15)


def test_a_half_precision_run_says_what_it_cannot_measure_and_its_zeros_hold_what_underflowed(tmp_path, restore_argv,
                                                                                             capsys):
    """fp16 at loss scale 1: gradients below fp16's range were zero before the hooks saw them. The fp16 run's
    exact zeros of activation gradients hold what the fp32 run (the same steps on true values) counts as flushed,
    and the output says so and how to measure it; the fp32 run says nothing of the kind."""
    def summary(*args: str) -> tuple[dict, str]:
        out = tmp_path / args[0].split("=")[1]
        main(["inspect", "device=cpu", "recipe=mlp", *args, f"hydra.run.dir={out}"])  # the default MLP underflows
        rows = {r["kind"]: r for r in json.loads((out / "ranges.json").read_text())["summary"]}
        return rows, " ".join(capsys.readouterr().out.split())

    half, half_out = summary("precision=fp16", "scaler.init_scale=1")
    full, full_out = summary("precision=fp32", "inspect.loss_scale=1")
    assert full["activation_grad"]["fp16_to_zero"] > 0  # true values that fp16 would flush
    assert half["activation_grad"]["fp16_to_zero"] == 0  # the run's own fp16 flushed them before recording
    # the two runs compute different values (the fp16 run rounds every product; a CPU with AVX512-FP16 rounds
    # them differently again), so the zeros hold what underflowed to within a few percent, not exactly
    assert half["activation_grad"]["zero"] >= 0.97 * (full["activation_grad"]["fp16_to_zero"]
                                                      + full["activation_grad"]["zero"])
    assert ("this run computed its gradients in float16 (loss scale [1.0]): a gradient below float16's range at "
            "that scale was zero already when recorded") in half_out
    assert "ampctl inspect precision=fp32 inspect.loss_scale=1." in half_out
    assert "this run computed its gradients" not in full_out


def test_inspect_under_a_block_scaled_format_shows_each_layers_precision_and_its_block_scales(tmp_path, restore_argv,
                                                                                              capsys):
    out = tmp_path / "inspect"
    main(["inspect", *GPT, "precision=nvfp4", "precision.rules=[{match:lm_head,run_in:unconverted},"
          "{match:'blocks.1.*',run_in:mxfp8}]", f"hydra.run.dir={out}"])
    printed = capsys.readouterr().out
    assert "resolved precision per layer" in printed and "block scales per layer" in printed
    data = json.loads((out / "ranges.json").read_text())
    layers = {row["layer"]: row for row in data["precision_layers"]}
    assert layers["lm_head"]["compute"] == "float32" and layers["lm_head"]["rule"] == "rules[0]"
    assert layers["blocks.0.attn.qkv"]["compute"] == "nvfp4 (emulated)"
    assert layers["blocks.1.attn.qkv"]["compute"] == "mxfp8 (emulated)"
    blocks = {row["layer"]: row for row in data["block_scales"]}
    assert set(blocks) == {f"blocks.{i}.{n}" for i in (0, 1) for n in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")}
    assert {blocks["blocks.0.mlp.0"]["format"], blocks["blocks.1.mlp.0"]["format"]} == {"nvfp4", "mxfp8"}
    for row in blocks.values():
        for role in ("activation", "weight", "gradient"):
            assert 0 <= row[f"{role}_saturated"] <= 1 and 0 <= row[f"{role}_flushed"] <= 1
    # FP4 flushes more than FP8 on the same model
    assert blocks["blocks.0.mlp.0"]["weight_flushed"] > blocks["blocks.1.mlp.0"]["weight_flushed"]
    report = (out / "report.md").read_text()
    assert "## resolved precision per layer" in report and "## block scales per layer" in report
    # and ampctl report renders them again from ranges.json
    (out / "report.md").unlink()
    main(["report", str(out)])
    assert "## block scales per layer" in (out / "report.md").read_text()
