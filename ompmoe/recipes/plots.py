"""Pictures of the selection: reconstruction-gain heatmaps, residual and routing-risk curves, and
the table of high-contribution experts (the paper's Figures 1 and 4-7 and its Table of
high-contribution experts), from a statistics object alone.

Uses matplotlib's Agg canvas directly (no pyplot, no display, no global backend change).
Every file is written atomically. ``write_plots(stats, output_dir, plan=None)`` writes:

- ``heatmaps.png``: per MoE layer, the gain ``Delta_e / ||Y||^2`` of every candidate (rows, in
  selection order) at every greedy step (columns); experts not eligible at a step (already
  selected, or in a group already picked this round) are blank.
- ``residual_curves.png``: per layer, the normalized residual ``r_l(k)`` (left axis) and the
  routing risk ``-log(C_l(k) + zeta)`` (right axis) against the number of experts kept; with a
  plan, its kept count is marked and a non-OMP plan's own residual curve is drawn dashed.
- ``residual_overview.png``: ``r_l(k)`` of all layers in one axes, coloured by depth.
- ``high_contribution.md`` / ``.csv``: layers whose first greedy pick alone leaves
  ``r_l(1) < 0.1`` (one expert reconstructs over 90% of the routed output).
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..engine.io import atomic_path, check_writable
from ..engine.plan import PruningPlan
from ..engine.selection import PursuitResult, greedy_pursuit, routing_coverage
from ..engine.statistics import LayerStats, MoEStats

HEATMAPS = "heatmaps.png"
RESIDUAL_CURVES = "residual_curves.png"
RESIDUAL_OVERVIEW = "residual_overview.png"
HIGH_CONTRIBUTION_MD = "high_contribution.md"
HIGH_CONTRIBUTION_CSV = "high_contribution.csv"
PLOT_FILES = (HEATMAPS, RESIDUAL_CURVES, RESIDUAL_OVERVIEW, HIGH_CONTRIBUTION_MD, HIGH_CONTRIBUTION_CSV)
HIGH_CONTRIBUTION_THRESHOLD = 0.1


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


def _pursuit(layer: LayerStats, with_gains: bool = True) -> PursuitResult:
    return greedy_pursuit(layer.gram, num_groups=layer.num_groups, with_gains=with_gains)


def high_contribution_experts(
    stats: MoEStats, threshold: float = HIGH_CONTRIBUTION_THRESHOLD
) -> list[HighContributionExpert]:
    """Layers where the expert OMP picks first leaves ``r_l(1) < threshold`` (paper: 0.1)."""
    rows = []
    for position, layer in enumerate(stats.layers):
        if layer.signal_energy <= 0.0:
            continue
        result = _pursuit(layer, with_gains=False)
        residual = float(result.residual[1])
        if residual < threshold:
            expert = int(result.order[0])
            tokens = float(layer.token_count.sum()) / max(layer.top_k, 1)
            share = float(layer.token_count[expert]) / tokens if tokens > 0 else 0.0
            rows.append(HighContributionExpert(layer.name, layer_index(layer.name, position), expert, residual, share))
    return rows


def high_contribution_table(rows: Sequence[HighContributionExpert], fmt: str = "markdown") -> str:
    """The rows as a Markdown table (``fmt="markdown"``) or CSV (``fmt="csv"``)."""
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(["layer", "layer_index", "expert", "residual_r1", "token_share"])
        for row in rows:
            writer.writerow([row.layer, row.layer_index, row.expert, repr(row.residual), repr(row.token_share)])
        return buffer.getvalue()
    if fmt != "markdown":
        raise ValueError(f"Unknown table format {fmt!r}; choose 'markdown' or 'csv'.")
    lines = [
        "| Layer | Layer index | Expert ID | Residual r_l(1) | Routed-token share |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {row.layer} | {row.layer_index} | {row.expert} | {row.residual:.4f} | {row.token_share:.3f} |"
        for row in rows
    ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------- figures
def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=120, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _grid(count: int, max_columns: int = 6) -> tuple[int, int]:
    columns = max(1, min(count, max_columns))
    return math.ceil(count / columns), columns


def _title(layer: LayerStats, position: int) -> str:
    return f"layer {layer_index(layer.name, position)} ({layer.num_experts} experts)"


def _save(figure, path: Path, overwrite: bool) -> Path:
    with atomic_path(path, overwrite=overwrite) as tmp:
        figure.savefig(tmp, format="png")
    return path


def heatmap_figure(stats: MoEStats, max_columns: int = 6):
    """Reconstruction-gain heatmaps of every layer (a matplotlib ``Figure``)."""
    rows, columns = _grid(len(stats.layers), max_columns)
    figure = _figure(3.2 * columns, 2.9 * rows)
    figure.suptitle("Reconstruction gain $\\Delta_e / \\|Y\\|^2$ of every candidate at every greedy step")
    axes = figure.subplots(rows, columns, squeeze=False)
    for position, (ax, layer) in enumerate(zip(axes.flat, stats.layers)):
        ax.set_title(_title(layer, position), fontsize=9)
        if layer.signal_energy <= 0.0:
            ax.text(0.5, 0.5, "no routed tokens", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        result = _pursuit(layer)
        assert result.gains is not None
        order = result.order.numpy()
        # rows: experts in selection order; columns: steps
        gains = (result.gains.T[result.order] / layer.signal_energy).numpy()
        matrix = np.ma.masked_invalid(np.where(np.isneginf(gains), np.nan, gains))
        cmap = _colormap("magma")
        image = ax.imshow(matrix, aspect="auto", cmap=cmap, interpolation="nearest", origin="upper")
        figure.colorbar(image, ax=ax, fraction=0.05, pad=0.02).ax.tick_params(labelsize=7)
        n = layer.num_experts
        ax.set_xlabel("selection step", fontsize=8)
        ax.set_ylabel("expert (selection order)", fontsize=8)
        ticks = list(range(n)) if n <= 16 else list(range(0, n, max(1, n // 8)))
        ax.set_yticks(ticks, [str(order[t]) for t in ticks], fontsize=6)
        ax.set_xticks(ticks, [str(t + 1) for t in ticks], fontsize=6)
    for ax in list(axes.flat)[len(stats.layers):]:
        ax.set_axis_off()
    return figure


def _colormap(name: str):
    from matplotlib import colormaps

    cmap = colormaps[name].copy()
    cmap.set_bad("#d9d9d9")  # blank: not eligible at that step
    return cmap


def _curves(layer: LayerStats, zeta: float) -> tuple[np.ndarray, np.ndarray]:
    result = _pursuit(layer, with_gains=False)
    coverage = routing_coverage(layer.routing_mass, result.order).numpy()
    risk = -np.log(np.clip(coverage, 0.0, None) + zeta)
    return result.residual.numpy(), risk


def residual_figure(stats: MoEStats, plan: PruningPlan | None = None, zeta: float = 1e-6, max_columns: int = 6):
    """Per layer: OMP residual ``r_l(k)`` and routing risk ``-log(C_l(k) + zeta)`` (a ``Figure``)."""
    rows, columns = _grid(len(stats.layers), max_columns)
    figure = _figure(3.2 * columns, 2.6 * rows)
    title = "Normalized residual $r_l(k)$ (OMP) and routing risk $-\\log(C_l(k)+\\zeta)$"
    if plan is not None:
        title += f"; plan: {plan.method}/{plan.allocation}, ratio {plan.ratio:g}"
    figure.suptitle(title)
    axes = figure.subplots(rows, columns, squeeze=False)
    planned = {layer.name: layer for layer in plan.layers} if plan is not None else {}
    for position, (ax, layer) in enumerate(zip(axes.flat, stats.layers)):
        ax.set_title(_title(layer, position), fontsize=9)
        if layer.signal_energy <= 0.0:
            ax.text(0.5, 0.5, "no routed tokens", ha="center", va="center", transform=ax.transAxes)
            continue
        residual, risk = _curves(layer, zeta)
        k = np.arange(layer.num_experts + 1)
        ax.plot(k, residual, color="tab:blue", lw=1.5, label="residual r(k) (OMP)")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("experts kept k", fontsize=8)
        ax.set_ylabel("residual", fontsize=8, color="tab:blue")
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        twin = ax.twinx()
        twin.plot(k[1:], risk[1:], color="tab:orange", lw=1.2, ls="--", label="risk -log(C(k)+zeta)")
        twin.set_ylabel("risk", fontsize=8, color="tab:orange")
        twin.tick_params(labelsize=7)
        chosen = planned.get(layer.name)
        if chosen is not None:
            if plan is not None and plan.method != "omp":
                ax.plot(k, chosen.residual, color="tab:green", lw=1.2, ls=":", label=f"residual ({plan.method})")
            ax.axvline(chosen.num_kept, color="tab:red", lw=1.0, label=f"kept {chosen.num_kept}")
        if position == 0:
            handles = ax.get_legend_handles_labels()
            twin_handles = twin.get_legend_handles_labels()
            ax.legend(handles[0] + twin_handles[0], handles[1] + twin_handles[1], fontsize=6, loc="upper right")
    for ax in list(axes.flat)[len(stats.layers):]:
        ax.set_axis_off()
    return figure


def overview_figure(stats: MoEStats):
    """``r_l(k)`` of every layer in one axes, coloured from shallow to deep (the paper's Figure 1a)."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    figure = _figure(6.0, 4.2)
    ax = figure.subplots()
    indices = [layer_index(layer.name, i) for i, layer in enumerate(stats.layers)]
    norm = Normalize(min(indices), max(max(indices), min(indices) + 1))
    cmap = colormaps["viridis"]
    for index, layer in zip(indices, stats.layers):
        if layer.signal_energy <= 0.0:
            continue
        residual = _pursuit(layer, with_gains=False).residual.numpy()
        ax.plot(np.arange(layer.num_experts + 1), residual, color=cmap(norm(index)), lw=1.2)
    ax.set_xlabel("experts kept k")
    ax.set_ylabel("normalized residual r_l(k)")
    ax.set_title("Normalized residual curves of all MoE layers (OMP)")
    ax.grid(alpha=0.3)
    figure.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="layer")
    return figure


