"""Pruning quality on the shipped tiny MoE: every strategy x allocation x ratio x calibration domain.

    python benchmarks/quality.py                    # about 15-25 minutes on 2 CPU threads
    python benchmarks/quality.py --eval_blocks 8    # quicker, noisier

Model: ``shipped:tiny-moe`` (``ompmoe/data/tiny-moe``: Qwen3-MoE, 6 sparse layers of 16 experts,
top-4, trained here on the train split of the shipped corpus), in float32.

For each calibration set (``--calib_blocks`` blocks of ``--seq_len`` tokens from the calibration
split: ``prose``, ``code``, and ``mix`` = half the blocks from each, exactly what
``CalibrationDataModule("shipped:<name>")`` gives), each ratio in 0.25 / 0.5 / 0.75, each method of
:data:`ompmoe.METHODS` (``random`` with seed 0) and each allocation
(``uniform`` / ``waterfill`` / ``optimal``; ``risk_weight`` 3.0, ``max_ratio`` 0.875):

- ``min_ratio`` is the default 0.375 at ratios 0.25 and 0.5. At 0.75 every layer must keep 25% of
  its experts on average, which ``min_ratio = 0.375`` forbids, so **all strategies use
  ``min_ratio = 0.125`` at 0.75** (``uniform`` keeps 4 of 16 in every layer either way);
- ``recon``: the reconstruction error the plan leaves, ``mean over layers of
  ||Y_l - sum_{kept} V_e||^2 / ||Y_l||^2`` (the ``r_l(k_l)`` the allocation minimizes, original
  routing weights), on the calibration statistics and on statistics of the held-out blocks of each
  domain (same formula, held-out Gram);
- held-out perplexity per domain of the pruned model (``ompmoe.prune``; the router re-routes among
  the kept experts), on the first ``--eval_blocks`` non-overlapping ``--seq_len`` blocks of the
  domain's held-out split, every token after the first of a block predicted.

Writes ``quality.csv`` (every row), ``quality.md`` (the tables) and ``quality.png`` into
``--output_dir`` (default ``docs/quality``) and prints the tables.
"""

from __future__ import annotations

import argparse
import copy
import csv
import math
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # shared CPUs: spinning OpenMP threads stall each other
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import ompmoe  # noqa: E402
from ompmoe.engine.methods import removed_energy  # noqa: E402
from ompmoe.data import CORPUS_DOMAINS, corpus_token_stream, shipped_model_path, token_blocks  # noqa: E402
from ompmoe.engine.strategy import STRATEGIES, strategy_for  # noqa: E402

RATIOS = (0.25, 0.5, 0.75)
ALLOCATIONS = ("uniform", "waterfill", "optimal")
CALIBRATIONS = ("prose", "code", "mix")
ROOT = Path(__file__).resolve().parents[1]


def min_ratio_for(ratio: float) -> float:
    return 0.125 if ratio > 0.625 else 0.375


@torch.no_grad()
def perplexity(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int = 8) -> float:
    total, count = 0.0, 0
    for batch in blocks.split(batch_size):
        logits = model(input_ids=batch, use_cache=False).logits.float()
        total += float(torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(), reduction="sum"))
        count += batch[:, 1:].numel()
    return math.exp(total / count)


def reconstruction(stats: ompmoe.MoEStats, kept: dict[str, list[int]]) -> float:
    """Mean over layers of the normalized residual ``||Y - sum_kept V||^2 / ||Y||^2`` of the kept sets."""
    errors = []
    for layer in stats.layers:
        mask = torch.zeros(layer.num_experts, dtype=torch.bool)
        mask[kept[layer.name]] = True
        errors.append(float(removed_energy(layer.gram, mask)) / max(layer.signal_energy, 1e-30))
    return sum(errors) / len(errors)


