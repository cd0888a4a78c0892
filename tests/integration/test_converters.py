"""Converters as plug-ins: a converter registered from this file (and one from an entry point) is a precision
mode everywhere a mode is named: `ampctl list`, the start line, refusals and messages. Every converted model is
honest under print, copy.deepcopy and state_dict."""

from __future__ import annotations

import copy
import json
from importlib import metadata

import pytest
import torch
from torch import nn

from ampctl.cli import main
from ampctl.engine.precision import converters
from ampctl.engine.precision.converters import ConvertedLinear, Converter, register_converter
from tests.support.training import QUIET

MLP = ["recipe=mlp", "recipe.hidden=32", "recipe.batch_size=16", "train.steps=4"]
MODE_YAML = """# Halved: a test mode whose Linear layers compute with half their weights.
defaults:
  - /schema_precision@_here_
  - override /scaler@_global_.scaler: none
  - _self_

name: halved
description: Linear layers with halved weights (a test converter)
converter: halving
"""


class HalvedLinear(ConvertedLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight / 2, self.bias)


class HalvingConverter(Converter):
    name = "halving"
    formats = ("halved",)
    refusal: str | None = None  # set by a test: why it cannot run here

    def unsupported_reason(self):
        return HalvingConverter.refusal

    def convert(self, module, fqn, fmt):
        return HalvedLinear.from_linear(module)

    def describe(self):
        return "halved=yes"


@pytest.fixture
def halving(tmp_path):
    register_converter(HalvingConverter)
    conf = tmp_path / "conf"
    (conf / "precision").mkdir(parents=True)
    (conf / "precision" / "halved.yaml").write_text(MODE_YAML)
    yield conf
    HalvingConverter.refusal = None
    converters.unregister_converter("halving")


def test_a_registered_converter_is_a_mode_that_trains(halving, tmp_path, restore_argv, capsys):
    main(["train", "-cd", str(halving), *QUIET, *MLP, "precision=halved", f"hydra.run.dir={tmp_path / 'run'}"])
    log = (tmp_path / "run" / "train.log").read_text()
    assert "Selected precision=halved: halved=yes, converted=4 of 4 Linear layers, autocast=off" in log, log


