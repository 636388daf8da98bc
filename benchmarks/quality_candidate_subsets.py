r"""benchmarks/quality_intervals.py, plus ``select`` among a SUBSET of ``--select``'s candidates, from the same run.

    python benchmarks/quality_candidate_subsets.py --subset omp_normalized/loss omp/waterfill -- \
        --model shipped:tiny-moe-a3b --select omp_normalized/loss omp/waterfill reap/waterfill ... --output_dir DIR

Runs the benchmark unchanged (its outputs in ``DIR`` are those of the same command without ``--subset``) and, per
cell and draw, also chooses among ``--subset`` only (the candidate set ``auto`` tries today) on the same draws,
plans, fits and select blocks: ``subset:select`` (lowest uncompensated loss on the select blocks) and
``subset:select+c`` (that plan, its ``linear`` compensation kept unless the select blocks' loss rises by
``CHECK_TOLERANCE`` or more nats, the run's current rule; the loss with compensation is that of the compensated copy
the benchmark measured, which matches ``fit_compensation``'s own check to ~1e-6 nats). Writes ``subset_intervals.csv``,
``subset_summary.csv`` and ``subset_trials.csv`` beside the benchmark's files, in the benchmark's formats, and
``scores.csv``: per cell, draw and ``--select`` candidate, the select blocks' loss per token (what the trial compares)
and the draw's held-out perplexity (geometric mean, and per domain), each without and with compensation (``+c``).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

import torch

from ompmoe.engine.apply.compensation_step import CHECK_TOLERANCE

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("quality_intervals", ROOT / "benchmarks" / "quality_intervals.py")
qi = importlib.util.module_from_spec(spec)
spec.loader.exec_module(qi)

SUB = "subset:" + qi.SELECT
SUB_C = "subset:" + qi.SELECT_C
extra_rows: list[dict] = []
extra_trials: list[dict] = []
scores: list[dict] = []
subset: list[str] = []
original_cell_trials = qi.cell_trials


def cell_trials(name, calibration, ratio, select, variants, ppl, chosen_by, kept_flags, records, cache, source,
                select_tokens, args):
    result = original_cell_trials(name, calibration, ratio, select, variants, ppl, chosen_by, kept_flags, records,
                                  cache, source, select_tokens, args)
    assert args.select_by == "loss" and args.compensate and set(subset) <= set(select)
    tokens = select_tokens[calibration]
    chosen, kept, checks = {}, {}, {}
    for draw in range(args.draws):
        score = {pair: cache[source[pair, draw]]["select"][calibration] / tokens for pair in subset}
        chosen[draw] = min(subset, key=score.__getitem__)
        with_c = cache[source[chosen[draw] + qi.COMPENSATED, draw]]["select"][calibration] / tokens
        kept[draw] = with_c < score[chosen[draw]] + CHECK_TOLERANCE
        checks[draw] = (score[chosen[draw]], with_c)
        source[SUB, draw] = source[chosen[draw], draw]
        source[SUB_C, draw] = source[chosen[draw] + (qi.COMPENSATED if kept[draw] else ""), draw]
    everything = [*variants, SUB, SUB_C]
    domains = [d for d in cache[source[qi.PAPER, 0]] if d != "select"]
    nll = {d: torch.stack([torch.stack([cache[source[v, draw]][d] for draw in range(args.draws)])
                           for v in everything]) for d in domains}
    index = {v: i for i, v in enumerate(everything)}
    cell = qi.intervals(nll, args.seq_len - 1, args.resamples, paper=index[qi.PAPER],
                        baselines=tuple(index[b] for b in qi.BASELINES if b in index))
    for variant in (SUB, SUB_C):
        p = index[variant]
        row = {"model": name, "calibration": calibration, "ratio": ratio, "pair": variant,
               **{key: round(float(values[p]), 6) for key, values in cell.items()}}
        row["not_worse"] = row["gap_best_low"] <= 0.0
        row["chosen"] = " ".join(chosen[d] + (qi.COMPENSATED if variant == SUB_C and kept[d] else "")
                                 for d in range(args.draws))
        extra_rows.append(row)
    per_draw = qi.per_draw_ppl(nll, args.seq_len - 1)
    for draw in range(args.draws):
        for pair in select:
            scores.append({"model": name, "calibration": calibration, "ratio": ratio, "draw": draw, "pair": pair,
                           **{f"{key}{suffix}": value for suffix in ("", qi.COMPENSATED) for key, value in (
                               ("select_loss", round(cache[source[pair + suffix, draw]]["select"][calibration]
                                                     / tokens, 6)),
                               ("ppl", round(float(per_draw[draw, index[pair + suffix]]), 4)),
                               *((f"ppl_{d}", round(math.exp(float(cache[source[pair + suffix, draw]][d].sum())
                                                             / (nll[d].shape[2] * (args.seq_len - 1))), 4))
                                 for d in domains))}})
    for draw in range(args.draws):
        values = {v: float(per_draw[draw, i]) for i, v in enumerate(everything)}
        for variant in (SUB, SUB_C):
            suffix = qi.COMPENSATED if variant == SUB_C else ""
            candidates = [pair + suffix for pair in subset]
            best = min(candidates, key=values.__getitem__)
            row = {"model": name, "calibration": calibration, "ratio": ratio, "draw": draw, "variant": variant,
                   "chosen": chosen[draw] + (qi.COMPENSATED if variant == SUB_C and kept[draw] else ""),
                   "best": best, "ppl_chosen": round(values[variant], 4), "ppl_best": round(values[best], 4),
                   "right": qi.right_choice(values, chosen[draw] + suffix, candidates) if len(subset) > 1 else "",
                   "compensation_kept": "", "compensation_helps": "", "loss_without": "", "loss_with": ""}
            if variant == SUB_C:
                row.update(compensation_kept=kept[draw],
                           compensation_helps=values[chosen[draw] + qi.COMPENSATED] < values[chosen[draw]],
                           loss_without=round(checks[draw][0], 6), loss_with=round(checks[draw][1], 6))
            extra_trials.append(row)
    print(f"  {calibration:<6}{ratio:<5} " + "  ".join(
        f"{v} {float(cell['ppl'][index[v]]):.2f} ({float(cell['gap_paper'][index[v]]):+.1%})" for v in (SUB, SUB_C)),
        flush=True)
    return result


def main() -> None:
    argv = sys.argv[1:]
    if "--" not in argv:  # --help, or no benchmark arguments: say how it is called
        print(__doc__)
        raise SystemExit(0 if {"-h", "--help"} & set(argv) else 2)
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--subset", nargs="+", required=True, help="METHOD/ALLOCATION pairs, each in --select")
    subset.extend(parser.parse_args(argv[:split]).subset)
    qi.cell_trials = cell_trials
    benchmark_argv = argv[split + 1:]
    qi.main(benchmark_argv)
    output = Path(qi.ROOT / "docs" / "quality" / "intervals")
    if "--output_dir" in benchmark_argv:
        output = Path(benchmark_argv[benchmark_argv.index("--output_dir") + 1])
    qi._write_csv(output / "subset_intervals.csv", extra_rows)
    qi._write_csv(output / "subset_summary.csv", qi.summary(extra_rows, extra_trials))
    qi._write_csv(output / "subset_trials.csv", extra_trials)
    qi._write_csv(output / "scores.csv", scores)


if __name__ == "__main__":
    main()
