"""A run directory written before train.* was grouped by concern (tests/data/run_before_config_v2: made by ampctl's
train with the flat keys, train.checkpoint_every=2 train.eval_every=2 train.ema_decay=0.9 ..., 4 steps), or before
torch.compile's keys were (tests/data/run_before_config_v3: layout 2, the same run's settings in their groups and
train.compile_mode=max-autotune-no-cudagraphs) still resumes: its checkpoint's config and its identity are read
through conf/migration.py. An old key typed today is refused in one line naming its new home."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ampctl.cli import main
from ampctl.conf.migration import CONFIG_VERSION, MOVED_IN_2, MOVED_IN_3, migrated, migrated_override
from ampctl.runner import identity

DATA = Path(__file__).resolve().parents[1] / "data"
BEFORE = DATA / "run_before_config_v2"
BEFORE_V3 = DATA / "run_before_config_v3"


def test_a_recorded_config_of_the_flat_layout_reads_as_todays():
    recorded = json.loads((BEFORE / "identity.json").read_text())
    assert "config_version" not in recorded and recorded["config"]["train"]["checkpoint_every"] == 2
    today = migrated(recorded["config"], None)
    assert today["train"]["checkpoint"]["every"] == 2 and today["train"]["eval"]["every"] == 2
    assert today["train"]["ema"]["decay"] == 0.9 and today["train"]["lr"]["warmup_steps"] == 1
    assert today["train"]["compile"] == {"enabled": False, "mode": "default"}  # version 3's move, after version 2's
    assert not set(today["train"]) & {old.split(".", 1)[1] for old in MOVED_IN_2} - {"compile"}
    assert migrated(today, CONFIG_VERSION) is today  # today's layout is left as it is
    read = identity.read(BEFORE)
    assert read is not None and read.config == today and read.config_hash == identity.config_hash(today)
    assert migrated_override("train.eval_every=5") == "train.eval.every=5"
    assert migrated_override("+train.ema_decay=0.99") == "+train.ema.decay=0.99"
    assert migrated_override("train.steps=5") == "train.steps=5"
    assert migrated_override("train.compile=true") == "train.compile.enabled=true"
    assert migrated_override("train.compile_mode=max-autotune") == "train.compile.mode=max-autotune"
    assert migrated_override("train.compile.mode=default") == "train.compile.mode=default"  # today's, as it is


def test_a_recorded_config_of_version_2_takes_only_the_moves_after_it():
    """Version 2 grouped train.* but kept torch.compile's flag and mode flat; version 3 made them train.compile.*,
    the flag's own name becoming its group's."""
    version_2 = {"train": {"compile": True, "compile_mode": "max-autotune", "eval": {"every": 5}, "steps": 10}}
    today = migrated(version_2, 2)
    assert today["train"] == {"compile": {"enabled": True, "mode": "max-autotune"}, "eval": {"every": 5}, "steps": 10}
    assert version_2["train"]["compile"] is True  # the record itself is left as it was read
    assert set(MOVED_IN_3) == {"train.compile", "train.compile_mode"}


@pytest.mark.parametrize("before", [BEFORE, BEFORE_V3], ids=["layout_1", "layout_2"])
def test_a_run_directory_written_before_the_change_resumes(tmp_path, restore_argv, capsys, before):
    run = tmp_path / "run"
    shutil.copytree(before, run)
    main(["train", "resume=auto", f"hydra.run.dir={run}", "train.steps=6", "train.console=plain"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]  # steps 1-4 kept, 5-6 continued from step 4
    assert json.loads((run / "summary.json").read_text())["steps"] == 6
    evals = [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [2, 4, 6] and "eval/ema_loss" in evals[-1]  # its eval and EMA settings kept
    assert json.loads((run / "identity.json").read_text())["run_id"] == json.loads(
        (before / "identity.json").read_text())["run_id"]  # the same run, continued
    recorded = identity.read(run)
    assert recorded is not None and recorded.config["train"]["compile"] == {
        "enabled": False, "mode": "max-autotune-no-cudagraphs" if before == BEFORE_V3 else "default"}


@pytest.mark.parametrize("old,new", [("train.eval_every=2", "train.eval.every"),
                                     ("train.checkpoint_mirror=memory://x", "train.checkpoint.mirror"),
                                     ("train.hang_after_s=60", "train.cluster.hang_after_s"),
                                     ("train.compile=true", "train.compile.enabled"),
                                     ("train.compile_mode=default", "train.compile.mode")])
def test_a_key_of_the_flat_layout_is_refused_naming_its_new_home(tmp_path, restore_argv, capsys, old, new):
    with pytest.raises(SystemExit) as ended:
        main(["train", "device=cpu", "recipe=mlp", old, f"hydra.run.dir={tmp_path / 'run'}"])
    assert ended.value.code == 2
    assert capsys.readouterr().err == (f"ampctl train: error: {old.split('=')[0]}: moved to {new} (train.* is grouped "
                                       "by concern: lr, checkpoint, eval, ema, cluster, compile)\n")
    assert not (tmp_path / "run").exists()
