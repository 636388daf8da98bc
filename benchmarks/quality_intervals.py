"""Pruning quality with intervals: which method + allocation pairs are significantly worse than the best.

    python benchmarks/quality_intervals.py --model shipped:tiny-moe shipped:tiny-moe-64 --draws 3

``benchmarks/quality.py`` sweeps every pair on one calibration draw and a few held-out blocks, where the
leading pairs differ by 1-2 %. This script measures fewer pairs with the evidence to separate them:

- ``--draws`` calibration draws of ``--calib_blocks`` blocks each, **disjoint**: draw ``d`` of ``prose`` and
  ``code`` is blocks ``d*n .. (d+1)*n - 1`` of that domain's calibration split, ``mix`` the first half of each;
- held-out perplexity on ``--eval_blocks`` blocks of ``--seq_len`` tokens per domain (0: every held-out block),
  kept per block, so the uncertainty of the evaluation set is measured too;
- per cell (model, calibration set, ratio) and pair: the geometric mean over domains of the held-out
  perplexity, pooled over the draws, with a 95 % percentile-bootstrap interval that resamples held-out blocks
  (per domain) and draws together; the same resamples give paired intervals of the relative gap of every pair
  to the cell's best pair and to the paper's ``omp`` + ``waterfill``. A pair is **not significantly worse than
  the best** when the 95 % interval of its gap to the best reaches 0;
- with ``--select PAIR ...``, a pseudo-pair ``select``: per draw, the one of those pairs whose pruned model has the
  lowest loss on ``--select_blocks`` further calibration blocks (in no draw), as ``method="auto"`` chooses
  (:func:`ompmoe.choose_plan` on ``CalibrationDataModule.choice_blocks``); ``intervals.csv`` names its choices.

Writes ``intervals.csv`` (a row per cell and pair) and ``intervals.md`` (per model: each pair's mean gap to
the paper, its worst calibration set, and in how many cells it is not significantly worse than the best) into
``--output_dir`` (default ``docs/quality/intervals``).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import ompmoe  # noqa: E402
from ompmoe.data import CORPUS_DOMAINS, corpus_token_stream, shipped_model_path, token_blocks  # noqa: E402
from ompmoe.engine.methods import required_statistics  # noqa: E402
from ompmoe.engine.io import atomic_path  # noqa: E402
from ompmoe.engine.strategy import strategy_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAPER = "omp/waterfill"
SELECT = "select"
"""Pseudo-pair: per draw, whichever of ``--select``'s pairs gives the lowest loss on held-out calibration blocks."""
PAIRS = (PAPER, "omp_normalized/loss", "reap/waterfill", "reap/loss", "omp/loss", "omp_normalized/waterfill")


def min_kept_fraction_for(ratio: float) -> float:
    """0.375 (the default) up to ratio 0.5; at 0.75 a layer must be allowed to keep fewer (as benchmarks/quality.py)."""
    return 0.125 if ratio > 0.625 else 0.375


