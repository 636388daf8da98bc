"""Pictures of the selection from a statistics object alone: the paper's Figures 1 and 4-7 and its table
of high-contribution experts.

matplotlib's Agg canvas is used directly (no pyplot, no display, no global backend change); every file is written
atomically. What :func:`write_plots` writes: docs/usage.md ("Plots").
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..collect.statistics import LayerStats, MoEStats
from ..io import atomic_path, check_writable
from ..methods.omp import GramPursuit
from ..planning.method_registry import get_method
from ..planning.plan import LayerPlan, PruningPlan
from ..planning.selection import PursuitResult, greedy_pursuit, routing_coverage
from ..progress import progress as progress_bar


def require_matplotlib(owner: str) -> None:
    """Fail before calibration when plots are asked for and matplotlib is missing (``owner``: who asked)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(
            f"{owner}(plots=True) writes PNG plots with matplotlib, which is not installed: "
            "pip install matplotlib (or ompmoe[plots]), or pass plots=False."
        ) from None


HEATMAPS = "heatmaps.png"
RESIDUAL_CURVES = "residual_curves.png"
RESIDUAL_OVERVIEW = "residual_overview.png"
HIGH_CONTRIBUTION_MD = "high_contribution.md"
HIGH_CONTRIBUTION_CSV = "high_contribution.csv"
RESIDUAL_CSV = "residual_curves.csv"
ALLOCATION = "allocation.png"
ALLOCATION_CSV = "allocation.csv"
PLOT_FILES = (HEATMAPS, RESIDUAL_CURVES, RESIDUAL_OVERVIEW, RESIDUAL_CSV, HIGH_CONTRIBUTION_MD, HIGH_CONTRIBUTION_CSV)
"""Written always."""
PLAN_PLOT_FILES = (ALLOCATION, ALLOCATION_CSV)
"""Written in addition when a plan is given."""
HIGH_CONTRIBUTION_THRESHOLD = 0.1
LOSS_ALLOCATIONS = ("loss", "loss_risk")
"""Allocations that minimize estimated loss (nats per token) rather than the paper's residual and routing risk."""


@dataclass
class HighContributionExpert:
    """One layer whose first greedy pick alone leaves a residual ``r_l(1)`` below the threshold."""

    layer: str
    layer_index: int
    expert: int
    residual: float
    """``r_l(1) = ||Y - V_e||^2 / ||Y||^2``."""
    token_share: float
    """Fraction of the layer's calibration tokens routed to the expert."""


def layer_index(name: str, position: int) -> int:
    """Decoder-layer number in a module name (``model.layers.3.mlp`` -> 3), else ``position``."""
    match = re.search(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)(?:\.|$)", name)
    return int(match.group(1)) if match else position


def _pursuit(layer: LayerStats) -> PursuitResult:
    return greedy_pursuit(layer.gram, num_groups=layer.num_groups, with_gains=False)


def high_contribution_experts(
    stats: MoEStats, threshold: float = HIGH_CONTRIBUTION_THRESHOLD
) -> list[HighContributionExpert]:
    """Layers where the expert OMP picks first leaves ``r_l(1) < threshold`` (paper: 0.1)."""
    rows = []
    for position, layer in enumerate(stats.layers):
        if layer.signal_energy <= 0.0:
            continue
        result = _pursuit(layer)
        residual = float(result.residual[1])
        if residual < threshold:
            expert = int(result.order[0])
            tokens = float(stats.num_tokens)  # token_count counts routed experts' pairs (not identity experts')
            share = float(layer.token_count[expert]) / tokens if tokens > 0 else 0.0
            rows.append(HighContributionExpert(layer.name, layer_index(layer.name, position), expert, residual, share))
    return rows