def write_plots(
    stats: MoEStats,
    output_dir: str | os.PathLike,
    plan: PruningPlan | None = None,
    *,
    zeta: float | None = None,
    threshold: float = HIGH_CONTRIBUTION_THRESHOLD,
    overwrite: bool = False,
) -> list[Path]:
    """Write the heatmaps, residual/risk curves and high-contribution table into ``output_dir``.

    ``plan`` (made from these statistics) marks each layer's kept count; ``zeta`` defaults to
    the plan's, else ``1e-6``. Returns the written paths (see :data:`PLOT_FILES`). Existing
    files are refused unless ``overwrite``, before anything is drawn.
    """
    output_dir = Path(output_dir)
    if plan is not None:
        names = [layer.name for layer in stats.layers]
        if [layer.name for layer in plan.layers] != names or plan.fingerprint != stats.fingerprint:
            raise ValueError(
                f"The plan (fingerprint {plan.fingerprint}) was not made from these statistics "
                f"(fingerprint {stats.fingerprint}); pass the plan written next to them."
            )
    zeta = zeta if zeta is not None else (plan.zeta if plan is not None else 1e-6)
    paths = [output_dir / name for name in PLOT_FILES]
    for path in paths:
        check_writable(path, overwrite)
    output_dir.mkdir(parents=True, exist_ok=True)
    _save(heatmap_figure(stats), paths[0], overwrite)
    _save(residual_figure(stats, plan, zeta), paths[1], overwrite)
    _save(overview_figure(stats), paths[2], overwrite)
    rows = high_contribution_experts(stats, threshold)
    for path, fmt in ((paths[3], "markdown"), (paths[4], "csv")):
        with atomic_path(path, overwrite=overwrite) as tmp:
            tmp.write_text(high_contribution_table(rows, fmt))
    return paths


__all__ = [
    "HighContributionExpert",
    "PLOT_FILES",
    "heatmap_figure",
    "high_contribution_experts",
    "high_contribution_table",
    "overview_figure",
    "residual_figure",
    "write_plots",
]
