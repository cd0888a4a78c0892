"""The open sets are one module and one YAML each: a tracker and a precision converter of one's own, written into
an experiment directory (`-cd DIR`, whose modules ampctl can import), are chosen on the command line like the
built-in ones, with nothing else edited. docs/architecture.md's checklists say the same."""

from __future__ import annotations

import json
import os

import pytest

from ampctl.cli import main
from tests.support.training import QUIET

MLP = ["device=cpu", "recipe=mlp", "recipe.hidden=32", "recipe.batch_size=16", "train.steps=5", "train.log_every=1"]

TRACKER_MODULE = '''
import json
from dataclasses import dataclass

from ampctl.runner.trackers import Tracker


@dataclass
class JsonLinesOptions:
    file: str = "mine.jsonl"


class JsonLinesTracker(Tracker):
    options_type = JsonLinesOptions

    def start(self, cfg):
        self.out = (self.run_dir / self.options.file).open("w")
        self.out.write(json.dumps({"started": cfg.precision.name}) + "\\n")

    def write(self, records):
        for r in records:
            self.out.write(json.dumps({"step": r.step, "loss": r.loss}) + "\\n")

    def write_eval(self, row):
        pass

    def finish(self, summary):
        self.out.write(json.dumps({"final_loss": summary["final_loss"]}) + "\\n")
        self.out.close()
'''
TRACKER_YAML = """# Mine: every step's loss as a JSON line (a test's tracker).
mine:
  _target_: my_tracker.JsonLinesTracker
  file: mine.jsonl
"""

CONVERTER_MODULE = '''
from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

from ampctl.engine.precision.converters import ConvertedLinear, Converter, register_converter


class RoundTo(Enum):
    bfloat16 = "bfloat16"
    float16 = "float16"


@dataclass
class RoundingOptions:
    round_to: RoundTo = RoundTo.bfloat16


class RoundedLinear(ConvertedLinear):
    def __init__(self, *args, round_to, **kwargs):
        super().__init__(*args, **kwargs)
        self.round_to = getattr(torch, round_to.value)

    def forward(self, x):
        return nn.functional.linear(x, self.weight.to(self.round_to).float(), self.bias)


@register_converter
class RoundingConverter(Converter):
    name = "rounding"
    formats = ("rounded",)
    options_type = RoundingOptions

    def convert(self, module, fqn, fmt):
        return RoundedLinear.from_linear(module, round_to=self.options.round_to)

    def describe(self):
        return f"converter=rounding round_to={self.options.round_to.value}"
'''
CONVERTER_YAML = """# Rounded: Linear weights rounded to bf16 in the forward (a test's converter).
defaults:
  - /schema_precision@_here_
  - override /scaler@_global_.scaler: none
  - _self_

name: rounded
description: Linear weights rounded to bf16 (a test converter)
converter: my_converter.RoundingConverter
options:
  round_to: bfloat16
"""


@pytest.fixture
def experiment_dir(tmp_path, monkeypatch):
    """A user's experiment directory, with its modules importable as `-cd` makes them (and removed after)."""
    import sys

    conf = tmp_path / "exp"
    (conf / "logger").mkdir(parents=True)
    (conf / "precision").mkdir()
    (conf / "my_tracker.py").write_text(TRACKER_MODULE)
    (conf / "logger" / "mine.yaml").write_text(TRACKER_YAML)
    (conf / "my_converter.py").write_text(CONVERTER_MODULE)
    (conf / "precision" / "rounded.yaml").write_text(CONVERTER_YAML)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # -cd puts the directory on both
    yield conf
    from ampctl.engine.precision import converters

    converters.unregister_converter("rounding")
    for name in ("my_tracker", "my_converter"):
        sys.modules.pop(name, None)


def test_a_tracker_of_ones_own_is_its_module_and_its_yaml(experiment_dir, tmp_path, restore_argv):
    run = tmp_path / "run"
    main(["train", "-cd", str(experiment_dir), *QUIET, *MLP, "logger=[csv,mine]", f"hydra.run.dir={run}"])
    lines = [json.loads(line) for line in (run / "mine.jsonl").read_text().splitlines()]
    recorded = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines[0] == {"started": "fp32"}
    assert lines[1:-1] == [{"step": r["step"], "loss": r["loss"]} for r in recorded]
    assert lines[-1] == {"final_loss": json.loads((run / "summary.json").read_text())["final_loss"]}


def test_a_trackers_options_are_typed_by_its_class(experiment_dir, tmp_path, restore_argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "-cd", str(experiment_dir), *QUIET, *MLP, "logger=mine", "+logger.mine.fil=x.jsonl",
              f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2 and not (tmp_path / "run").exists()
    assert capsys.readouterr().err == ("ampctl train: error: logger.mine.fil: no such key (did you mean "
                                       "logger.mine.file?); allowed: file\n")


def test_a_converter_of_ones_own_is_its_module_and_its_yaml(experiment_dir, tmp_path, restore_argv):
    run = tmp_path / "run"
    main(["train", "-cd", str(experiment_dir), *QUIET, *MLP, "precision=rounded", "precision.options.round_to=float16",
          f"hydra.run.dir={run}"])
    log = (run / "train.log").read_text()
    assert "Selected precision=rounded: converter=rounding round_to=float16, converted=4 of 4 Linear layers" in log


def test_a_converters_options_are_typed_by_its_class(experiment_dir, tmp_path, restore_argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "-cd", str(experiment_dir), *QUIET, *MLP, "precision=rounded", "precision.options.round_to=int8",
              f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2 and not (tmp_path / "run").exists()
    assert capsys.readouterr().err == ("ampctl train: error: precision.options.round_to='int8' is not allowed: "
                                       "expected one of bfloat16, float16\n")


def test_a_run_recorded_before_trackers_named_their_class_continues_with_ampctls_tracker_of_that_name():
    """A checkpoint's config from before trackers were `_target_` nodes: `logger: {csv: {file: ...}, wandb: null}`."""
    from omegaconf import OmegaConf

    from ampctl.runner.trackers import check_loggers
    from ampctl.runner.trackers.csv_tracker import CsvTracker

    chosen = check_loggers(OmegaConf.create({"csv": {"file": "m.csv"}, "wandb": None}))
    assert list(chosen) == ["csv"] and chosen["csv"][0] is CsvTracker and chosen["csv"][1].file == "m.csv"


def test_a_tracker_of_ones_own_whose_package_is_missing_names_the_package(experiment_dir, tmp_path, restore_argv,
                                                                          capsys, monkeypatch):
    import sys

    sys.path.insert(0, str(experiment_dir))
    from my_tracker import JsonLinesTracker

    monkeypatch.setattr(JsonLinesTracker, "package", "jsonlines_is_not_installed_here", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "-cd", str(experiment_dir), *QUIET, *MLP, "logger=mine", f"hydra.run.dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2 and not (tmp_path / "run").exists()
    assert capsys.readouterr().err == ("ampctl train: error: logger=mine: the jsonlines_is_not_installed_here package "
                                       "is not installed; pip install 'jsonlines_is_not_installed_here'\n")
