"""The report's PNG charts (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple, Optional, Sequence

from ampctl import io
from ampctl.reports.runs import RunRecord

# Curves of modes that agree (fp32 and bf16 often do) lie on top of each other: vary the dash too.
LINESTYLES = ("-", "--", "-.", ":")


def pyplot() -> Any:
    """matplotlib's pyplot, imported (~2 s) only when a chart is drawn, never by a run that draws none; the Agg
    backend: files only, works on headless machines and never opens a window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def run_context(runs: Sequence[tuple[str, RunRecord]]) -> str:
    """What the runs are and where they ran, for a title: `recipe=gpt · fp32, bf16 · 200 steps · NVIDIA H100`."""
    summaries = [run.summary or {} for _, run in runs]
    recipes = list(dict.fromkeys(str(s.get("recipe_title") or s["recipe"]) for s in summaries if s.get("recipe")))
    modes = list(dict.fromkeys(str(s.get("precision_scheduled") or s.get("precision_choice") or s["precision"])
                               for s in summaries if s.get("precision")))
    steps = max((r["step"] for _, run in runs for r in run.metrics[-1:]), default=0)
    devices = list(dict.fromkeys(f"{s['device_name']} ({s['device']})" if s.get("device") == "cpu" else
                                 str(s["device_name"]) for s in summaries if s.get("device_name")))
    parts = [f"recipe={'/'.join(recipes)}" if recipes else "", ", ".join(modes),
             io.count_of(steps, "step") if steps else "", ", ".join(devices)]
    return " · ".join(p for p in parts if p)


def recipe_label(cfg: Any) -> str:
    """The recipe as the user chose it (`gpt`, a -cd option, `timm (vit_base_patch16_224)`), from Hydra's group
    choices; else its class."""
    from hydra.core.hydra_config import HydraConfig

    from ampctl.recipes.base import recipe_title

    choice = HydraConfig.get().runtime.choices.get("recipe") if HydraConfig.initialized() else None
    return recipe_title(str(choice or cfg.recipe._target_.rsplit(".", 1)[-1]), cfg.recipe)