def markdown_tables(rows: list[dict[str, Any]], base: dict[str, float]) -> str:
    methods = list(STRATEGIES)
    index = {(r["calibration"], r["ratio"], r["method"], r["allocation"]): r for r in rows}
    out = [f"Unpruned model: held-out perplexity prose {base['prose']:.2f}, code {base['code']:.2f}.", ""]
    for calibration in CALIBRATIONS:
        for ratio in RATIOS:
            out += [
                f"**Calibration {calibration}, ratio {ratio}** (min_ratio {min_ratio_for(ratio)}): reconstruction error on "
                "the calibration statistics / held-out perplexity prose / code",
                "",
                "| method | " + " | ".join(f"{a} recon | {a} prose | {a} code" for a in ALLOCATIONS) + " |",
                "|---|" + "---:|" * (3 * len(ALLOCATIONS)),
            ]
            best = {a: min(index[(calibration, ratio, m, a)]["ppl_mean"] for m in methods) for a in ALLOCATIONS}
            for method in methods:
                cells = []
                for allocation in ALLOCATIONS:
                    r = index[(calibration, ratio, method, allocation)]
                    mark = "**" if r["ppl_mean"] == best[allocation] else ""
                    cells += [f"{r['recon_calib']:.3f}", f"{mark}{r['ppl_prose']:.2f}{mark}", f"{mark}{r['ppl_code']:.2f}{mark}"]
                out.append(f"| {method} | " + " | ".join(cells) + " |")
            out.append("")
    return "\n".join(out)


