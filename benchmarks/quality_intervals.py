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
  ``--select auto``: per model, exactly the settings ``auto`` tries for its layout (``auto_settings``), which are
  then measured as pairs too;
- with ``--compensate``, every pair also compensated, ``<pair>+c``: the same plan with the ``linear`` compensation
  (:func:`~ompmoe.engine.apply.compensation_step.fit_compensation` on the unpruned model over the draw's calibration blocks,
  at most a quarter of their tokens) always applied; and two compensated ``select``s: ``select+c``, what a run with
  ``compensation="auto"`` does (choose by the **uncompensated** loss, then fit and keep the compensation only if it
  lowers the loss on the select blocks), and ``select_after+c`` (choose among the compensated candidates by their
  compensated loss on the select blocks, always compensated);
- per model, the gap of every variant to the better (per cell) of the paper's and REAP's uncompensated pairs
  (``omp/waterfill``, ``reap/waterfill``), and the trial accuracy of the ``select`` variants: in how many (cell,
  draw) the choice was the candidate with the lowest held-out perplexity of that draw (Wilson 95 % interval).

Writes ``intervals.csv`` (a row per cell and pair), ``summary.csv`` (a row per model and pair), ``trials.csv`` (with
``--select``: a row per cell, draw and ``select`` variant: the choice and whether it was right) and ``intervals.md``
(per model: each pair's mean gap to the paper and to the better baseline, its worst calibration set, in how many cells
it is not significantly worse than the best, and the trial accuracy) into ``--output_dir`` (default
``docs/quality/intervals``).
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
from ompmoe.engine.apply.compensation_step import fit_compensation  # noqa: E402
from ompmoe.engine.planning.strategy import AUTO, auto_settings, strategy_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAPER = "omp/waterfill"
SELECT = "select"
"""Pseudo-pair: per draw, whichever of ``--select``'s pairs gives the lowest loss on held-out calibration blocks."""
PAIRS = (PAPER, "omp_normalized/loss", "reap/waterfill", "reap/loss", "omp/loss", "omp_normalized/waterfill")
BASELINES = (PAPER, "reap/waterfill")
"""The uncompensated pairs whose better one (per cell) ``gap_baseline`` is measured against (those in ``--pairs``)."""
COMPENSATED = "+c"
"""Suffix of a compensated variant: ``omp/waterfill+c``."""
SELECT_C = SELECT + COMPENSATED
"""What a run with ``compensation="auto"`` does: choose by the uncompensated loss, then keep the fitted compensation
only if it lowers the loss on the select blocks."""
SELECT_AFTER_C = "select_after" + COMPENSATED
"""Choose among the compensated candidates by their compensated loss on the select blocks (always compensated)."""
SELECTS = (SELECT, SELECT_C, SELECT_AFTER_C)


def variant_names(pairs: list[str], compensate: bool, select: bool) -> list[str]:
    """The rows of a cell: the pairs, with ``compensate`` each one's ``+c`` variant, then with ``select`` the
    ``select`` pseudo-pairs (``select``, and with ``compensate`` ``select+c`` and ``select_after+c``)."""
    result = [pair for pair in pairs if pair not in SELECTS]
    if compensate:
        result += [pair + COMPENSATED for pair in result]
    if select:
        result += [SELECT, SELECT_C, SELECT_AFTER_C] if compensate else [SELECT]
    return result


def select_candidates(select: list[str], model_type: str | None) -> list[str]:
    """``--select``'s pairs for a model: ``auto`` stands for the settings ``auto`` tries on its layout."""
    if select == [AUTO]:
        return [f"{method}/{allocation}" for method, allocation in auto_settings(model_type)]
    return list(select)


