"""A run directory written before train.* was grouped by concern (tests/data/run_before_config_v2: made by ampctl's
train with the flat keys, train.checkpoint_every=2 train.eval_every=2 train.ema_decay=0.9 ..., 4 steps) still
resumes: its checkpoint's config and its identity are read through conf/migration.py. An old key typed today is
refused in one line naming its new home."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ampctl.cli import main
from ampctl.conf.migration import CONFIG_VERSION, MOVED_IN_2, migrated, migrated_override
from ampctl.runner import identity

BEFORE = Path(__file__).resolve().parents[1] / "data" / "run_before_config_v2"


def test_a_recorded_config_of_the_flat_layout_reads_as_todays():
    recorded = json.loads((BEFORE / "identity.json").read_text())
    assert "config_version" not in recorded and recorded["config"]["train"]["checkpoint_every"] == 2
    today = migrated(recorded["config"], None)
    assert today["train"]["checkpoint"]["every"] == 2 and today["train"]["eval"]["every"] == 2
    assert today["train"]["ema"]["decay"] == 0.9 and today["train"]["lr"]["warmup_steps"] == 1
    assert not set(today["train"]) & {old.split(".", 1)[1] for old in MOVED_IN_2}
    assert migrated(today, CONFIG_VERSION) is today  # today's layout is left as it is
    read = identity.read(BEFORE)
    assert read is not None and read.config == today and read.config_hash == identity.config_hash(today)
    assert migrated_override("train.eval_every=5") == "train.eval.every=5"
    assert migrated_override("+train.ema_decay=0.99") == "+train.ema.decay=0.99"
    assert migrated_override("train.steps=5") == "train.steps=5"


def test_a_run_directory_written_before_the_change_resumes(tmp_path, restore_argv, capsys):
    run = tmp_path / "run"
    shutil.copytree(BEFORE, run)
    main(["train", "resume=auto", f"hydra.run.dir={run}", "train.steps=6", "train.console=plain"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]  # steps 1-4 kept, 5-6 continued from step 4
    assert json.loads((run / "summary.json").read_text())["steps"] == 6
    evals = [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [2, 4, 6] and "eval/ema_loss" in evals[-1]  # its eval and EMA settings kept
    assert json.loads((run / "identity.json").read_text())["run_id"] == json.loads(
        (BEFORE / "identity.json").read_text())["run_id"]  # the same run, continued


@pytest.mark.parametrize("old,new", [("train.eval_every=2", "train.eval.every"),
                                     ("train.checkpoint_mirror=memory://x", "train.checkpoint.mirror"),
                                     ("train.hang_after_s=60", "train.cluster.hang_after_s")])
def test_a_key_of_the_flat_layout_is_refused_naming_its_new_home(tmp_path, restore_argv, capsys, old, new):
    with pytest.raises(SystemExit) as ended:
        main(["train", "device=cpu", "recipe=mlp", old, f"hydra.run.dir={tmp_path / 'run'}"])
    assert ended.value.code == 2
    assert capsys.readouterr().err == (f"ampctl train: error: {old.split('=')[0]}: moved to {new} (train.* is grouped "
                                       "by concern: lr, checkpoint, eval, ema, cluster)\n")
    assert not (tmp_path / "run").exists()
