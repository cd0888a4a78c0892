"""The report plots explain themselves: titles name the recipe, modes and steps, legends sit outside the
axes, the compare loss plot has a panel of each mode's loss minus the baseline's, memory has its parts."""

from __future__ import annotations

from pathlib import Path

import pytest

from ampctl.reports import plots
from ampctl.reports.runs import RunRecord


@pytest.fixture
def figures(monkeypatch):
    kept = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: kept.append(fig) or path)
    yield kept
    for fig in kept:
        plots.pyplot().close(fig)


def run(mode: str, losses: list[float], scales: list[float] | None = None) -> tuple[str, RunRecord]:
    metrics = [{"step": i + 1, "loss": loss, "loss_scale": (scales or [1.0] * len(losses))[i], "skipped": False}
               for i, loss in enumerate(losses)]
    return mode, RunRecord(Path(mode), {"recipe": "gpt", "precision": mode}, metrics)


def test_the_loss_plot_names_what_ran_and_shows_each_modes_loss_minus_the_baselines(figures):
    runs = [run("fp32", [3.0, 2.5, 2.0]), run("bf16", [3.0, 2.75, 1.5])]
    plots.loss_curves(runs, Path("loss.png"), "loss per step", baseline="fp32")
    [fig] = figures
    top, delta = fig.axes
    assert top.get_title() == "loss per step\nrecipe=gpt · fp32, bf16 · 3 steps"
    [line] = delta.get_lines()[:1]
    assert list(line.get_xdata()) == [1, 2, 3] and list(line.get_ydata()) == [0.0, 0.25, -0.5]
    assert delta.get_ylabel() == "loss − fp32 loss"
    fig.canvas.draw()
    for ax in fig.axes:  # the legend starts right of the axes: it covers no curve
        assert ax.get_legend().get_window_extent().x0 > ax.get_window_extent().x1


def test_one_run_has_no_delta_panel_and_the_scale_plot_is_titled_too(figures):
    plots.loss_curves([run("fp16", [2.0, 1.0])], Path("loss.png"), "loss per step", baseline="fp16")
    plots.loss_scale_curves([run("fp16", [2.0, 1.0], [65536.0, 32768.0])], Path("s.png"), "loss scale")
    assert len(figures[0].axes) == 1 and figures[1].axes[0].get_title().endswith("recipe=gpt · fp16 · 2 steps")


def test_memory_bars_stack_the_parts_beside_the_measured_peak(figures):
    parts = {"weights": [2**20, 2**19], "gradients": [2**20, 2**19], "activations": [2**21, 2**20]}
    plots.memory_bars(["fp32", "bf16"], parts, [3 * 2**20, None], Path("m.png"), "recipe=gpt")
    [ax] = figures[0].axes
    heights = [(round(p.get_x() + p.get_width() / 2, 2), p.get_y() + p.get_height()) for p in ax.patches]
    assert (-0.18, 4.0) in heights and (0.82, 2.0) in heights  # each mode's stack tops at its estimate, MiB
    assert (0.18, 3.0) in heights  # the measured peak beside it
    assert "not measured" in [t.get_text() for t in ax.texts] and ax.get_title().endswith("recipe=gpt")


def test_a_layer_whose_name_is_only_a_position_is_labelled_with_its_type():
    from ampctl.analysis.range_plots import row_label

    assert row_label("0", "Linear") == "0 (Linear)"  # the MLP, an nn.Sequential
    assert row_label("blocks.0.mlp.2", "Linear") == "blocks.0.mlp.2 (Linear)"
    assert row_label("blocks.0.attn.qkv", "Linear") == "blocks.0.attn.qkv"
    assert row_label("3", None) == "3"  # a ranges.json written before layers carried their type


def test_a_sweeps_plot_labels_a_job_by_its_number_and_swept_values_and_a_lone_job_by_its_number():
    from ampctl.reports.sweep import plot_label

    assert plot_label("1", {"optimizer.lr": 0.002, "precision": "bf16"}) == "#1: optimizer.lr=0.002 precision=bf16"
    assert plot_label("0", {}) == "#0"  # it was "#0: " in the legend of a one-job sweep