def calibration_draws(tokenizer: Any, seq_len: int, blocks: int, draws: int,
                      select_blocks: int = 0) -> tuple[dict[str, list[torch.Tensor]], dict[str, torch.Tensor]]:
    """Disjoint calibration draws per set: ``prose``/``code`` consecutive ranges of blocks, ``mix`` half of each;
    and per set ``select_blocks`` further calibration blocks that no draw contains (``select``'s held-out blocks)."""
    domain = {d: token_blocks(corpus_token_stream(tokenizer, d, "calibration"), seq_len, blocks * draws + select_blocks)
              for d in CORPUS_DOMAINS}
    half = blocks // 2
    result: dict[str, list[torch.Tensor]] = {d: [] for d in (*CORPUS_DOMAINS, "mix")}
    for d in range(draws):
        for name in CORPUS_DOMAINS:
            result[name].append(domain[name][d * blocks:(d + 1) * blocks])
        result["mix"].append(torch.cat([domain["prose"][d * blocks:d * blocks + half],
                                        domain["code"][d * blocks:d * blocks + blocks - half]]))
    rest = {name: domain[name][blocks * draws:] for name in CORPUS_DOMAINS}
    selection = {**rest, "mix": torch.cat([rest["prose"][:select_blocks // 2],
                                           rest["code"][:select_blocks - select_blocks // 2]])}
    return result, selection


@torch.no_grad()
def block_nll(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """Summed next-token negative log-likelihood of each block (float64), every token after the first predicted."""
    sums = []
    for batch in blocks.split(batch_size):
        logits = model(input_ids=batch, use_cache=False).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), batch[:, 1:], reduction="none")
        sums.append(nll.double().sum(dim=1))
    return torch.cat(sums)


@torch.no_grad()
def log_probs(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """Next-token log-probabilities of ``model`` on ``blocks`` (``[blocks, seq_len, vocab]``)."""
    return torch.cat([torch.log_softmax(model(input_ids=b, use_cache=False).logits.float(), -1) for b in blocks.split(batch_size)])


def selection_score(pruned: torch.nn.Module, blocks: torch.Tensor, reference: torch.Tensor | None, by: str) -> float:
    """What ``select`` minimizes: the summed NLL of ``blocks`` (``loss``) or the mean per-token
    ``KL(unpruned || pruned)`` against the unpruned ``reference`` log-probabilities (``kl``)."""
    if by == "loss":
        return float(block_nll(pruned, blocks).sum())
    assert reference is not None
    mine = log_probs(pruned, blocks)
    return float((reference.exp() * (reference - mine)).sum(-1).mean())


def geometric_ppl(nll: dict[str, torch.Tensor], tokens_per_block: int, draw_weights: torch.Tensor,
                  block_weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """Geometric mean over domains of the perplexity pooled over weighted draws and blocks.

    ``nll[domain]``: ``[pairs, draws, blocks]`` summed NLL per block; ``draw_weights``: ``[B, draws]``;
    ``block_weights[domain]``: ``[B, blocks]`` (counts of a bootstrap resample, or ones). Returns ``[B, pairs]``.
    """
    log_ppl = 0.0
    for domain, values in nll.items():
        total = torch.einsum("bd,bk,pdk->bp", draw_weights, block_weights[domain], values)
        tokens = draw_weights.sum(1, keepdim=True) * block_weights[domain].sum(1, keepdim=True) * tokens_per_block
        log_ppl = log_ppl + total / tokens
    return torch.exp(log_ppl / len(nll))


def intervals(nll: dict[str, torch.Tensor], tokens_per_block: int, resamples: int = 2000,
              seed: int = 0, paper: int = 0) -> dict[str, torch.Tensor]:
    """Point values and 95 % percentile-bootstrap intervals of one cell (pairs x draws x blocks per domain).

    Returns ``ppl``, ``gap_best`` and ``gap_paper`` (relative to the cell's best pair by point value and to
    pair ``paper``), each ``[pairs]``, and their ``*_low`` / ``*_high`` ends; held-out blocks (per domain) and
    draws are resampled together, and every pair sees the same resample (paired gaps).
    """
    generator = torch.Generator().manual_seed(seed)
    num_pairs, draws, _ = next(iter(nll.values())).shape
    ones = {d: torch.ones(1, v.shape[2], dtype=torch.float64) for d, v in nll.items()}
    point = geometric_ppl(nll, tokens_per_block, torch.ones(1, draws, dtype=torch.float64), ones)[0]
    draw_weights = _counts(torch.randint(draws, (resamples, draws), generator=generator), draws)
    block_weights = {d: _counts(torch.randint(v.shape[2], (resamples, v.shape[2]), generator=generator), v.shape[2])
                     for d, v in nll.items()}
    sampled = geometric_ppl(nll, tokens_per_block, draw_weights, block_weights)
    best = int(point.argmin())
    result = {"ppl": point, "gap_best": point / point[best] - 1, "gap_paper": point / point[paper] - 1}
    spread = {"ppl": sampled, "gap_best": sampled / sampled[:, best:best + 1] - 1,
              "gap_paper": sampled / sampled[:, paper:paper + 1] - 1}
    for name, values in spread.items():
        low, high = torch.quantile(values, torch.tensor([0.025, 0.975], dtype=torch.float64), dim=0)
        result[f"{name}_low"], result[f"{name}_high"] = low, high
    return result


def _counts(indices: torch.Tensor, size: int) -> torch.Tensor:
    """How often each of ``size`` items was drawn in each row of ``indices`` (a bootstrap resample's weights)."""
    return torch.zeros(indices.shape[0], size, dtype=torch.float64).scatter_add_(
        1, indices, torch.ones_like(indices, dtype=torch.float64))


def run_model(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = shipped_model_path(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    draws, selection = calibration_draws(tokenizer, args.seq_len, args.calib_blocks, args.draws,
                                         args.select_blocks if args.select else 0)
    heldout = {}
    for domain in CORPUS_DOMAINS:
        stream = corpus_token_stream(tokenizer, domain, "heldout")
        count = args.eval_blocks or stream.numel() // args.seq_len
        heldout[domain] = token_blocks(stream, args.seq_len, count)
    loss_aware = any("loss_aware" in required_statistics(*pair.split("/")) for pair in args.pairs if pair != SELECT)
    stats = {(c, d): ompmoe.collect_stats(model, blocks.split(8), model_id=name, source=f"shipped:{c}",
                                          loss_aware=loss_aware)
             for c, sets in draws.items() if c in args.calibrations for d, blocks in enumerate(sets)}
    base = {d: block_nll(model, b) for d, b in heldout.items()}
    print(f"{name}: unpruned held-out perplexity " + ", ".join(
        f"{d} {math.exp(float(v.sum()) / (v.numel() * (args.seq_len - 1))):.2f}" for d, v in base.items())
        + f" ({', '.join(f'{len(b)}' for b in heldout.values())} blocks)", flush=True)
    reference = ({c: log_probs(model, b) for c, b in selection.items()}
                 if args.select and args.select_by == "kl" else {})
    cache: dict[tuple, dict[str, Any]] = {}
    chosen_by: dict[tuple, str] = {}
    rows = []
    for calibration in args.calibrations:
        for ratio in args.ratios:
            nll = {d: torch.zeros(len(args.pairs), args.draws, len(b), dtype=torch.float64) for d, b in heldout.items()}
            for draw in range(args.draws):
                keys = {}
                for p, pair in enumerate(args.pairs):
                    if pair == SELECT:
                        continue
                    method, allocation = pair.split("/")
                    plan = strategy_for(method, ratio=ratio, allocation=allocation,
                                        min_kept_fraction=min_kept_fraction_for(ratio)).plan(stats[calibration, draw])
                    kept = plan.kept_by_layer()
                    key = keys[pair] = tuple(tuple(kept[layer]) for layer in sorted(kept))
                    if key not in cache:
                        pruned = ompmoe.prune(_copy(model), plan)
                        cache[key] = {d: block_nll(pruned, b) for d, b in heldout.items()}
                        if args.select:
                            cache[key]["select"] = {c: selection_score(pruned, b, reference.get(c), args.select_by)
                                                    for c, b in selection.items()}
                        del pruned
                    for d in heldout:
                        nll[d][p, draw] = cache[key][d]
                if args.select:
                    chosen = min(args.select, key=lambda pair: cache[keys[pair]]["select"][calibration])
                    chosen_by[calibration, ratio, draw] = chosen
                    for d in heldout:
                        nll[d][list(args.pairs).index(SELECT), draw] = cache[keys[chosen]][d]
            cell = intervals(nll, args.seq_len - 1, args.resamples, paper=list(args.pairs).index(PAPER))
            for p, pair in enumerate(args.pairs):
                row = {"model": name, "calibration": calibration, "ratio": ratio, "pair": pair,
                       **{key: round(float(values[p]), 6) for key, values in cell.items()}}
                row["not_worse"] = row["gap_best_low"] <= 0.0
                rows.append(row)
                if args.select:  # per draw, the pair ``select`` took
                    row["chosen"] = " ".join(chosen_by[calibration, ratio, d] for d in range(args.draws)) if pair == SELECT else ""
            print(f"  {calibration:<6}{ratio:<5} " + "  ".join(
                f"{pair} {float(cell['ppl'][p]):.2f} ({float(cell['gap_paper'][p]):+.1%})"
                for p, pair in enumerate(args.pairs)), flush=True)
    return rows


def _copy(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model)


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and pair: mean gap to the paper over cells, the worst calibration set's mean gap, and the
    cells (of all) where the pair is not significantly worse than the best."""
    result = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for pair in dict.fromkeys(r["pair"] for r in rows if r["model"] == model):
            mine = [r for r in rows if r["model"] == model and r["pair"] == pair]
            by_set: dict[str, list[float]] = {}
            for r in mine:
                by_set.setdefault(r["calibration"], []).append(r["gap_paper"])
            result.append({
                "model": model, "pair": pair,
                "mean_gap_paper": sum(r["gap_paper"] for r in mine) / len(mine),
                "worst_set_gap_paper": max(sum(v) / len(v) for v in by_set.values()),
                "not_worse": sum(r["not_worse"] for r in mine), "cells": len(mine),
            })
    return result


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"Held-out perplexity, {args.draws} disjoint calibration draws of {args.calib_blocks} x {args.seq_len} "
             f"tokens, {'every held-out block' if not args.eval_blocks else f'{args.eval_blocks} held-out blocks'} "
             f"per domain, 95 % bootstrap intervals ({args.resamples} resamples of blocks and draws).", ""]
    lines += ["| model | pair | mean gap to paper | worst calibration set | not significantly worse than best |",
              "|---|---|---|---|---|"]
    for s in summary(rows):
        lines.append(f"| {s['model']} | {s['pair']} | {s['mean_gap_paper']:+.1%} | {s['worst_set_gap_paper']:+.1%} "
                     f"| {s['not_worse']}/{s['cells']} |")
    lines += ["", "| model | calibration | ratio | pair | perplexity [95 %] | gap to paper [95 %] | gap to best [95 %] |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['calibration']} | {r['ratio']:g} | {r['pair']} | {r['ppl']:.2f} "
            f"[{r['ppl_low']:.2f}, {r['ppl_high']:.2f}] | {r['gap_paper']:+.1%} [{r['gap_paper_low']:+.1%}, "
            f"{r['gap_paper_high']:+.1%}] | {r['gap_best']:+.1%} [{r['gap_best_low']:+.1%}, {r['gap_best_high']:+.1%}]"
            + ("" if r["not_worse"] else " worse") + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", nargs="+", default=["shipped:tiny-moe", "shipped:tiny-moe-64"])
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), help="METHOD/ALLOCATION; must include omp/waterfill")
    parser.add_argument("--select", nargs="*", default=[],
                        help="also measure 'select': per draw, the pair of these (each also in --pairs) whose pruned "
                             "model has the lowest loss on --select_blocks held-out calibration blocks")
    parser.add_argument("--select_blocks", type=int, default=8)
    parser.add_argument("--select_by", choices=["loss", "kl"], default="loss",
                        help="select's criterion: next-token loss, or KL(unpruned || pruned), on the select blocks")
    parser.add_argument("--calibrations", nargs="+", default=["prose", "code", "mix"])
    parser.add_argument("--ratios", nargs="+", type=float, default=[0.25, 0.5, 0.75])
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--calib_blocks", type=int, default=32)
    parser.add_argument("--eval_blocks", type=int, default=32, help="held-out blocks per domain; 0: all of them")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output_dir", default=str(ROOT / "docs" / "quality" / "intervals"))
    args = parser.parse_args(argv)
    if PAPER not in args.pairs:
        parser.error(f"--pairs must include the paper's {PAPER} (the reference of every gap)")
    if missing := [pair for pair in args.select if pair not in args.pairs]:
        parser.error(f"--select {' '.join(missing)}: not in --pairs; a selected pair must be measured too")
    if args.select:
        args.pairs = [*args.pairs, SELECT]
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    rows = [row for name in args.model for row in run_model(name, args)]
    with atomic_path(args.output_dir, overwrite=True, directory=True) as tmp:
        with open(tmp / "intervals.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        (tmp / "intervals.md").write_text(markdown(rows, args))
    print(markdown(rows, args).split("\n\n")[1])
    print(f"{time.perf_counter() - start:.0f} s")
    return rows


if __name__ == "__main__":
    main()
