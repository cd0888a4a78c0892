"""`ampctl inspect`'s charts: gradient magnitudes against each format's range, and the underflow heatmap."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

from ampctl import io
from ampctl.analysis.numerics import FORMATS, LOG2_LOW
from ampctl.reports.plots import pyplot, save_figure


def gradient_ranges(counts: Sequence[int], total: int, label: str, study_scale: float, path: Path,
                    context: str = "") -> Path:
    """The loss-scaling picture for this model: the histogram of gradient magnitudes (counts per log2 bin,
    numerics.LOG2_LOW upwards, as fractions of all `total` values, zeros included), each format's range
    drawn under it, and the same histogram shifted by the loss scale."""
    fractions = [float(c) / max(total, 1) for c in counts]
    exponents = list(range(LOG2_LOW, LOG2_LOW + len(fractions)))
    used = [e for e, f in zip(exponents, fractions) if f > 0]
    shift = math.log2(study_scale)
    lo = min(min(used, default=-30), -26) - 2
    hi = max(max(used, default=0) + shift, 17) + 2
    fig, ax = pyplot().subplots(figsize=(9, 5))
    ax.bar(exponents, fractions, width=1.0, align="edge", color="tab:blue", alpha=0.75, label=label)
    ax.step([e + shift for e in exponents], fractions, where="post", color="tab:orange",
            label=f"× loss scale {io.scale_label(study_scale)}")
    top = max(fractions, default=1.0) or 1.0
    for i, fmt in enumerate(FORMATS):
        y = -(0.06 + 0.06 * i) * top
        sub, normal, mx = (math.log2(fmt.min_subnormal), math.log2(fmt.min_normal), math.log2(fmt.max))
        ax.plot([sub, normal], [y, y], color=f"C{i + 2}", linewidth=4, alpha=0.4)
        ax.plot([normal, mx], [y, y], color=f"C{i + 2}", linewidth=4, label=f"{fmt.name} (pale: subnormal)")
        # each format's limits, written on its bar: smallest subnormal, smallest normal, largest
        for x, text, align in ((sub, f"2^{sub:.0f}", "right"), (normal, f"2^{normal:.0f}", "center"),
                               (mx, f"max 2^{mx:.1f}".replace(".0", ""), "left")):
            ax.annotate(text, (x, y), xytext=(-3 if align == "right" else 3 if align == "left" else 0, -1),
                        textcoords="offset points", ha=align, va="top", fontsize=6, color=f"C{i + 2}")
    ax.axvline(math.log2(FORMATS[0].min_subnormal), color="grey", linestyle=":", linewidth=1)
    ax.set_xlim(lo, hi)
    ax.set(xlabel="log2 |value|", ylabel="fraction of values",
           title=f"{label}: magnitudes against each format's range" + (f"\n{context}" if context else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    return save_figure(fig, path)


def row_label(layer: str, module_type: Optional[str]) -> str:
    """A layer as a reader tells it apart: its name, and its type where the name is only a position (an
    nn.Sequential's 0, 1, 2: the MLP's layers)."""
    if module_type and layer.rsplit(".", 1)[-1].isdigit():
        return f"{layer} ({module_type})"
    return layer


def underflow_heatmap(layer_table, path: Path, context: str = "") -> Path:
    """Fraction of values flushed to zero, per layer (rows) and tensor kind × format (columns)."""
    rows = layer_table.as_dicts()
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    types = {r["layer"]: r.get("type") for r in rows}  # ranges.json before 0.1 has none
    kinds = [k for k in ("activation", "activation_grad", "weight_grad") if any(r["kind"] == k for r in rows)]
    columns = [(k, f.name) for k in kinds for f in FORMATS]
    by_key = {(r["layer"], r["kind"]): r for r in rows}
    grid = [[(by_key.get((layer, k)) or {}).get(f"{fmt}_to_zero", float("nan")) for k, fmt in columns]
            for layer in layers]
    import matplotlib  # here, as pyplot() is: a command that draws nothing never imports it

    fig, ax = pyplot().subplots(figsize=(max(6, 0.55 * len(columns) + 3), max(3, 0.28 * len(layers) + 1.5)))
    cmap = matplotlib.colormaps["magma_r"].with_extremes(bad="lightgrey")  # NaN: a layer without that kind of tensor
    image = ax.imshow(grid, aspect="auto", cmap=cmap, vmin=0, vmax=max(1e-6, max(
        (v for row in grid for v in row if v == v), default=1e-6)))
    ax.set_xticks(range(len(columns)), [f"{k.replace('activation', 'act').replace('weight', 'w')}\n{f}"
                                        for k, f in columns], fontsize=7)
    ax.set_yticks(range(len(layers)), [row_label(layer, types[layer]) for layer in layers], fontsize=7)
    empty = any(v != v for row in grid for v in row)
    ax.set_title("fraction of values flushed to zero in each format (no loss scale)"
                 + (f"\n{context}" if context else ""), fontsize=9)
    if empty:
        ax.set_xlabel("grey: the layer has no tensor of that kind (a layer without parameters has no weight "
                      "gradients)", fontsize=7)
    colorbar = fig.colorbar(image, ax=ax, fraction=0.03)
    colorbar.set_label("fraction of the tensor's values that become 0", fontsize=8)
    return save_figure(fig, path)