def wilson_interval(successes: int, trials: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95 % by default); ``(nan, nan)`` without trials."""
    if trials == 0:
        return math.nan, math.nan
    p = successes / trials
    denominator = 1 + z * z / trials
    center = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, center - half), min(1.0, center + half)


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
              seed: int = 0, paper: int = 0, baselines: tuple[int, ...] | None = None) -> dict[str, torch.Tensor]:
    """Point values and 95 % percentile-bootstrap intervals of one cell (pairs x draws x blocks per domain).

    Returns ``ppl``, ``gap_best`` and ``gap_paper`` (relative to the cell's best pair by point value and to
    pair ``paper``), each ``[pairs]``, and their ``*_low`` / ``*_high`` ends; held-out blocks (per domain) and
    draws are resampled together, and every pair sees the same resample (paired gaps). With ``baselines`` (pair
    indices), also ``gap_baseline``: relative to the one of them with the lowest point value.
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
    if baselines:
        base = min(baselines, key=lambda i: float(point[i]))
        result["gap_baseline"] = point / point[base] - 1
        spread["gap_baseline"] = sampled / sampled[:, base:base + 1] - 1
    for name, values in spread.items():
        low, high = torch.quantile(values, torch.tensor([0.025, 0.975], dtype=torch.float64), dim=0)
        result[f"{name}_low"], result[f"{name}_high"] = low, high
    return result


def _counts(indices: torch.Tensor, size: int) -> torch.Tensor:
    """How often each of ``size`` items was drawn in each row of ``indices`` (a bootstrap resample's weights)."""
    return torch.zeros(indices.shape[0], size, dtype=torch.float64).scatter_add_(
        1, indices, torch.ones_like(indices, dtype=torch.float64))


def per_draw_ppl(nll: dict[str, torch.Tensor], tokens_per_block: int) -> torch.Tensor:
    """``[draws, pairs]``: each draw's geometric mean over domains of its held-out perplexity (every block)."""
    draws = next(iter(nll.values())).shape[1]
    ones = {d: torch.ones(draws, v.shape[2], dtype=torch.float64) for d, v in nll.items()}
    return geometric_ppl(nll, tokens_per_block, torch.eye(draws, dtype=torch.float64), ones)


def right_choice(values: dict[str, float], chosen: str, candidates: list[str]) -> bool:
    """Whether ``chosen`` has the lowest of ``values`` among ``candidates`` (ties, e.g. equal plans, count)."""
    return values[chosen] <= min(values[c] for c in candidates)