def test_ampctl_list_shows_it_with_the_converter_modes(halving, restore_argv, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    main(["list", "-cd", str(halving), "device=cpu"])
    rows = [line.split("│")[1].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("│ ")]
    modes = rows[:rows.index("dynamic")] if "dynamic" in rows else rows
    # after the flag-driven modes, among the converter modes, by name
    assert modes.index("halved") > modes.index("O3") and modes.index("fp8_emulated") < modes.index("halved")


def test_its_refusal_is_one_line_naming_the_mode(halving, tmp_path, restore_argv, capsys):
    HalvingConverter.refusal = "needs a halving unit"
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "-cd", str(halving), *QUIET, *MLP, "precision=halved", f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["ampctl train: error: precision=halved needs a halving unit: `ampctl list` says which "
                                "modes run here"], err
    assert not (tmp_path / "run").exists()


def test_options_given_to_a_converter_that_takes_none_are_refused(halving, tmp_path, restore_argv, capsys):
    (halving / "precision" / "halved_by.yaml").write_text(MODE_YAML.replace("name: halved", "name: halved_by")
                                                         + "options:\n  factor: 3\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "-cd", str(halving), *QUIET, *MLP, "precision=halved_by", f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2 and not (tmp_path / "run").exists()
    assert capsys.readouterr().err == ("ampctl train: error: precision.options: converter halving takes no options (it "
                                       "names no options_type); given: factor\n")


def test_an_unknown_converter_is_named_with_the_registered_ones(tmp_path, restore_argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *QUIET, *MLP, "precision=fp32", "precision.converter=fp8_emulatd",
              f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "precision.converter=fp8_emulatd: no such converter (did you mean fp8_emulated?); registered: " in line
    assert "fp8_torchao" in line and "mx_emulated" in line


def test_a_second_converter_under_a_taken_name_is_refused():
    class Impostor(Converter):
        name = "fp8_emulated"
        formats = ("x",)

    converters.registered()
    with pytest.raises(ValueError, match="converter name 'fp8_emulated' is taken by"):
        register_converter(Impostor)


def test_a_package_registers_one_through_entry_points(monkeypatch):
    class FromPackage(Converter):
        name = "from_package"
        formats = ("packaged",)

    entry = metadata.EntryPoint(name="from_package", value="x:y", group=converters.ENTRY_POINT_GROUP)
    monkeypatch.setattr(metadata.EntryPoint, "load", lambda self: FromPackage)
    real = metadata.entry_points
    monkeypatch.setattr(metadata, "entry_points",
                        lambda group=None: [entry] if group == converters.ENTRY_POINT_GROUP else real(group=group))
    try:
        assert converters.registered()["from_package"] is FromPackage
        assert converters.format_owners()["packaged"] is FromPackage
    finally:
        converters.unregister_converter("from_package")


def converted_models():
    """A small model converted by each registered converter that can build its layers here, with its format."""
    for name, cls in sorted(converters.registered().items()):
        if name == "fp8_torchao":
            pytest.importorskip("torchao")
        converter = cls(None, torch.device("cpu"))
        for fmt in cls.formats:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
            converter.convert_model(model, {"0": fmt, "2": fmt})
            yield name, fmt, model


@pytest.mark.parametrize("name,fmt,model", list(converted_models()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_converted_model_is_honest_under_print_deepcopy_and_state_dict(name, fmt, model):
    kinds = {type(model[0]), type(model[2])}
    assert kinds != {nn.Linear} and all(issubclass(k, nn.Linear) for k in kinds)
    assert type(model[0]).__name__ in repr(model)  # print shows what computes
    x = torch.randn(4, 64)
    before = model(x).detach()
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.zero_()
    assert torch.equal(clone(x), torch.zeros(4, 32))  # the copy computes with its own (zeroed) weights
    assert torch.equal(model(x).detach(), before)  # and the original is untouched
    keys = set(model.state_dict())
    assert {"0.weight", "0.bias", "2.weight", "2.bias"} <= keys  # the same names as the Linear's
    fresh = copy.deepcopy(clone)
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh(x), model(x))



def test_an_emulated_formats_speed_is_labelled_as_the_emulations(tmp_path, restore_argv, capsys):
    main(["train", *QUIET, *MLP, "precision=mxfp4", f"hydra.run.dir={tmp_path / 'run'}"])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["emulated"] is True
    assert summary["converter"] == {"name": "mx_emulated", "layers": 4,
                                    "checkpoints_carry": "nothing beyond the model's weights",
                                    "described": "mxfp4=emulated elements=e2m1 block=32 scales=e8m0 scale_mode=floor"}
    done = [line for line in (tmp_path / "run" / "train.log").read_text().splitlines() if "done:" in line]
    assert "(an emulation's speed, not the format's)" in done[0]
    main(["train", *QUIET, *MLP, "precision=bf16", f"hydra.run.dir={tmp_path / 'bf16'}"])
    assert json.loads((tmp_path / "bf16" / "summary.json").read_text())["emulated"] is False


def test_advise_weighs_every_converter_mode_but_the_emulations(halving):
    """advise's candidates come from the registry: a converter's mode is one without a list to extend; the mode
    that only emulates another (fp8_emulated for fp8) is not weighed."""
    from ampctl.shell.hydra_internals import composed
    from ampctl.studies.advising.advise import candidate_modes
    from ampctl.studies.compare import DEFAULT_COMPARE_PRECISIONS

    with composed("advise", [], config_dir=halving):
        candidates = candidate_modes()
    assert candidates[:len(DEFAULT_COMPARE_PRECISIONS)] == DEFAULT_COMPARE_PRECISIONS
    assert set(candidates[len(DEFAULT_COMPARE_PRECISIONS):]) == {"fp8", "mxfp8", "mxfp4", "nvfp4", "nvfp4_recipe",
                                                                   "halved"}


def test_a_gpt_trained_by_torchaos_mxfp8_layers_equals_ampctls_emulation_step_for_step(tmp_path, restore_argv, capsys):
    """precision.options.kernels=torchao: torchao's MXFP8 training layer (here its emulated reference, where a B200
    runs its kernels) trains the built-in GPT to the same losses, gradient norms and weights as ampctl's emulation,
    bit for bit (every Linear in whole blocks of 32; the tokens padded); the start line says whose layers ran."""
    from ampctl.engine.precision import mx_torchao

    if mx_torchao.missing():
        pytest.skip(mx_torchao.missing())
    gpt = ["recipe=gpt", "recipe.n_layers=2", "recipe.d_model=64", "recipe.n_heads=2", "recipe.block_size=24",
           "recipe.batch_size=3", "recipe.max_corpus_bytes=100000", "train.steps=3", "precision=mxfp8",
           "precision.options.scale_mode=rceil", "train.log_every=1", *QUIET]
    runs = {}
    for kernels in ("emulated", "torchao"):
        run_dir = tmp_path / kernels
        main(["train", *gpt, f"precision.options.kernels={kernels}", f"hydra.run.dir={run_dir}"])
        runs[kernels] = [{k: row[k] for k in ("step", "loss", "grad_norm")}
                         for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]
    assert runs["torchao"] == runs["emulated"] and len(runs["torchao"]) == 3
    log = (tmp_path / "torchao" / "train.log").read_text()
    assert "mxfp8=torchao's emulated reference" in log and "TorchaoMXFP8Linear" in log
