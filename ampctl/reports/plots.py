"""The report's PNG charts (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import matplotlib

matplotlib.use("Agg")  # files only: works on headless machines and never opens a window
import matplotlib.pyplot as plt  # noqa: E402

from ampctl.reports.runs import RunRecord  # noqa: E402

# Curves of modes that agree (fp32 and bf16 often do) lie on top of each other: vary the dash too.
LINESTYLES = ("-", "--", "-.", ":")


def loss_curves(runs: Sequence[tuple[str, RunRecord]], path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (label, run) in enumerate(runs):
        steps = [r["step"] for r in run.metrics]
        ax.plot(steps, [r["loss"] for r in run.metrics], label=label, linewidth=1.2,
                linestyle=LINESTYLES[i % len(LINESTYLES)])
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


def loss_scale_curves(runs: Sequence[tuple[str, RunRecord]], path: Path, title: str) -> Optional[Path]:
    """Loss scale over steps with skipped steps marked; only for runs that scale (None if there are none)."""
    scaled = [(label, run) for label, run in runs if any(r["loss_scale"] != 1.0 for r in run.metrics)]
    if not scaled:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (label, run) in enumerate(scaled):
        steps = [r["step"] for r in run.metrics]
        (line,) = ax.plot(steps, [r["loss_scale"] for r in run.metrics], label=label, linewidth=1.2,
                          linestyle=LINESTYLES[i % len(LINESTYLES)])
        skipped = [r for r in run.metrics if r["skipped"]]
        if skipped:
            ax.scatter([r["step"] for r in skipped], [r["loss_scale"] for r in skipped], marker="x", color=line.get_color(),
                       label=f"{label}: {len(skipped)} skipped", zorder=3)
    ax.set_yscale("log", base=2)
    ax.set(xlabel="step", ylabel="loss scale (log2)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


def throughput_memory_bars(
    labels: Sequence[str],
    throughput: Sequence[float],
    speedup: Sequence[float],
    memory_mib: Sequence[Optional[float]],  # None: not measured (a compiled run on a CPU)
    memory_ratio: Sequence[Optional[float]],
    throughput_unit: str,
    baseline: str,
    path: Path,
) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, values, ratios, ylabel in (
        (left, throughput, speedup, throughput_unit),
        (right, memory_mib, memory_ratio, "peak memory (MiB)"),
    ):
        bars = ax.bar(labels, [v or 0.0 for v in values], color="tab:blue")
        ax.bar_label(bars, labels=["not measured" if r is None else f"{r:.2f}×" for r in ratios], padding=2)
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, max([v or 0.0 for v in values] + [1e-9]) * 1.15)
        ax.grid(axis="y", alpha=0.3)
    left.set_title(f"throughput (speedup vs {baseline})")
    right.set_title(f"peak memory (ratio to {baseline})")
    fig.tight_layout()
    return save_figure(fig, path)


def save_figure(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