def run_model(name: str, args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of one model (a row per cell and variant) and, with ``--select``, its trials (a row per cell, draw
    and ``select`` variant)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = shipped_model_path(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    select = select_candidates(args.select, getattr(model.config, "model_type", None))
    pairs = list(dict.fromkeys([*args.pairs, *select]))
    variants = variant_names(pairs, args.compensate, bool(select))
    index = {variant: i for i, variant in enumerate(variants)}
    draws, selection = calibration_draws(tokenizer, args.seq_len, args.calib_blocks, args.draws,
                                         args.select_blocks if select else 0)
    heldout = {}
    for domain in CORPUS_DOMAINS:
        stream = corpus_token_stream(tokenizer, domain, "heldout")
        count = args.eval_blocks or stream.numel() // args.seq_len
        heldout[domain] = token_blocks(stream, args.seq_len, count)
    loss_aware = any("loss_aware" in required_statistics(*pair.split("/")) for pair in pairs)
    stats = {(c, d): ompmoe.collect_stats(model, blocks.split(8), model_id=name, source=f"shipped:{c}",
                                          loss_aware=loss_aware)
             for c, sets in draws.items() if c in args.calibrations for d, blocks in enumerate(sets)}
    base = {d: block_nll(model, b) for d, b in heldout.items()}
    print(f"{name}: unpruned held-out perplexity " + ", ".join(
        f"{d} {math.exp(float(v.sum()) / (v.numel() * (args.seq_len - 1))):.2f}" for d, v in base.items())
        + f" ({', '.join(f'{len(b)}' for b in heldout.values())} blocks); select among {', '.join(select) or '-'}",
        flush=True)
    reference = ({c: log_probs(model, b) for c, b in selection.items()}
                 if select and args.select_by == "kl" else {})
    select_tokens = {c: b.shape[0] * (b.shape[1] - 1) for c, b in selection.items()}

    def measure(pruned: torch.nn.Module) -> dict[str, Any]:
        result: dict[str, Any] = {d: block_nll(pruned, b) for d, b in heldout.items()}
        if select:
            result["select"] = {c: selection_score(pruned, b, reference.get(c), args.select_by)
                                for c, b in selection.items()}
        return result

    cache: dict[tuple, dict[str, Any]] = {}
    chosen_by: dict[tuple, str] = {}
    rows, trials = [], []
    for calibration in args.calibrations:
        for ratio in args.ratios:
            nll = {d: torch.zeros(len(variants), args.draws, len(b), dtype=torch.float64) for d, b in heldout.items()}
            source: dict[tuple[str, int], tuple] = {}  # (variant, draw) -> cache key of its held-out NLL
            kept_flags, records = {}, {}
            for draw in range(args.draws):
                text = draws[calibration][draw]
                plans = {}
                for pair in pairs:
                    method, allocation = pair.split("/")
                    plan = plans[pair] = strategy_for(method, ratio=ratio, allocation=allocation,
                                                      min_kept_fraction=min_kept_fraction_for(ratio)
                                                      ).plan(stats[calibration, draw])
                    kept = plan.kept_by_layer()
                    key = source[pair, draw] = tuple(tuple(kept[layer]) for layer in sorted(kept))
                    if key not in cache:
                        pruned = ompmoe.prune(_copy(model), plan)
                        cache[key] = measure(pruned)
                        del pruned
                    if args.compensate:  # the fit depends on the draw's text too
                        ckey = source[pair + COMPENSATED, draw] = (key, calibration, draw)
                        if ckey not in cache:
                            compensation, _ = fit_compensation(model, plan, text, 8, "linear")
                            pruned = ompmoe.prune(_copy(model), plan)
                            compensation.apply(pruned)
                            cache[ckey] = measure(pruned)
                            del pruned, compensation
                if select:
                    score = {pair: cache[source[pair, draw]]["select"][calibration] for pair in select}
                    chosen = min(select, key=score.__getitem__)
                    chosen_by[calibration, ratio, draw, SELECT] = chosen
                    source[SELECT, draw] = source[chosen, draw]
                if select and args.compensate:
                    # select+c: the run's step. Fit on the draw's text, keep only if the select blocks' loss falls.
                    without = (score[chosen] / select_tokens[calibration]) if args.select_by == "loss" else None
                    compensation, record = fit_compensation(model, plans[chosen], text, 8, "linear",
                                                            check_blocks=selection[calibration], loss_without=without)
                    kept_flags[draw] = compensation is not None
                    records[draw] = record
                    final = chosen + (COMPENSATED if kept_flags[draw] else "")
                    chosen_by[calibration, ratio, draw, SELECT_C] = final
                    source[SELECT_C, draw] = source[final, draw]
                    after = min(select, key=lambda pair: cache[source[pair + COMPENSATED, draw]]["select"][calibration])
                    chosen_by[calibration, ratio, draw, SELECT_AFTER_C] = after + COMPENSATED
                    source[SELECT_AFTER_C, draw] = source[after + COMPENSATED, draw]
                for variant in variants:
                    for d in heldout:
                        nll[d][index[variant], draw] = cache[source[variant, draw]][d]
            cell = intervals(nll, args.seq_len - 1, args.resamples, paper=index[PAPER],
                             baselines=tuple(index[b] for b in BASELINES if b in index))
            for variant in variants:
                p = index[variant]
                row = {"model": name, "calibration": calibration, "ratio": ratio, "pair": variant,
                       **{key: round(float(values[p]), 6) for key, values in cell.items()}}
                row["not_worse"] = row["gap_best_low"] <= 0.0
                rows.append(row)
                if select:  # per draw, the pair each ``select`` took
                    row["chosen"] = (" ".join(chosen_by[calibration, ratio, d, variant] for d in range(args.draws))
                                     if variant in SELECTS else "")
            if select:
                trials += cell_trials(name, calibration, ratio, select, variants,
                                      per_draw_ppl(nll, args.seq_len - 1), chosen_by, kept_flags, records,
                                      cache, source, select_tokens, args)
            print(f"  {calibration:<6}{ratio:<5} " + "  ".join(
                f"{variant} {float(cell['ppl'][index[variant]]):.2f} ({float(cell['gap_paper'][index[variant]]):+.1%})"
                for variant in variants), flush=True)
    return rows, trials


def cell_trials(name: str, calibration: str, ratio: float, select: list[str], variants: list[str],
                ppl: torch.Tensor, chosen_by: dict[tuple, str], kept_flags: dict[int, bool],
                records: dict[int, dict[str, Any]], cache: dict[tuple, dict[str, Any]],
                source: dict[tuple[str, int], tuple], select_tokens: dict[str, int],
                args: argparse.Namespace) -> list[dict[str, Any]]:
    """A row per draw and ``select`` variant: its choice, the candidate with the lowest held-out perplexity of the
    draw, and whether they agree (``select``: among the uncompensated candidates; ``select+c`` and
    ``select_after+c``: among the compensated ones, which is what the run ends with). ``select+c`` also records the
    compensation check: kept or not, whether compensation lowers the chosen plan's held-out perplexity, and the
    select blocks' losses the check saw (``loss_with_copy``: the pruned and compensated copy's, to compare)."""
    result = []
    measured = [v for v in (SELECT, SELECT_C, SELECT_AFTER_C) if v in variants]
    for draw in range(args.draws):
        values = {variant: float(ppl[draw, i]) for i, variant in enumerate(variants)}
        for variant in measured:
            compensated = variant != SELECT
            chosen = chosen_by[calibration, ratio, draw, variant].removesuffix(COMPENSATED)
            candidates = [pair + (COMPENSATED if compensated else "") for pair in select]
            mine = chosen + (COMPENSATED if compensated else "")
            best = min(candidates, key=values.__getitem__)
            row = {"model": name, "calibration": calibration, "ratio": ratio, "draw": draw, "variant": variant,
                   "chosen": chosen_by[calibration, ratio, draw, variant], "best": best,
                   "ppl_chosen": round(values[variant], 4), "ppl_best": round(values[best], 4),
                   "right": right_choice(values, mine, candidates) if len(select) > 1 else "",
                   "compensation_kept": "", "compensation_helps": "", "loss_without": "", "loss_with": "",
                   "loss_with_copy": ""}
            if variant == SELECT_C:
                record = records[draw]
                with_copy = cache[source[chosen + COMPENSATED, draw]]["select"][calibration]
                row.update(compensation_kept=kept_flags[draw],
                           compensation_helps=values[chosen + COMPENSATED] < values[chosen],
                           loss_without=round(record["loss_without"], 6), loss_with=round(record["loss_with"], 6),
                           loss_with_copy=(round(with_copy / select_tokens[calibration], 6)
                                           if args.select_by == "loss" else ""))
            result.append(row)
    return result


def _copy(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model)


def summary(rows: list[dict[str, Any]], trials: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Per model and pair: mean gap to the paper over cells, the worst calibration set's mean gap, the mean gap to
    the better baseline (where measured), the cells (of all) where the pair is not significantly worse than the
    best, and for the ``select`` variants the trial accuracy over (cell, draw) with its Wilson 95 % interval
    (``select+c`` also: how often keeping or dropping the compensation was right)."""
    result = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for pair in dict.fromkeys(r["pair"] for r in rows if r["model"] == model):
            mine = [r for r in rows if r["model"] == model and r["pair"] == pair]
            by_set: dict[str, list[float]] = {}
            for r in mine:
                by_set.setdefault(r["calibration"], []).append(r["gap_paper"])
            worst = max(by_set, key=lambda c: sum(by_set[c]) / len(by_set[c]))
            entry = {
                "model": model, "pair": pair,
                "mean_gap_paper": sum(r["gap_paper"] for r in mine) / len(mine),
                "worst_set_gap_paper": sum(by_set[worst]) / len(by_set[worst]), "worst_set": worst,
                "mean_gap_baseline": (sum(r["gap_baseline"] for r in mine) / len(mine)
                                      if all("gap_baseline" in r for r in mine) else math.nan),
                "not_worse": sum(r["not_worse"] for r in mine), "cells": len(mine),
            }
            tried = [t for t in trials or [] if t["model"] == model and t["variant"] == pair]
            judged = [t for t in tried if t["right"] != ""]
            right = sum(bool(t["right"]) for t in judged)
            low, high = wilson_interval(right, len(judged))
            checks = [t for t in tried if t["compensation_kept"] != ""]
            kept_right = sum(t["compensation_kept"] == t["compensation_helps"] for t in checks)
            entry.update(trials=len(judged), right=right, right_low=low, right_high=high,
                         compensation_checks=len(checks),
                         compensation_kept=sum(bool(t["compensation_kept"]) for t in checks),
                         compensation_check_right=kept_right)
            result.append(entry)
    return result


def _trial_cell(s: dict[str, Any]) -> str:
    if s["trials"]:
        return f"{s['right']}/{s['trials']} [{s['right_low']:.0%}, {s['right_high']:.0%}]"
    return "one candidate" if s["pair"] in SELECTS else ""


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace,
             trials: list[dict[str, Any]] | None = None) -> str:
    lines = [f"Held-out perplexity, {args.draws} disjoint calibration draws of {args.calib_blocks} x {args.seq_len} "
             f"tokens, {'every held-out block' if not args.eval_blocks else f'{args.eval_blocks} held-out blocks'} "
             f"per domain, 95 % bootstrap intervals ({args.resamples} resamples of blocks and draws).", ""]
    summaries = summary(rows, trials)
    baseline = all(any(r["pair"] == pair for r in rows) for pair in BASELINES)  # else it is the paper's gap again
    lines += ["| model | pair | mean gap to paper | worst calibration set |"
              + (" mean gap to better of paper, REAP |" if baseline else "")
              + " not significantly worse than best |" + (" trial accuracy [95 %] |" if trials else ""),
              "|---|---|---|---|" + ("---|" if baseline else "") + "---|" + ("---|" if trials else "")]
    for s in summaries:
        lines.append(f"| {s['model']} | {s['pair']} | {s['mean_gap_paper']:+.1%} | {s['worst_set_gap_paper']:+.1%} "
                     f"({s['worst_set']}) |" + (f" {s['mean_gap_baseline']:+.1%} |" if baseline else "")
                     + f" {s['not_worse']}/{s['cells']} |" + (f" {_trial_cell(s)} |" if trials else ""))
    checked = [s for s in summaries if s["compensation_checks"]]
    if checked:
        lines += ["", "`select+c`'s compensation check (kept when the select blocks' loss falls): kept in "
                  + "; ".join(f"{s['model']} {s['compensation_kept']}/{s['compensation_checks']}, right (kept exactly "
                              f"where it lowers held-out perplexity) {s['compensation_check_right']}/"
                              f"{s['compensation_checks']}" for s in checked) + "."]
    lines += ["", "| model | calibration | ratio | pair | perplexity [95 %] | gap to paper [95 %] | gap to best [95 %] |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['calibration']} | {r['ratio']:g} | {r['pair']} | {r['ppl']:.2f} "
            f"[{r['ppl_low']:.2f}, {r['ppl_high']:.2f}] | {r['gap_paper']:+.1%} [{r['gap_paper_low']:+.1%}, "
            f"{r['gap_paper_high']:+.1%}] | {r['gap_best']:+.1%} [{r['gap_best_low']:+.1%}, {r['gap_best_high']:+.1%}]"
            + ("" if r["not_worse"] else " worse") + " |")
    return "\n".join(lines) + "\n"


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(key for row in rows for key in row)))
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", nargs="+", default=["shipped:tiny-moe", "shipped:tiny-moe-64"])
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), help="METHOD/ALLOCATION; must include omp/waterfill")
    parser.add_argument("--select", nargs="*", default=[],
                        help="also measure 'select': per draw, the pair of these (each also in --pairs) whose pruned "
                             "model has the lowest loss on --select_blocks held-out calibration blocks; 'auto': per "
                             "model, the settings method 'auto' tries on its layout (measured as pairs too)")
    parser.add_argument("--compensate", action="store_true",
                        help="also measure every pair with the linear compensation ('<pair>+c') and, with --select, "
                             "'select+c' (the run's compensation='auto') and 'select_after+c'")
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
    if args.select != [AUTO] and (missing := [pair for pair in args.select if pair not in args.pairs]):
        parser.error(f"--select {' '.join(missing)}: not in --pairs; a selected pair must be measured too")
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    rows, trials = [], []
    for name in args.model:
        model_start = time.perf_counter()
        model_rows, model_trials = run_model(name, args)
        rows += model_rows
        trials += model_trials
        print(f"{name}: {time.perf_counter() - model_start:.0f} s", flush=True)
    text = markdown(rows, args, trials if args.select else None)
    with atomic_path(args.output_dir, overwrite=True, directory=True) as tmp:
        _write_csv(tmp / "intervals.csv", rows)
        _write_csv(tmp / "summary.csv", summary(rows, trials))
        if trials:
            _write_csv(tmp / "trials.csv", trials)
        (tmp / "intervals.md").write_text(text)
    print(text.split("\n\n")[1])
    if args.compensate and args.select:
        print(text.split("\n\n")[2])
    print(f"{time.perf_counter() - start:.0f} s")
    return rows


if __name__ == "__main__":
    main()