def compact_table(rows: list[dict[str, Any]], base: dict[str, float], calibration: str = "mix") -> str:
    """One row per method x allocation: recon and held-out perplexity prose / code at each ratio."""
    index = {(r["calibration"], r["ratio"], r["method"], r["allocation"]): r for r in rows}
    out = [
        "| method | allocation | " + " | ".join(f"{ratio}: recon | prose | code" for ratio in RATIOS) + " |",
        "|---|---|" + "---:|" * (3 * len(RATIOS)),
        "| unpruned | | " + " | ".join(f"0 | {base['prose']:.1f} | {base['code']:.1f}" for _ in RATIOS) + " |",
    ]
    best = {(ratio, d): min(r[f"ppl_{d}"] for r in rows if r["calibration"] == calibration and r["ratio"] == ratio)
            for ratio in RATIOS for d in CORPUS_DOMAINS}
    for method in STRATEGIES:
        for allocation in ALLOCATIONS:
            cells = []
            for ratio in RATIOS:
                r = index[(calibration, ratio, method, allocation)]
                cells.append(f"{r['recon_calib']:.3f}")
                for d in CORPUS_DOMAINS:
                    value = f"{r[f'ppl_{d}']:.1f}"
                    cells.append(f"**{value}**" if r[f"ppl_{d}"] == best[(ratio, d)] else value)
            out.append(f"| {method} | {allocation} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def cross_domain_table(rows: list[dict[str, Any]], allocation: str = "waterfill") -> str:
    """Per method and ratio: perplexity on each domain when calibrated on it, on the other domain, on the mix."""
    index = {(r["calibration"], r["ratio"], r["method"], r["allocation"]): r for r in rows}
    out = [
        f"Held-out perplexity by calibration domain ({allocation} allocation). `own` = calibrated on the measured domain, "
        "`other` = calibrated on the other domain, `loss` = other / own - 1.",
        "",
        "| ratio | method | prose: own | other | mix | loss | code: own | other | mix | loss |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for ratio in RATIOS:
        for method in STRATEGIES:
            cells = []
            for domain, other in (("prose", "code"), ("code", "prose")):
                own = index[(domain, ratio, method, allocation)][f"ppl_{domain}"]
                wrong = index[(other, ratio, method, allocation)][f"ppl_{domain}"]
                mix = index[("mix", ratio, method, allocation)][f"ppl_{domain}"]
                cells += [f"{own:.2f}", f"{wrong:.2f}", f"{mix:.2f}", f"{100 * (wrong / own - 1):+.0f}%"]
            out.append(f"| {ratio} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def summary(rows: list[dict[str, Any]]) -> str:
    lines = []
    for calibration in CALIBRATIONS:
        for ratio in RATIOS:
            subset = [r for r in rows if r["calibration"] == calibration and r["ratio"] == ratio]
            ranked = sorted(subset, key=lambda r: r["ppl_mean"])
            omp = next(r for r in subset if r["method"] == "omp" and r["allocation"] == "waterfill")
            rank = 1 + sum(r["ppl_mean"] < omp["ppl_mean"] - 1e-9 for r in subset)  # ties share a rank
            top = ", ".join(f"{r['method']}/{r['allocation']} {r['ppl_prose']:.2f}/{r['ppl_code']:.2f}" for r in ranked[:3])
            lines.append(f"calibration {calibration:<5} ratio {ratio:<4}: best (prose/code ppl) {top}; omp/waterfill "
                         f"{omp['ppl_prose']:.2f}/{omp['ppl_code']:.2f} ranks {rank} of {len(subset)} (geometric mean of the two)")
    return "\n".join(lines)


def figure(rows: list[dict[str, Any]], base: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    methods = list(STRATEGIES)
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    fig, axes = plt.subplots(3, 3, figsize=(15, 13))
    index = {(r["calibration"], r["ratio"], r["method"], r["allocation"]): r for r in rows}
    for row, domain in enumerate(CORPUS_DOMAINS):
        for col, allocation in enumerate(ALLOCATIONS):
            ax = axes[row, col]
            for method in methods:
                ys = [index[("mix", ratio, method, allocation)][f"ppl_{domain}"] for ratio in RATIOS]
                style = dict(lw=2.6, marker="o") if method == "omp" else dict(lw=1.2, marker=".")
                ax.plot(RATIOS, ys, color=colors[method], label=method, **style)
            ax.axhline(base[domain], color="black", ls="--", lw=1, label="unpruned")
            ax.set_yscale("log")
            ax.set_xticks(RATIOS)
            ax.set_title(f"held-out {domain}, {allocation} (calibration: mix)")
            ax.set_xlabel("pruning ratio")
            ax.set_ylabel("perplexity")
            ax.grid(alpha=0.3, which="both")
    axes[0, 0].legend(fontsize=8, ncol=2)
    # Bottom row: domain-specific calibration at waterfill, per ratio; bars per method, groups per calibration.
    for col, ratio in enumerate(RATIOS):
        ax = axes[2, col]
        width = 0.8 / len(methods)
        groups = [(d, c) for d in CORPUS_DOMAINS for c in CALIBRATIONS]
        for i, method in enumerate(methods):
            ys = [index[(c, ratio, method, "waterfill")][f"ppl_{d}"] / base[d] for d, c in groups]
            ax.bar([g + (i - len(methods) / 2 + 0.5) * width for g in range(len(groups))], ys, width,
                   color=colors[method], label=method)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{d}\ncal {c}" for d, c in groups], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("perplexity / unpruned")
        ax.set_title(f"ratio {ratio}, waterfill: held-out domain x calibration")
        ax.grid(alpha=0.3, axis="y", which="both")
    plain = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")
    for ax in axes.flat:
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="minor", labelsize=7)
    fig.suptitle("ompmoe quality benchmark on shipped:tiny-moe (benchmarks/quality.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description="Pruning quality benchmark on shipped:tiny-moe (see module docstring).")
    parser.add_argument("--output_dir", default=str(ROOT / "docs" / "quality"))
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--calib_blocks", type=int, default=32)
    parser.add_argument("--eval_blocks", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", nargs="*", default=list(STRATEGIES))
    parser.add_argument("--from_csv", action="store_true", help="rebuild quality.md and quality.png from quality.csv")
    args = parser.parse_args(argv)
    if args.from_csv:
        return write_reports(read_csv(Path(args.output_dir) / "quality.csv"), args)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    start = time.perf_counter()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ompmoe.lightning.calibration_data import CalibrationDataModule

    path = shipped_model_path("tiny-moe")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    calib_blocks = {
        c: CalibrationDataModule(f"shipped:{c}", tokenizer=str(path), seq_len=args.seq_len, num_blocks=args.calib_blocks).blocks
        for c in CALIBRATIONS
    }
    eval_blocks = {
        d: token_blocks(corpus_token_stream(tokenizer, d, "heldout", max_tokens=args.eval_blocks * args.seq_len),
                        args.seq_len, args.eval_blocks)
        for d in CORPUS_DOMAINS
    }
    stats = {c: ompmoe.collect_stats(model, b.split(8), model_id="shipped:tiny-moe", source=f"shipped:{c}")
             for c, b in calib_blocks.items()}
    heldout_stats = {d: ompmoe.collect_stats(model, b.split(8), model_id="shipped:tiny-moe", source=f"heldout:{d}")
                     for d, b in eval_blocks.items()}
    base = {d: perplexity(model, eval_blocks[d]) for d in CORPUS_DOMAINS}
    print(f"unpruned held-out perplexity: prose {base['prose']:.3f}, code {base['code']:.3f} "
          f"({args.eval_blocks} x {args.seq_len} tokens each); setup {time.perf_counter() - start:.0f} s", flush=True)

    cache: dict[tuple, dict[str, float]] = {}
    rows = []
    for calibration in CALIBRATIONS:
        for ratio in RATIOS:
            for method in args.methods:
                for allocation in ALLOCATIONS:
                    strategy = strategy_for(method, ratio=ratio, allocation=allocation, min_ratio=min_ratio_for(ratio))
                    plan = strategy.plan(stats[calibration])
                    kept = plan.kept_by_layer()
                    key = tuple(tuple(kept[name]) for name in sorted(kept))
                    if key not in cache:
                        pruned = ompmoe.prune(copy.deepcopy(model), plan)
                        cache[key] = {d: perplexity(pruned, eval_blocks[d]) for d in CORPUS_DOMAINS}
                        del pruned
                    ppl = cache[key]
                    row = {
                        "calibration": calibration, "ratio": ratio, "method": method, "allocation": allocation,
                        "min_ratio": min_ratio_for(ratio), "achieved_ratio": round(plan.achieved_ratio, 4),
                        "kept_per_layer": "/".join(str(len(kept[layer.name])) for layer in plan.layers),
                        "recon_calib": reconstruction(stats[calibration], kept),
                        "recon_heldout_prose": reconstruction(heldout_stats["prose"], kept),
                        "recon_heldout_code": reconstruction(heldout_stats["code"], kept),
                        "ppl_prose": ppl["prose"], "ppl_code": ppl["code"],
                        "ppl_mean": math.sqrt(ppl["prose"] * ppl["code"]),
                    }
                    rows.append(row)
                    print(f"{calibration:<6}{ratio:<6}{method:<16}{allocation:<10} kept {row['kept_per_layer']:<18} "
                          f"recon {row['recon_calib']:.3f} (held-out {row['recon_heldout_prose']:.3f}/"
                          f"{row['recon_heldout_code']:.3f})  ppl prose {row['ppl_prose']:8.2f}  code {row['ppl_code']:8.2f}"
                          f"  [{time.perf_counter() - start:.0f} s, {len(cache)} pruned models]", flush=True)

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    base_rows = [{"calibration": "none", "ratio": 0.0, "method": "unpruned", "allocation": "", "min_ratio": "",
                  "achieved_ratio": 0.0, "kept_per_layer": "", "recon_calib": 0.0, "recon_heldout_prose": 0.0,
                  "recon_heldout_code": 0.0, "ppl_prose": base["prose"], "ppl_code": base["code"],
                  "ppl_mean": math.sqrt(base["prose"] * base["code"])}]
    with open(out / "quality.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()} for row in base_rows + rows)
    if set(args.methods) == set(STRATEGIES):
        write_reports(base_rows + rows, args)
    print(f"wrote {out} in {(time.perf_counter() - start) / 60:.1f} min")
    return rows


def read_csv(path: Path) -> list[dict[str, Any]]:
    numeric = {"ratio", "achieved_ratio", "recon_calib", "recon_heldout_prose", "recon_heldout_code", "ppl_prose",
               "ppl_code", "ppl_mean"}
    with open(path, newline="") as handle:
        return [{k: (float(v) if k in numeric else v) for k, v in row.items()} for row in csv.DictReader(handle)]


def write_reports(all_rows: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """quality.md and quality.png from the rows (the first, method ``unpruned``, holds the base perplexities)."""
    out = Path(args.output_dir)
    base_row = next(r for r in all_rows if r["method"] == "unpruned")
    base = {d: base_row[f"ppl_{d}"] for d in CORPUS_DOMAINS}
    rows = [r for r in all_rows if r["method"] != "unpruned"]
    tables = markdown_tables(rows, base)
    cross = cross_domain_table(rows)
    text = "\n".join([
        "# Quality benchmark (`benchmarks/quality.py`)", "",
        f"shipped:tiny-moe, calibration {args.calib_blocks} x {args.seq_len} tokens, held-out {args.eval_blocks} x "
        f"{args.seq_len} tokens per domain (the first blocks of the held-out split), torch {torch.__version__}; "
        "min_ratio 0.375 at ratios 0.25 and 0.5, 0.125 at 0.75 (all strategies). recon = mean over layers of the normalized "
        "residual on the calibration statistics; bold = lowest geometric-mean perplexity of the column group.", "",
        "## Summary", "", "```", summary(rows), "```", "",
        "## Calibration on the mix (the README table)", "",
        "recon: mean normalized residual on the calibration statistics; bold: lowest perplexity of the column.", "",
        compact_table(rows, base), "",
        "## Domain-specific calibration", "", cross, "",
        "## All results", "", tables,
    ])
    (out / "quality.md").write_text(text + "\n", encoding="utf-8")
    figure(rows, base, out / "quality.png")
    print(compact_table(rows, base))
    print(cross)
    print(summary(rows))
    return rows


if __name__ == "__main__":
    main()
