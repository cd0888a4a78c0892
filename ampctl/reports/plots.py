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
    return _save(fig, path)


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
    return _save(fig, path)


def throughput_memory_bars(
    labels: Sequence[str],
    throughput: Sequence[float],
    speedup: Sequence[float],
    memory_mib: Sequence[float],
    memory_ratio: Sequence[float],
    throughput_unit: str,
    baseline: str,
    path: Path,
) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, values, ratios, ylabel in (
        (left, throughput, speedup, throughput_unit),
        (right, memory_mib, memory_ratio, "peak memory (MiB)"),
    ):
        bars = ax.bar(labels, values, color="tab:blue")
        ax.bar_label(bars, labels=[f"{r:.2f}×" for r in ratios], padding=2)
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, max(values) * 1.15)
        ax.grid(axis="y", alpha=0.3)
    left.set_title(f"throughput (speedup vs {baseline})")
    right.set_title(f"peak memory (ratio to {baseline})")
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def gradient_ranges(counts: Sequence[int], total: int, label: str, study_scale: float, path: Path) -> Path:
    """The loss-scaling picture for this model: the histogram of gradient magnitudes (counts per log2 bin,
    numerics.LOG2_LOW upwards, as fractions of all `total` values, zeros included), each format's range
    drawn under it, and the same histogram shifted by the loss scale."""
    import math

    from ampctl.analysis.numerics import FORMATS, LOG2_LOW, scale_label

    fractions = [float(c) / max(total, 1) for c in counts]
    exponents = list(range(LOG2_LOW, LOG2_LOW + len(fractions)))
    used = [e for e, f in zip(exponents, fractions) if f > 0]
    shift = math.log2(study_scale)
    lo = min(min(used, default=-30), -26) - 2
    hi = max(max(used, default=0) + shift, 17) + 2
    fig, ax = plt.subplots(figsize=(9, 5))
    ax.bar(exponents, fractions, width=1.0, align="edge", color="tab:blue", alpha=0.75, label=label)
    ax.step([e + shift for e in exponents], fractions, where="post", color="tab:orange",
            label=f"× loss scale {scale_label(study_scale)}")
    top = max(fractions, default=1.0) or 1.0
    for i, fmt in enumerate(FORMATS):
        y = -(0.06 + 0.06 * i) * top
        sub, normal, mx = (math.log2(fmt.min_subnormal), math.log2(fmt.min_normal), math.log2(fmt.max))
        ax.plot([sub, normal], [y, y], color=f"C{i + 2}", linewidth=4, alpha=0.4)
        ax.plot([normal, mx], [y, y], color=f"C{i + 2}", linewidth=4, label=f"{fmt.name} (pale: subnormal)")
    ax.axvline(math.log2(FORMATS[0].min_subnormal), color="grey", linestyle=":", linewidth=1)
    ax.set_xlim(lo, hi)
    ax.set(xlabel="log2 |value|", ylabel="fraction of values",
           title=f"{label}: magnitudes against each format's range")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return _save(fig, path)


def underflow_heatmap(layer_table, path: Path) -> Path:
    """Fraction of values flushed to zero, per layer (rows) and tensor kind × format (columns)."""
    from ampctl.analysis.numerics import FORMATS

    rows = layer_table.as_dicts()
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    kinds = [k for k in ("activation", "activation_grad", "weight_grad") if any(r["kind"] == k for r in rows)]
    columns = [(k, f.name) for k in kinds for f in FORMATS]
    by_key = {(r["layer"], r["kind"]): r for r in rows}
    grid = [[(by_key.get((layer, k)) or {}).get(f"{fmt}_to_zero", float("nan")) for k, fmt in columns]
            for layer in layers]
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(columns) + 3), max(3, 0.28 * len(layers) + 1.5)))
    image = ax.imshow(grid, aspect="auto", cmap="magma_r", vmin=0, vmax=max(1e-6, max(
        (v for row in grid for v in row if v == v), default=1e-6)))
    ax.set_xticks(range(len(columns)), [f"{k.replace('activation', 'act').replace('weight', 'w')}\n{f}"
                                        for k, f in columns], fontsize=7)
    ax.set_yticks(range(len(layers)), layers, fontsize=7)
    ax.set_title("fraction flushed to zero (no loss scale)")
    fig.colorbar(image, ax=ax, fraction=0.03)
    return _save(fig, path)