def legend_outside(ax) -> None:
    """The legend right of the axes: it never covers a curve."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8)


def loss_curves(runs: Sequence[tuple[str, RunRecord]], path: Path, title: str,
                baseline: Optional[str] = None) -> Path:
    """Loss per step; with a baseline among several runs, a second panel of each run's loss minus the
    baseline's at the same step (curves that agree hide each other in the first)."""
    against = dict(runs).get(baseline) if baseline is not None and len(runs) > 1 else None
    if against is None:
        fig, ax = pyplot().subplots(figsize=(9, 4.5))
        axes = [ax]
    else:
        fig, axes = pyplot().subplots(2, 1, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for i, (label, run) in enumerate(runs):
        steps = [r["step"] for r in run.metrics]
        axes[0].plot(steps, [r["loss"] for r in run.metrics], label=label, linewidth=1.2,
                     linestyle=LINESTYLES[i % len(LINESTYLES)], color=f"C{i}")
        mark_switches(axes, run.summary, f"C{i}")
    axes[0].set(ylabel="loss", title=f"{title}\n{run_context(runs)}")
    if against is not None:
        base = {r["step"]: r["loss"] for r in against.metrics}
        for i, (label, run) in enumerate(runs):
            if label == baseline:
                continue
            common = [r for r in run.metrics if r["step"] in base]
            axes[1].plot([r["step"] for r in common], [r["loss"] - base[r["step"]] for r in common], label=label,
                         linewidth=1.0, linestyle=LINESTYLES[i % len(LINESTYLES)], color=f"C{i}")
        axes[1].axhline(0.0, color="grey", linewidth=0.8)
        axes[1].set(ylabel=f"loss − {baseline} loss")
    for ax in axes:
        ax.grid(alpha=0.3)
        legend_outside(ax)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    return save_figure(fig, path)


def mark_switches(axes: Sequence[Any], summary: Optional[dict], color: str) -> None:
    """precision.schedule's changes of a run: a dotted line between the last step of a mode and the first of the
    next, named at the top (→ bf16)."""
    for change in (summary or {}).get("schedule") or []:
        for ax in axes:
            ax.axvline(change["after_step"] + 0.5, color=color, linewidth=0.9, linestyle=":")
        axes[0].annotate(f"→ {change['precision']}", (change["after_step"] + 0.5, 1.0), color=color, fontsize=8,
                         xycoords=("data", "axes fraction"), xytext=(3, -10), textcoords="offset points")


def seed_band_curves(runs: Sequence[tuple[str, Sequence[RunRecord]]], path: Path, title: str,
                     baseline: Optional[str] = None) -> Path:
    """Each mode's loss per step as the mean over its seeds' runs with their range as a band; a second panel of
    each mode's mean minus the baseline's."""
    def by_step(records: Sequence[RunRecord]) -> tuple[list[int], list[float], list[float], list[float]]:
        losses: dict[int, list[float]] = {}
        for run in records:
            for r in run.metrics:
                losses.setdefault(r["step"], []).append(r["loss"])
        steps = sorted(s for s, v in losses.items() if len(v) == len(records))  # steps every seed reached
        return (steps, [sum(losses[s]) / len(losses[s]) for s in steps], [min(losses[s]) for s in steps],
                [max(losses[s]) for s in steps])

    curves = {mode: by_step(records) for mode, records in runs}
    against = curves.get(baseline) if baseline is not None and len(runs) > 1 else None
    fig, axes = pyplot().subplots(2 if against else 1, 1, figsize=(9, 7 if against else 4.5), sharex=True,
                                  squeeze=False, gridspec_kw={"height_ratios": [3, 2]} if against else None)
    top = axes[0][0]
    for i, (mode, (steps, mean, low, high)) in enumerate(curves.items()):
        seeds = len(dict(runs)[mode])
        top.plot(steps, mean, label=f"{mode} ({seeds} seeds)", color=f"C{i}", linewidth=1.2,
                 linestyle=LINESTYLES[i % len(LINESTYLES)])
        top.fill_between(steps, low, high, color=f"C{i}", alpha=0.2, linewidth=0)
    top.set(ylabel="loss", title=f"{title}\n{run_context([(m, rs[0]) for m, rs in runs])}")
    if against is not None:
        bottom = axes[1][0]
        base = dict(zip(against[0], against[1]))
        for i, (mode, (steps, mean, _, _)) in enumerate(curves.items()):
            if mode != baseline:
                common = [(s, m) for s, m in zip(steps, mean) if s in base]
                bottom.plot([s for s, _ in common], [m - base[s] for s, m in common], label=mode, color=f"C{i}",
                            linewidth=1.0, linestyle=LINESTYLES[i % len(LINESTYLES)])
        bottom.axhline(0.0, color="grey", linewidth=0.8)
        bottom.set(ylabel=f"mean loss − {baseline}'s")
    for row in axes:
        row[0].grid(alpha=0.3)
        legend_outside(row[0])
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    return save_figure(fig, path)


def held_out_points(values: dict[str, Sequence[float]], path: Path, title: str, context: str = "") -> Path:
    """Each mode's held-out metric: every seed's value as a dot, the seeds joined across modes (the runs they pair),
    the mean over seeds as a bar marker with its value. The axis is zoomed to the values: differences are the
    point, and no bar pretends to start at zero."""
    fig, ax = pyplot().subplots(figsize=(max(5.0, 1.3 * len(values) + 3), 4.4))
    labels = list(values)
    seeds = max(len(v) for v in values.values())
    for j in range(seeds):
        ax.plot(range(len(labels)), [v[j] if j < len(v) else float("nan") for v in values.values()], color="grey",
                alpha=0.5, linewidth=0.8, marker="o", markersize=4, zorder=2)
    means = [sum(v) / len(v) for v in values.values()]
    ax.scatter(range(len(labels)), means, marker="_", s=900, color="black", zorder=3, label="mean over seeds")
    for i, mean in enumerate(means):
        ax.annotate(f"{mean:.4f}", (i, mean), textcoords="offset points", xytext=(24, -3), fontsize=8)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlim(-0.6, len(labels) - 0.4)
    ax.set(ylabel="held-out loss", title=title + (f"\n{context}" if context else ""))
    ax.grid(axis="y", alpha=0.3)
    legend_outside(ax)
    fig.tight_layout()
    return save_figure(fig, path)


def loss_scale_curves(runs: Sequence[tuple[str, RunRecord]], path: Path, title: str) -> Optional[Path]:
    """Loss scale over steps with skipped steps marked; only for runs that scale (None if there are none)."""
    scaled = [(label, run) for label, run in runs if any(r["loss_scale"] != 1.0 for r in run.metrics)]
    if not scaled:
        return None
    fig, ax = pyplot().subplots(figsize=(9, 4.5))
    for i, (label, run) in enumerate(scaled):
        steps = [r["step"] for r in run.metrics]
        (line,) = ax.plot(steps, [r["loss_scale"] for r in run.metrics], label=label, linewidth=1.2,
                          linestyle=LINESTYLES[i % len(LINESTYLES)])
        skipped = [r for r in run.metrics if r["skipped"]]
        if skipped:
            ax.scatter([r["step"] for r in skipped], [r["loss_scale"] for r in skipped], marker="x",
                       color=line.get_color(), label=f"{label}: {len(skipped)} skipped", zorder=3)
    ax.set_yscale("log", base=2)
    ax.set(xlabel="step", ylabel="loss scale (log2)", title=f"{title}\n{run_context(scaled)}")
    ax.grid(alpha=0.3)
    legend_outside(ax)
    fig.tight_layout()
    return save_figure(fig, path)


class ModeBars(NamedTuple):
    """One mode's bars in compare's throughput and memory plot."""

    label: str
    throughput: Any  # an Interval: the median of the rounds and their range
    speedup: Any  # an Interval: the median ratio and its interval
    memory_mib: Optional[float]  # None: not measured (a compiled run on a CPU)
    memory_ratio: Optional[float]


def throughput_memory_bars(modes: Sequence[ModeBars], throughput_unit: str, baseline: str, path: Path,
                           context: str = "") -> Path:
    labels, throughput, speedup = [m.label for m in modes], [m.throughput for m in modes], [m.speedup for m in modes]
    memory_mib, memory_ratio = [m.memory_mib for m in modes], [m.memory_ratio for m in modes]
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(10, 4.4))
    rates = [t.value for t in throughput]
    error = [[t.value - t.low for t in throughput], [t.high - t.value for t in throughput]]
    bars = left.bar(labels, rates, yerr=error, capsize=4, color="tab:blue", ecolor="black")
    left.bar_label(bars, labels=[f"{r.value:.2f}×" + ("" if r.low == r.high else f"\n({r.low:.2f}-{r.high:.2f})")
                                 for r in speedup], padding=2, fontsize=8)
    bars = right.bar(labels, [v or 0.0 for v in memory_mib], color="tab:blue")
    right.bar_label(bars, labels=["not measured" if r is None else f"{r:.2f}×" for r in memory_ratio], padding=2)
    for ax, values, ylabel in ((left, [t.high for t in throughput], throughput_unit),
                               (right, memory_mib, "peak memory (MiB)")):
        ax.set_ylabel(ylabel)
        ax.set_ylim(0, max([v or 0.0 for v in values] + [1e-9]) * 1.25)
        ax.grid(axis="y", alpha=0.3)
        if sum(len(label) for label in labels) > 40:  # rows named with their optimizer: slanted, not overlapping
            ax.tick_params(axis="x", labelrotation=20)
            pyplot().setp(ax.get_xticklabels(), ha="right", rotation_mode="anchor")
    left.set_title(f"throughput: rounds' median and range\n(speedup vs {baseline}, its interval)")
    right.set_title(f"peak memory (ratio to {baseline})")
    if context:
        fig.suptitle(context, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def memory_bars(labels: Sequence[str], parts: dict[str, Sequence[Optional[int]]], peaks: Sequence[Optional[int]],
                path: Path, context: str = "") -> Path:
    """`ampctl memory`: each mode's estimate as stacked parts (weights, gradients, masters, optimizer states,
    activations), the measured peak beside it as a black bar; MiB."""
    fig, ax = pyplot().subplots(figsize=(max(6.0, 1.3 * len(labels) + 4), 4.8))
    positions = range(len(labels))
    bottom = [0.0] * len(labels)
    for i, (part, values) in enumerate(parts.items()):
        mib = [(v or 0) / 2**20 for v in values]
        ax.bar([p - 0.18 for p in positions], mib, width=0.36, bottom=bottom, label=part, color=f"C{i}")
        bottom = [b + m for b, m in zip(bottom, mib)]
    measured = [None if p is None else p / 2**20 for p in peaks]
    bars = ax.bar([p + 0.18 for p in positions], [m or 0.0 for m in measured], width=0.36, color="black",
                  label="measured peak")
    ax.bar_label(bars, labels=["not measured" if m is None else f"{m:,.1f}" for m in measured], padding=2, fontsize=8)
    ax.set_xticks(list(positions), labels)
    ax.set(ylabel="MiB", title="estimated parts (left) and the measured peak (right), per mode"
           + (f"\n{context}" if context else ""))
    ax.grid(axis="y", alpha=0.3)
    legend_outside(ax)
    fig.tight_layout()
    return save_figure(fig, path)


def save_figure(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    return path


def speed_and_accuracy(points: Sequence[dict[str, Any]], chosen: str, path: Path, title: str,
                       context: str = "") -> Path:
    """ampctl advise's evidence in one picture: each compared mode's speedup over fp32 (x, with its interval from
    the rounds) against its held-out loss minus fp32's (y, with its 95% interval over seeds). Up-left is worse on
    both; the advised mode is drawn filled. points: mode, speedup, speedup_low, speedup_high, delta, delta_interval."""
    fig, ax = pyplot().subplots(figsize=(6.4, 4.6))
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.axhline(0.0, color="grey", linewidth=0.8, linestyle="--")
    for i, p in enumerate(sorted(points, key=lambda p: p["speedup"])):
        x, y = p["speedup"], p.get("delta") or 0.0
        xerr = [[x - (p.get("speedup_low") or x)], [(p.get("speedup_high") or x) - x]]
        yerr = [[p.get("delta_interval") or 0.0], [p.get("delta_interval") or 0.0]]
        filled = p["mode"] == chosen
        ax.errorbar([x], [y], xerr=xerr, yerr=yerr, fmt="o", capsize=3, markersize=7,
                    markerfacecolor="black" if filled else "white", color="black", zorder=3)
        ax.annotate(p["mode"] + (" (advised)" if filled else ""), (x, y), textcoords="offset points",
                    xytext=(7, 6 if i % 2 == 0 else -13), fontsize=8)  # neighbours alternate: no overlap
    ax.set_xscale("log")
    times = pyplot().FuncFormatter(lambda v, _pos: f"{v:g}x")
    ax.xaxis.set_major_formatter(times)
    ax.xaxis.set_minor_formatter(times)
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set(xlabel="speed against fp32 (x; its interval over the rounds)",
           ylabel="held-out loss minus fp32's (± 95% over seeds)", title=title + (f"\n{context}" if context else ""))
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return save_figure(fig, path)


def layer_errors(rows: Sequence[dict[str, Any]], allowed: Optional[float], path: Path, title: str,
                 context: str = "") -> Path:
    """Each layer's local relative error (output, dgrad, wgrad) along the model's depth, on a log scale; the
    gradient error the yardstick allows drawn across (the whole model's, for scale: a layer's local error far
    under it adds little). A layer with no error, or none of a kind, has no point."""
    ordered = sorted(rows, key=lambda r: r["depth"])
    fig, ax = pyplot().subplots(figsize=(max(9.0, 0.18 * len(ordered) + 5), 4.6))
    for key, label, marker in (("out_local", "output", "o"), ("dgrad_local", "gradient to its input", "s"),
                               ("wgrad_local", "weight gradient", "^")):
        points = [(i, r[key]) for i, r in enumerate(ordered) if r.get(key) and 0 < r[key] < float("inf")]
        if points:
            ax.scatter(*zip(*points), marker=marker, s=18, label=label, zorder=3)
    if allowed:
        ax.axhline(allowed, color="red", linestyle="--", linewidth=1,
                   label="gradient error the yardstick allows (noise x diff.noise_share)")
    ax.set_yscale("log")
    step = max(1, len(ordered) // 30)  # at most ~30 names along the axis
    ax.set_xticks(range(0, len(ordered), step), [ordered[i]["layer"] for i in range(0, len(ordered), step)],
                  rotation=90, fontsize=7)
    ax.set(ylabel="local relative RMS error", title=title + (f"\n{context}" if context else ""))
    ax.grid(axis="y", alpha=0.3)
    legend_outside(ax)
    fig.tight_layout()
    return save_figure(fig, path)


def layer_error_heatmap(rows: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    """train.diff.every's record (diffs.jsonl): each layer's largest local error (output, dgrad, wgrad) at each
    measured step, on a log colour scale; where a layer starts to drift shows as its row changing colour."""
    from matplotlib.colors import LogNorm

    layers = list(rows[0]["layers"])
    steps = [row["step"] for row in rows]

    def largest(layer: dict[str, Any]) -> float:
        values = [float("inf") if v == "inf" else v for k, v in layer.items() if k.endswith("_local") and v is not None]
        return max(values, default=float("nan"))

    grid = [[largest(row["layers"].get(name, {})) for row in rows] for name in layers]
    finite = [v for line in grid for v in line if 0 < v < float("inf")]
    fig, ax = pyplot().subplots(figsize=(max(6.0, 0.35 * len(steps) + 4), max(3.0, 0.22 * len(layers) + 1.5)))
    image = ax.imshow([[min(max(v, min(finite, default=1e-8)), max(finite, default=1.0)) if v == v else v
                        for v in line] for line in grid], aspect="auto", cmap="viridis",
                      norm=LogNorm(vmin=min(finite, default=1e-8), vmax=max(finite, default=1.0)))
    ax.set_yticks(range(len(layers)), layers, fontsize=7)
    every = max(1, len(steps) // 20)
    ax.set_xticks(range(0, len(steps), every), [str(s) for s in steps[::every]], fontsize=7)
    ax.set(xlabel="step", title=title)
    fig.colorbar(image, ax=ax, label="largest local relative error (output, dgrad, wgrad)")
    fig.tight_layout()
    return save_figure(fig, path)


def block_scale_heatmap(rows: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    """telemetry.blocks_every's record (blocks.jsonl): the share of each layer's values its format flushed to zero at
    each measured step, one panel per operand (activations, weights, gradients); a layer whose blocks start losing
    its small values shows as its row brightening."""
    roles = ("activation", "weight", "gradient")
    layers = list(rows[0]["layers"])
    steps = [row["step"] for row in rows]
    size = (max(9.0, 0.3 * len(steps) * len(roles) + 5), max(3.0, 0.22 * len(layers) + 1.8))
    fig, axes = pyplot().subplots(1, len(roles), sharey=True, figsize=size, constrained_layout=True)
    grids = {role: [[row["layers"].get(name, {}).get(role, {}).get("flushed", float("nan")) for row in rows]
                    for name in layers] for role in roles}
    top = max((v for grid in grids.values() for line in grid for v in line if v == v), default=0.0) or 1.0
    every = max(1, len(steps) // 10)
    for ax, role in zip(axes, roles):
        image = ax.imshow(grids[role], aspect="auto", cmap="magma", vmin=0.0, vmax=top)
        ax.set_xticks(range(0, len(steps), every), [str(s) for s in steps[::every]], fontsize=7)
        ax.set(xlabel="step", title=f"{role}s")
    axes[0].set_yticks(range(len(layers)), layers, fontsize=7)
    fig.suptitle(title)
    fig.colorbar(image, ax=list(axes), label="share of values flushed to zero")
    return save_figure(fig, path)


def expert_load_curves(rows: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    """A mixture of experts' load over training (experts.jsonl): each MoE layer's busiest expert over the mean at each
    read (1: balanced; with a capacity, dotted, the share of its pairs dropped), and each layer's experts' shares of
    the tokens over the last interval."""
    layers = list(rows[-1]["layers"])
    fig, (over, shares) = pyplot().subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    steps = [row["step"] for row in rows]
    for i, name in enumerate(layers):
        over.plot(steps, [row["layers"].get(name, {}).get("max_over_mean") for row in rows], label=name,
                  color=f"C{i % 10}", linestyle=LINESTYLES[i % len(LINESTYLES)], linewidth=1.2)
    over.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    over.set(xlabel="step", ylabel="busiest expert's tokens / mean", title="load balance")
    if any("dropped" in row for row in rows):  # a capacity: the share of each layer's pairs dropped past it
        drops = over.twinx()
        for i, name in enumerate(layers):
            drops.plot(steps, [row["layers"].get(name, {}).get("dropped") for row in rows], color=f"C{i % 10}",
                       linestyle=":", linewidth=1.0, alpha=0.8)
        drops.set_ylabel("dotted: share of (token, k) pairs dropped past capacity")
        drops.set_ylim(bottom=0.0)
    over.grid(alpha=0.3)
    grid = [rows[-1]["layers"][name]["shares"] for name in layers]
    image = shares.imshow(grid, aspect="auto", cmap="viridis", vmin=0.0)
    shares.set_yticks(range(len(layers)), layers, fontsize=7)
    shares.set(xlabel="expert", title=f"shares of the tokens, step {steps[-1]}")
    fig.colorbar(image, ax=shares, label="share")
    over.legend(fontsize=7, loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)
