"""What a newcomer reads first, in a real terminal 80 columns wide (a pseudo-terminal): no line the terminal would
break inside a word (ampctl breaks them at word boundaries, the continuation indented), no table cell cut to "…"."""

from __future__ import annotations

import pytest

from tests.support.terminal import cut_mid_word, in_a_terminal

COLUMNS = 80


@pytest.mark.parametrize("args", [
    ["train", "recipe=mlp", "precision=fp16", "train.steps=20", "train.console=plain", "hydra.run.dir=run"],
    ["train", "recipe=mlp", "precision=bf16", "train.steps=20", "hydra.run.dir=live"],  # the live view
    ["inspect", "recipe=mlp", "precision=fp16", "inspect.steps=1", "hydra.run.dir=inspect"],
    ["list"],
    ["memory", "recipe=mlp", "memory.precisions=[fp32,O2]", "hydra.run.dir=memory"],
    ["diff", "recipe=mlp", "precision=nvfp4", "diff.batches=2", "diff.repair=true", "hydra.run.dir=diff"],
], ids=["train", "train-live", "inspect", "list", "memory", "diff"])
def test_the_first_screen_fits_80_columns_whole(tmp_path, args):
    code, lines = in_a_terminal(args, tmp_path, COLUMNS)
    assert code == 0, "\n".join(lines[-30:])
    assert not cut_mid_word(lines, COLUMNS), "\n".join(cut_mid_word(lines, COLUMNS))
    assert not [line for line in lines if "…" in line], "\n".join(lines)
    if args[0] == "inspect":  # the summary's columns of an fp16 run, its tensor kinds whole
        # (drawn without vertical borders where the bordered table would be wider than the terminal)
        assert any(line.lstrip(" │").startswith("activation_grad ") for line in lines), "\n".join(lines)
        assert any("×2^16" in line for line in lines)
    if args[0] == "memory":  # the states summed in one column at 80 (each in report.md), every row whole
        assert any(line.startswith("│ O2 ") for line in lines) and any("states =" in line for line in lines)
    if args[0] == "diff":  # the command that runs the repair on a line of its own, whole, to copy as it is
        assert f"ampctl train -cd {tmp_path / 'diff'} -cn repaired" in [line.strip() for line in lines], lines
    if args[0] == "train" and "train.console=plain" in args:
        assert lines[0].startswith("Selected precision=fp16: ") and lines[1].startswith("  ")  # its continuation