def _csv(header: list[str], rows: Sequence[Sequence[object]]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows([header, *rows])
    return buffer.getvalue()


def high_contribution_table(rows: Sequence[HighContributionExpert], fmt: str = "markdown",
                            threshold: float = HIGH_CONTRIBUTION_THRESHOLD) -> str:
    """The rows as a Markdown table (``fmt="markdown"``) or CSV (``fmt="csv"``); with no rows, the Markdown starts
    with a sentence saying that no layer reached ``threshold``."""
    if fmt == "csv":
        return _csv(
            ["layer", "layer_index", "expert", "residual_r1", "token_share"],
            [[row.layer, row.layer_index, row.expert, repr(row.residual), repr(row.token_share)] for row in rows],
        )
    if fmt != "markdown":
        raise ValueError(f"Unknown table format {fmt!r}; choose 'markdown' or 'csv'.")
    lines = ["| Layer | Layer index | Expert ID | Residual r_l(1) | Routed-token share |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {row.layer} | {row.layer_index} | {row.expert} | {row.residual:.4f} | {row.token_share:.3f} |"
              for row in rows]
    table = "\n".join(lines) + "\n"
    if rows:
        return table
    return (f"No layer qualifies: in every layer the first expert picked leaves r_l(1) >= {threshold:g} "
            f"(no single expert reconstructs {1 - threshold:.0%} of its layer's routed output).\n\n" + table)


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=120, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _panels(count: int, max_columns: int, size: tuple[float, float], margin: tuple[float, float], title: str):
    """A figure of ``count`` panels of ``size`` inches in rows of at most ``max_columns`` (the spare ones hidden),
    ``margin`` inches added for titles and legends; returns the figure, its axes grid and the number of columns."""
    columns = max(1, min(count, max_columns))
    rows = math.ceil(count / columns)
    figure = _figure(size[0] * columns + margin[0], size[1] * rows + margin[1])
    figure.suptitle(title)
    axes = figure.subplots(rows, columns, squeeze=False)
    for ax in list(axes.flat)[count:]:
        ax.set_axis_off()
    return figure, axes, columns


def _save(figure, path: Path, overwrite: bool) -> None:
    with atomic_path(path, overwrite=overwrite) as tmp:
        figure.savefig(tmp, format="png")


def _layer_ticks(layers: Sequence[LayerStats | LayerPlan], most: int) -> tuple[list[int], list[str]]:
    """Positions of at most about ``most`` evenly spaced layers and their decoder-layer numbers."""
    positions = list(range(0, len(layers), max(1, len(layers) // most)))
    return positions, [str(layer_index(layers[i].name, i)) for i in positions]


def heatmap_layers(num_layers: int, max_layers: int = 12) -> list[int]:
    """Positions of the layers drawn in the heatmaps: all, or ``max_layers`` evenly spaced ones
    (first and last included), since a 48 x 128 grid of 128-row panels is unreadable."""
    if num_layers <= max_layers:
        return list(range(num_layers))
    return sorted({round(i * (num_layers - 1) / (max_layers - 1)) for i in range(max_layers)})


def heatmap_pursuit(plan: PruningPlan | None) -> tuple[str, Callable[[LayerStats], torch.Tensor]]:
    """The pursuit a heatmap shows, by name, and the Gram it runs on: the plan's method when it is a greedy pursuit
    (``omp``, ``omp_normalized``, ``omp_loss``, ...), so the picture is the order the plan used; else the paper's."""
    if plan is not None:
        method = get_method(plan.method, plan.extra.get("method_options"))
        if isinstance(method, GramPursuit):
            return plan.method, method.pursued_gram
    return "omp", lambda layer: layer.gram


def heatmap_figure(stats: MoEStats, max_columns: int = 4, layers: Sequence[int] | None = None,
                   progress: bool | None = False, plan: PruningPlan | None = None):
    """Reconstruction-gain heatmaps (a matplotlib ``Figure``) on one shared logarithmic scale, of the plan's pursuit
    (:func:`heatmap_pursuit`). ``layers``: positions to draw (default :func:`heatmap_layers`). Gains below ``1e-6`` of
    the largest, and non-positive ones, are cyan."""
    from matplotlib.colors import LogNorm

    name, pursued_gram = heatmap_pursuit(plan)
    drawn = [(p, stats.layers[p]) for p in (layers if layers is not None else heatmap_layers(len(stats.layers)))]
    matrices = {}  # position: (gains with rows in selection order and NaN where not eligible, the order)
    for position, layer in progress_bar(drawn, "ompmoe heatmaps", progress, unit="layer"):
        gram = pursued_gram(layer)
        if float(gram.sum()) > 0.0:
            result = greedy_pursuit(gram, num_groups=layer.num_groups, with_gains=True)
            gains = (result.gains.T[result.order] / float(gram.sum())).numpy()
            matrices[position] = np.where(np.isneginf(gains), np.nan, gains), result.order.numpy()
    finite = [m[0][np.isfinite(m[0])] for m in matrices.values()]
    top = max((float(v.max()) for v in finite if v.size), default=1.0)
    top = top if top > 0 else 1.0
    smallest = min((float(v[v > 0].min()) for v in finite if (v > 0).any()), default=top * 1e-6)
    norm = LogNorm(vmin=max(top * 1e-6, smallest), vmax=top)
    most = max((layer.num_experts for _, layer in drawn), default=1)
    side = max(2.6, most * 3.0 / 120 + 0.8)  # inches: >= 3 px per expert row at 120 dpi
    title = f"Reconstruction gain $\\Delta_e / \\|Y\\|^2$ of every candidate at every greedy step of {name}"
    if plan is not None and name != plan.method:
        title += f" (the plan's method, {plan.method}, is no pursuit: this is the paper's order)"
    subset = len(drawn) < len(stats.layers)
    title += f"\n{len(drawn)} of {len(stats.layers)} layers, evenly spaced; " if subset else "\n"
    title += "grey: not eligible (already selected); cyan: no gain (below $10^{-6}$ of the largest, or negative)"
    figure, axes, _ = _panels(len(drawn), max_columns, (side, side), (1.2, 0.8), title)
    cmap = _colormap("magma").with_extremes(under="#00bcd4")
    image = None
    for ax, (position, layer) in zip(axes.flat, drawn):
        ax.set_title(f"layer {layer_index(layer.name, position)} ({layer.num_experts} experts)", fontsize=9)
        if position not in matrices:
            ax.text(0.5, 0.5, "no routed tokens", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        gains, order = matrices[position]
        shown = np.ma.masked_invalid(np.where(np.isfinite(gains), np.maximum(gains, norm.vmin / 2), np.nan))
        image = ax.imshow(shown, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest", origin="upper")
        ax.set_xlabel("selection step", fontsize=8)
        ax.set_ylabel("expert id (selection order)", fontsize=8)
        ticks = list(range(0, layer.num_experts, max(1, layer.num_experts // 16)))
        ax.set_yticks(ticks, [str(order[t]) for t in ticks], fontsize=6)
        ax.set_xticks(ticks, [str(t + 1) for t in ticks], fontsize=6)
    if image is not None:
        bar = figure.colorbar(image, ax=axes, fraction=0.03, pad=0.01, shrink=0.9, extend="min")
        bar.set_label("gain $\\Delta_e / \\|Y\\|^2$ (log scale, shared by all panels)")
    return figure


def _colormap(name: str):
    from matplotlib import colormaps

    return colormaps[name].with_extremes(bad="#d9d9d9")  # grey: not eligible at that step, or no data


def _curves(layer: LayerStats, zeta: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """OMP residual ``r(k)``, routing coverage ``C(k)`` and risk ``-log(C(k) + zeta)``, k = 0..N."""
    result = _pursuit(layer)
    coverage = routing_coverage(layer.routing_mass, result.order).numpy()
    risk = -np.log(np.clip(coverage, 0.0, None) + zeta)
    return result.residual.numpy(), coverage, risk


def residual_figure(stats: MoEStats, plan: PruningPlan | None = None, zeta: float = 1e-6, max_columns: int = 8,
                    progress: bool | None = False):
    """Per layer: OMP residual ``r_l(k)`` and routing risk ``-log(C_l(k) + zeta)`` (a ``Figure``)."""
    from matplotlib.ticker import MaxNLocator

    title = "Normalized residual $r_l(k)$ (OMP, blue) and routing risk $-\\log(C_l(k)+\\zeta)$ (orange)"
    if plan is not None:
        title += f"\nplan: {plan.method}/{plan.allocation}, ratio {plan.ratio:g}; red line and title: experts kept"
        if plan.allocation in LOSS_ALLOCATIONS:
            title += "\n(counts chosen by estimated loss: allocation.png)"  # a line of its own: 3 panels' width
    columns = min(max_columns, math.ceil(math.sqrt(len(stats.layers))))  # near-square: 6 layers -> 3 x 2 panels
    figure, axes, columns = _panels(len(stats.layers), columns, (3.2, 2.6), (0.0, 1.1), title)
    planned = {layer.name: layer for layer in plan.layers} if plan is not None else {}
    handles: dict[str, object] = {}
    items = list(zip(axes.flat, stats.layers))
    for position, (ax, layer) in enumerate(progress_bar(items, "ompmoe residual curves", progress, unit="layer")):
        chosen = planned.get(layer.name)
        kept = f" ({layer.num_experts} experts)" if chosen is None else f": kept {chosen.num_kept}/{layer.num_experts}"
        ax.set_title(f"layer {layer_index(layer.name, position)}{kept}", fontsize=10)
        if layer.signal_energy <= 0.0:
            ax.text(0.5, 0.5, "no routed tokens", ha="center", va="center", transform=ax.transAxes)
            continue
        residual, _, risk = _curves(layer, zeta)
        k = np.arange(layer.num_experts + 1)
        (line,) = ax.plot(k, residual, color="tab:blue", lw=1.3)
        handles.setdefault("residual r(k) (OMP)", line)
        ax.set_ylim(-0.02, 1.02)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        twin = ax.twinx()
        (line,) = twin.plot(k[1:], risk[1:], color="tab:orange", lw=1.0, ls="--")
        handles.setdefault("routing risk -log(C(k)+zeta)", line)
        twin.tick_params(labelsize=8, colors="tab:orange")
        if chosen is not None:
            if plan is not None and plan.method != "omp":
                (line,) = ax.plot(k, chosen.residual, color="tab:green", lw=1.0, ls=":")
                handles.setdefault(f"residual ({plan.method})", line)
            handles.setdefault("experts kept (plan)", ax.axvline(chosen.num_kept, color="tab:red", lw=1.0))
        if position % columns == 0:
            ax.set_ylabel("residual", fontsize=9, color="tab:blue")
        if position >= len(stats.layers) - columns:
            ax.set_xlabel("experts kept k", fontsize=9)
    figure.legend(list(handles.values()), list(handles), loc="outside lower center", ncols=len(handles), fontsize=10)
    return figure


def overview_figure(stats: MoEStats, plan: PruningPlan | None = None, progress: bool | None = False):
    """All layers' ``r_l(k)`` as one map (rows: layers, columns: k), the plan's kept counts marked; unlike the
    paper's Figure 1a (one curve per layer), it stays readable at any depth."""
    most = max(layer.num_experts for layer in stats.layers)
    residuals = np.full((len(stats.layers), most + 1), np.nan)
    for position, layer in enumerate(progress_bar(stats.layers, "ompmoe overview", progress, unit="layer")):
        if layer.signal_energy > 0.0:
            residuals[position, : layer.num_experts + 1] = _pursuit(layer).residual.numpy()
    figure = _figure(7.5, min(12.0, max(3.5, 0.12 * len(stats.layers) + 1.6)))
    ax = figure.subplots()
    image = ax.imshow(np.ma.masked_invalid(residuals), aspect="auto", cmap=_colormap("viridis"), vmin=0.0, vmax=1.0,
                      interpolation="nearest", origin="upper", extent=(-0.5, most + 0.5, len(stats.layers) - 0.5, -0.5))
    if np.isfinite(residuals).sum() > 3 and len(stats.layers) > 1:
        ax.contour(np.arange(most + 1), np.arange(len(stats.layers)), np.nan_to_num(residuals, nan=1.0), levels=[0.1],
                   colors="white", linewidths=0.8)
    if plan is not None:
        kept = [layer.num_kept for layer in plan.layers]
        ax.plot(kept, np.arange(len(kept)), "o", color="tab:red", ms=max(2.0, min(5.0, 120 / len(kept))),
                label=f"experts kept ({plan.method}/{plan.allocation}, ratio {plan.ratio:g})")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_yticks(*_layer_ticks(stats.layers, 16), fontsize=7)
    title = "Normalized residual $r_l(k)$ of every MoE layer (OMP); white: $r = 0.1$"
    if plan is not None:
        title += f"\nplan: {plan.method}/{plan.allocation}, ratio {plan.ratio:g}"
    ax.set(xlabel="experts kept k", ylabel="layer", title=title)
    figure.colorbar(image, ax=ax, label="normalized residual $r_l(k)$")
    return figure


def loss_estimates(stats: MoEStats, plan: PruningPlan) -> list[np.ndarray] | None:
    """Per layer, the estimated per-token loss increase of keeping ``k = 0..N`` experts of the plan's selection: what
    an allocation in loss units (:data:`LOSS_ALLOCATIONS`) chose the counts by; ``None`` for other allocations."""
    if plan.allocation not in LOSS_ALLOCATIONS:
        return None
    from ..methods.loss.selection import loss_curves

    selections = get_method(plan.method, plan.extra.get("method_options")).select(stats.layers)
    return loss_curves(stats.layers, selections, stats.num_tokens)


def allocation_figure(stats: MoEStats, plan: PruningPlan, estimates: list[np.ndarray] | None = None):
    """Experts kept per layer by the plan, against the uniform allocation of the same ratio; for an allocation by
    loss, below it the criterion it used: each layer's estimated loss increase at its kept count and at the uniform
    count (``estimates``: :func:`loss_estimates`, computed when not given)."""
    from matplotlib.ticker import MaxNLocator

    estimates = estimates if estimates is not None else loss_estimates(stats, plan)
    figure = _figure(max(6.0, min(14.0, 0.18 * len(plan.layers) + 3.0)), 3.8 if estimates is None else 6.8)
    figure.suptitle(f"plan: {plan.method}/{plan.allocation}, ratio {plan.ratio:g}")
    ax, *below = figure.subplots(1 if estimates is None else 2, 1, squeeze=False)[:, 0]
    x = np.arange(len(plan.layers))
    kept = np.array([layer.num_kept for layer in plan.layers])
    total = np.array([layer.num_experts for layer in plan.layers])
    uniform = total * (1.0 - plan.achieved_ratio)
    ax.bar(x, total, color="#e0e0e0", width=0.85, label="experts")
    ax.bar(x, kept, color="tab:blue", width=0.85, label=f"kept ({plan.method}/{plan.allocation})")
    ax.step(np.append(x, x[-1] + 1) - 0.5, np.append(uniform, uniform[-1]), where="post", color="tab:red", lw=1.2,
            label=f"uniform: keep {1.0 - plan.achieved_ratio:.3f} of each layer")
    ax.set_xticks(*_layer_ticks(plan.layers, 24), fontsize=7)
    ax.set(xlim=(-0.6, len(plan.layers) - 0.4), ylim=(0, total.max() * 1.3),  # room for the legend above the bars
           xlabel="layer", ylabel="experts",
           title=f"Allocation: kept {kept.sum()}/{total.sum()} routed experts (removed {plan.achieved_ratio:.3f})")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
    ax.grid(axis="y", alpha=0.3)
    if estimates is not None:
        _loss_panel(below[0], plan, estimates)
    return figure


def _loss_panel(ax, plan: PruningPlan, estimates: list[np.ndarray]) -> None:
    """Each layer's estimated loss increase at its kept count (bars) and at the uniform count (crosses)."""
    at_kept = np.array([curve[layer.num_kept] for curve, layer in zip(estimates, plan.layers)])
    uniform = [min(layer.num_experts, round(layer.num_experts * (1.0 - plan.achieved_ratio))) for layer in plan.layers]
    at_uniform = np.array([curve[k] for curve, k in zip(estimates, uniform)])
    x = np.arange(len(plan.layers))
    ax.bar(x, at_kept, color="tab:purple", width=0.85, label=f"at the kept count (sum {at_kept.sum():.3g})")
    ax.plot(x, at_uniform, "x", color="tab:red", label=f"at the uniform count (sum {at_uniform.sum():.3g})")
    ax.axhline(0.0, color="black", lw=0.6)
    risk = " (with its routing-risk term)" if plan.allocation == "loss_risk" else ""
    ax.set_xticks(*_layer_ticks(plan.layers, 24), fontsize=7)
    ax.set(xlim=(-0.6, len(plan.layers) - 0.4), xlabel="layer", ylabel="nats per token",
           title=f"Estimated loss increase $\\Delta L_l(k)$ per layer:\nthe criterion allocation {plan.allocation} "
                 f"minimized{risk}")
    ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
    ax.grid(axis="y", alpha=0.3)


def curves_csv(stats: MoEStats, zeta: float) -> str:
    """Every layer's OMP ``r_l(k)``, ``C_l(k)`` and risk for k = 0..N, one row per (layer, k)."""
    rows = []
    for position, layer in enumerate(stats.layers):
        if layer.signal_energy <= 0.0:
            continue
        residual, coverage, risk = _curves(layer, zeta)
        rows += [[layer.name, layer_index(layer.name, position), k, repr(float(residual[k])), repr(float(coverage[k])),
                  repr(float(risk[k]))] for k in range(layer.num_experts + 1)]
    return _csv(["layer", "layer_index", "k", "residual", "coverage", "risk"], rows)


def allocation_csv(plan: PruningPlan, estimates: list[np.ndarray] | None = None) -> str:
    """Per layer: experts, kept, the uniform count of the same ratio, and ``r(k)``, ``C(k)`` at the kept count; with
    ``estimates`` (:func:`loss_estimates`, a plan allocated by loss), ``loss_estimate``: the estimated per-token loss
    increase at the kept count, the numbers the allocation compared."""
    header = ["layer", "layer_index", "num_experts", "kept", "uniform_kept", "residual", "coverage"]
    rows = [[layer.name, layer_index(layer.name, position), layer.num_experts, layer.num_kept,
             repr(layer.num_experts * (1.0 - plan.achieved_ratio)), repr(float(layer.residual[layer.num_kept])),
             repr(float(layer.coverage[layer.num_kept]))] for position, layer in enumerate(plan.layers)]
    if estimates is not None:
        header.append("loss_estimate")
        for row, curve, layer in zip(rows, estimates, plan.layers):
            row.append(repr(float(curve[layer.num_kept])))
    return _csv(header, rows)


def write_plots(
    stats: MoEStats,
    output_dir: str | os.PathLike,
    plan: PruningPlan | None = None,
    *,
    zeta: float | None = None,
    threshold: float = HIGH_CONTRIBUTION_THRESHOLD,
    overwrite: bool = False,
    progress: bool | None = None,
) -> list[Path]:
    """Write the heatmaps, residual/risk curves (PNG and CSV) and high-contribution table into ``output_dir``;
    ``plan`` (made from these statistics) adds :data:`PLAN_PLOT_FILES`; ``zeta`` defaults to its, else ``1e-6``.
    Existing files are refused, unless ``overwrite``, before anything is drawn. Returns the written paths."""
    if plan is not None and ([layer.name for layer in plan.layers] != [layer.name for layer in stats.layers]
                             or plan.fingerprint != stats.fingerprint):
        raise ValueError(
            f"The plan (fingerprint {plan.fingerprint}) was not made from these statistics "
            f"(fingerprint {stats.fingerprint}); pass the plan written next to them."
        )
    zeta = zeta if zeta is not None else (plan.zeta if plan is not None else 1e-6)
    paths = {name: Path(output_dir, name) for name in PLOT_FILES + (PLAN_PLOT_FILES if plan is not None else ())}
    for path in paths.values():
        check_writable(path, overwrite)
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    _save(heatmap_figure(stats, progress=progress, plan=plan), paths[HEATMAPS], overwrite)
    _save(residual_figure(stats, plan, zeta, progress=progress), paths[RESIDUAL_CURVES], overwrite)
    _save(overview_figure(stats, plan, progress=progress), paths[RESIDUAL_OVERVIEW], overwrite)
    rows = high_contribution_experts(stats, threshold)
    texts = {
        RESIDUAL_CSV: curves_csv(stats, zeta),
        HIGH_CONTRIBUTION_MD: high_contribution_table(rows, "markdown", threshold),
        HIGH_CONTRIBUTION_CSV: high_contribution_table(rows, "csv"),
    }
    if plan is not None:
        estimates = loss_estimates(stats, plan)
        _save(allocation_figure(stats, plan, estimates), paths[ALLOCATION], overwrite)
        texts[ALLOCATION_CSV] = allocation_csv(plan, estimates)
    for name, text in texts.items():
        with atomic_path(paths[name], overwrite=overwrite) as tmp:
            tmp.write_text(text)
    return list(paths.values())


__all__ = [
    "HighContributionExpert", "PLAN_PLOT_FILES", "PLOT_FILES", "allocation_csv", "allocation_figure", "curves_csv",
    "heatmap_layers", "heatmap_figure", "heatmap_pursuit", "high_contribution_experts", "high_contribution_table",
    "LOSS_ALLOCATIONS", "loss_estimates", "overview_figure", "residual_figure", "write_plots",
]
