"""Tables and figure of ``benchmarks/quality.py``: rankings over (calibration, ratio) cells, per-cell tables.

Every function takes the rows of ``quality.csv`` (one per calibration x ratio x method x allocation,
plus one ``unpruned`` row) and uses only the values present, so partial sweeps report too.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

PAPER = ("omp", "waterfill")
"""The paper's method: Algorithm 1 with the water-fill allocation."""


def _ordered(values: list[Any]) -> list[Any]:
    return list(dict.fromkeys(values))


def cells(rows: list[dict[str, Any]]) -> list[tuple[str, float]]:
    return _ordered([(r["calibration"], r["ratio"]) for r in rows])


def pairs(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return _ordered([(r["method"], r["allocation"]) for r in rows])


def ranking(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method x allocation over all cells: wins (lowest geometric-mean perplexity of the cell, ties
    included), mean and max gap to the cell's best, mean ratio to the paper's omp/waterfill, mean KL."""
    index = {(r["calibration"], r["ratio"], r["method"], r["allocation"]): r for r in rows}
    all_cells = cells(rows)
    best = {c: min(r["ppl_mean"] for r in rows if (r["calibration"], r["ratio"]) == c) for c in all_cells}
    out = []
    for method, allocation in pairs(rows):
        mine = [(c, index.get((*c, method, allocation))) for c in all_cells]
        mine = [(c, r) for c, r in mine if r is not None]
        gaps = [r["ppl_mean"] / best[c] - 1 for c, r in mine]
        vs_paper = [r["ppl_mean"] / index[(*c, *PAPER)]["ppl_mean"] for c, r in mine if (*c, *PAPER) in index]
        out.append({
            "method": method, "allocation": allocation, "cells": len(mine),
            "wins": sum(g <= 1e-9 for g in gaps),
            "mean_gap": sum(gaps) / len(gaps), "max_gap": max(gaps),
            "vs_paper": math.exp(sum(math.log(v) for v in vs_paper) / len(vs_paper)) if vs_paper else float("nan"),
            "kl_mean": sum(r["kl_mean"] for _, r in mine) / len(mine),
            "calib_cost": max(r["calib_cost"] for _, r in mine),
            "calib_time_vs_forward": max(r.get("calib_time_vs_forward", math.nan) for _, r in mine),
            "calib_memory_vs_forward": max(r.get("calib_memory_vs_forward", math.nan) for _, r in mine),
        })
    return sorted(out, key=lambda r: r["mean_gap"])


def ranking_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| rank | method | allocation | wins | mean gap to best | max gap | ppl vs omp/waterfill (geo. mean) | mean KL | "
        "calibration cost |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(ranking(rows), 1):
        name = f"**{r['method']}**" if (r["method"], r["allocation"]) == PAPER else r["method"]
        out.append(f"| {i} | {name} | {r['allocation']} | {r['wins']}/{r['cells']} | {100 * r['mean_gap']:.1f}% | "
                   f"{100 * r['max_gap']:.1f}% | {100 * (r['vs_paper'] - 1):+.1f}% | {r['kl_mean']:.4f} | "
                   f"{calibration_cost_cell(r)} |")
    return "\n".join(out)


def calibration_cost_cell(r: dict[str, Any]) -> str:
    """``time / peak memory`` relative to a plain forward where known, else time relative to the statistics pass."""
    time_ratio, memory_ratio = r.get("calib_time_vs_forward", math.nan), r.get("calib_memory_vs_forward", math.nan)
    if math.isnan(time_ratio):
        return f"{r['calib_cost']:.2f}x stats"
    return f"{time_ratio:.2f}x / " + ("n/a" if math.isnan(memory_ratio) else f"{memory_ratio:.2f}x")


def summary(rows: list[dict[str, Any]]) -> str:
    lines = []
    for calibration, ratio in cells(rows):
        subset = [r for r in rows if r["calibration"] == calibration and r["ratio"] == ratio]
        ranked = sorted(subset, key=lambda r: r["ppl_mean"])
        top = ", ".join(f"{r['method']}/{r['allocation']} {r['ppl_mean']:.2f}" for r in ranked[:3])
        paper = next((r for r in subset if (r["method"], r["allocation"]) == PAPER), None)
        line = f"calibration {calibration:<5} ratio {ratio:<4}: best (geo-mean ppl) {top}"
        if paper is not None:
            rank = 1 + sum(r["ppl_mean"] < paper["ppl_mean"] - 1e-9 for r in subset)
            line += f"; omp/waterfill {paper['ppl_mean']:.2f} ranks {rank} of {len(subset)}"
        lines.append(line)
    return "\n".join(lines)


def cell_tables(rows: list[dict[str, Any]]) -> str:
    """Per cell: geometric-mean held-out perplexity (and mean KL) of every method x allocation."""
    index = {(r["calibration"], r["ratio"], r["method"], r["allocation"]): r for r in rows}
    methods = _ordered([r["method"] for r in rows])
    allocations = _ordered([r["allocation"] for r in rows])
    out = []
    for calibration, ratio in cells(rows):
        subset = [r for r in rows if (r["calibration"], r["ratio"]) == (calibration, ratio)]
        best = min(r["ppl_mean"] for r in subset)
        out += [f"**Calibration {calibration}, ratio {ratio}**: geometric-mean perplexity (prose, code) / mean KL; "
                "bold = lowest of the cell", "",
                "| method | " + " | ".join(allocations) + " |", "|---|" + "---:|" * len(allocations)]
        for method in methods:
            values = []
            for allocation in allocations:
                r = index.get((calibration, ratio, method, allocation))
                if r is None:
                    values.append("")
                    continue
                text = f"{r['ppl_mean']:.2f}"
                values.append(f"{'**' + text + '**' if r['ppl_mean'] == best else text} / {r['kl_mean']:.3f}")
            out.append(f"| {method} | " + " | ".join(values) + " |")
        out.append("")
    return "\n".join(out)


def figure(rows: list[dict[str, Any]], path: Path, top: int = 6) -> None:
    """Geometric-mean perplexity relative to the paper's omp/waterfill, per cell, for the best pairs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    index = {(r["calibration"], r["ratio"], r["method"], r["allocation"]): r for r in rows}
    all_cells = [c for c in cells(rows) if (*c, *PAPER) in index]
    if not all_cells:  # a sweep without the paper's pair has nothing to compare against
        return
    chosen = [(r["method"], r["allocation"]) for r in ranking(rows)[:top]]
    for extra in (PAPER, ("omp", "optimal"), ("reap", "waterfill")):
        if extra not in chosen and any((*c, *extra) in index for c in all_cells):
            chosen.append(extra)
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(all_cells)), 6))
    width = 0.8 / len(chosen)
    cmap = plt.get_cmap("tab10")
    for i, pair in enumerate(chosen):
        ys = [index[(*c, *pair)]["ppl_mean"] / index[(*c, *PAPER)]["ppl_mean"] if (*c, *pair) in index else float("nan")
              for c in all_cells]
        ax.bar([x + (i - len(chosen) / 2 + 0.5) * width for x in range(len(all_cells))], ys, width,
               color=cmap(i % 10), label="/".join(pair))
    ax.axhline(1.0, color="black", lw=1)
    values = [index[(*c, *pair)]["ppl_mean"] / index[(*c, *PAPER)]["ppl_mean"]
              for c in all_cells for pair in chosen if (*c, *pair) in index]
    ax.set_ylim(0.95 * min(values), 1.05 * max(values))
    ax.set_xticks(range(len(all_cells)))
    ax.set_xticklabels([f"cal {c}\nratio {r}" for c, r in all_cells], fontsize=8)
    ax.set_ylabel("geo-mean held-out ppl / omp+waterfill")
    ax.set_title("quality benchmark: best method x allocation pairs vs the paper (lower is better)")
    ax.legend(fontsize=8, ncol=min(len(chosen), 5), loc="upper center", bbox_to_anchor=(0.5, -0.15))
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
