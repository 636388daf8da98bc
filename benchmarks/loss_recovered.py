"""How much of the paper's perplexity increase the run's default takes back, with intervals.

    python benchmarks/loss_recovered.py [--models shipped:tiny-moe ...] [--ratios 0.5 0.25]

Per shipped model, calibration set (``shipped:prose``, ``shipped:code``, ``shipped:mix``: 60 blocks of 256 tokens,
as ``ompmoe fit`` cuts them, and its 8 choice blocks after them) and ratio, three pruned models:

- ``paper``: ``omp`` + ``waterfill``, no compensation (the paper's OMP-MoE);
- ``before``: the run's default with ``auto``'s compensation fitting the ``linear`` map alone;
- ``default``: the run's default (``auto``, compensation ``auto``: the down refit or the linear map, chosen on the
  choice blocks).

Each is made by :class:`ompmoe.PruningRun` exactly as ``ompmoe fit`` makes it, then every held-out block of the
shipped corpus (``--eval_blocks`` of 256 tokens per domain) is scored. Per cell: the geometric mean over domains of the
perplexity; ``recovered`` = ``(ppl_paper - ppl) / (ppl_paper - ppl_unpruned)``, the share of the paper's increase
taken back; the gap of ``default`` to ``before``; 95 % percentile-bootstrap intervals resampling held-out blocks per
domain (paired: the same resamples for every model). Writes ``cells.csv`` and ``loss_recovered.md`` into
``--output_dir`` (default ``docs/quality/loss_recovered``) and prints one line per cell.
"""

from __future__ import annotations

import argparse
import copy
import csv
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import ompmoe  # noqa: E402
import ompmoe.engine.apply.compensation_step as compensation_step  # noqa: E402
from ompmoe.data import shipped_model_path  # noqa: E402
from ompmoe.engine.io import atomic_path  # noqa: E402
from quality_intervals import block_nll  # noqa: E402  (benchmarks/ is on the path of a script run from there)

DOMAINS = ("heldout:prose", "heldout:code")
SETS = ("prose", "code", "mix")


def pruned_by_run(model: torch.nn.Module, name: str, data: Any, ratio: float, granularity: str
                  ) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model ``ompmoe fit`` makes with the default (``auto``) strategy and compensation, ``auto``'s
    compensation fitting ``granularity``; and the plan's compensation record."""
    strategy = ompmoe.PruningStrategy(ratio=ratio, method="auto", allocation="auto",
                                      min_kept_fraction=0.375 if ratio <= 0.5 else 0.125)
    saved = compensation_step.AUTO_GRANULARITY
    compensation_step.AUTO_GRANULARITY = granularity
    try:
        run = ompmoe.PruningRun(ompmoe.RunOptions(strategy=strategy, plots=False))
        copied = copy.deepcopy(model)
        context = ompmoe.LocalContext(print=lambda line: None)
        run.start(copied, context, model_id=name, data=data)
        run.collect(data.blocks.split(4))
        run.finish(context)
    finally:
        compensation_step.AUTO_GRANULARITY = saved
    return copied, dict(run.plan.extra.get("compensation", {}), plan=f"{run.plan.method}+{run.plan.allocation}")


def paper_model(model: torch.nn.Module, data: Any, ratio: float) -> torch.nn.Module:
    stats = ompmoe.collect_stats(model, data.blocks.split(4), progress=False)
    plan = ompmoe.PruningStrategy(ratio=ratio, min_kept_fraction=0.375 if ratio <= 0.5 else 0.125).plan(stats)
    return ompmoe.prune(copy.deepcopy(model), plan)


def geometric_ppl(nll: dict[str, torch.Tensor], tokens: int, weights: dict[str, torch.Tensor] | None = None
                  ) -> torch.Tensor:
    """Geometric mean over domains of the (resampled) perplexity; ``nll[domain]`` ``(blocks,)``, or weighted."""
    logs = []
    for domain, values in nll.items():
        w = weights[domain] if weights is not None else torch.ones(1, values.numel(), dtype=torch.float64)
        logs.append((w @ values) / (w.sum(-1) * tokens))
    return torch.exp(torch.stack(logs).mean(0))


def cell_intervals(nll: dict[str, dict[str, torch.Tensor]], tokens: int, resamples: int = 2000, seed: int = 0
                   ) -> dict[str, tuple[float, float, float]]:
    """``(value, low, high)`` of each variant's perplexity, of ``recovered`` for ``before`` and ``default``, and of
    the relative gap ``default / before - 1`` (paired bootstrap over held-out blocks per domain)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for domain in DOMAINS:
        count = nll["unpruned"][domain].numel()
        draws = torch.randint(0, count, (resamples, count), generator=generator)
        weights[domain] = torch.zeros(resamples, count, dtype=torch.float64).scatter_add_(
            1, draws, torch.ones(resamples, count, dtype=torch.float64))
    point = {variant: geometric_ppl(values, tokens) for variant, values in nll.items()}
    boot = {variant: geometric_ppl(values, tokens, weights) for variant, values in nll.items()}

    def summary(full: torch.Tensor, sampled: torch.Tensor) -> tuple[float, float, float]:
        low, high = torch.quantile(sampled, torch.tensor([0.025, 0.975], dtype=sampled.dtype)).tolist()
        return float(full.reshape(-1)[0]), low, high

    result = {f"ppl_{v}": summary(point[v], boot[v]) for v in nll}
    for variant in ("before", "default"):
        result[f"recovered_{variant}"] = summary(
            (point["paper"] - point[variant]) / (point["paper"] - point["unpruned"]),
            (boot["paper"] - boot[variant]) / (boot["paper"] - boot["unpruned"]))
    result["gap_default_vs_before"] = summary(point["default"] / point["before"] - 1, boot["default"] / boot["before"] - 1)
    return result


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["shipped:tiny-moe", "shipped:tiny-moe-a3b",
                                                          "shipped:tiny-moe-64"])
    parser.add_argument("--sets", nargs="+", default=list(SETS))
    parser.add_argument("--ratios", nargs="+", type=float, default=[0.5, 0.25])
    parser.add_argument("--calib_blocks", type=int, default=60)
    parser.add_argument("--eval_blocks", type=int, default=78)
    parser.add_argument("--output_dir", type=Path, default=Path("docs/quality/loss_recovered"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    rows = []
    started = time.perf_counter()
    for name in args.models:
        path = shipped_model_path(name)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()
        for calibration in args.sets:
            data = ompmoe.CalibrationDataModule(source=f"shipped:{calibration}", tokenizer=str(path), seq_len=256,
                                                num_blocks=args.calib_blocks, batch_size=4)
            heldout = {domain: data.heldout_blocks(domain, args.eval_blocks) for domain in DOMAINS}
            base = {domain: block_nll(model, blocks) for domain, blocks in heldout.items()}
            for ratio in args.ratios:
                nll = {"unpruned": base}
                nll["paper"] = {d: block_nll(paper_model(model, data, ratio), b) for d, b in heldout.items()}
                records = {}
                for variant, granularity in (("before", "linear"), ("default", "down")):
                    pruned, records[variant] = pruned_by_run(model, name, data, ratio, granularity)
                    nll[variant] = {d: block_nll(pruned, b) for d, b in heldout.items()}
                cell = cell_intervals(nll, 255)
                record = records["default"]
                row = {"model": name, "calibration": calibration, "ratio": ratio, "plan": record.get("plan"),
                       "compensation": (f"{record.get('granularity')}"
                                        + (f" alpha {record['ridge_alpha']:g}" if record.get("granularity") == "down"
                                           else "")) if record.get("applied") else "none",
                       **{f"{key}{suffix}": round(value, 5) for key, values in cell.items()
                          for suffix, value in zip(("", "_low", "_high"), values)}}
                rows.append(row)
                print(f"{name} {calibration:<5} {ratio:<4}: unpruned {row['ppl_unpruned']:.2f} paper "
                      f"{row['ppl_paper']:.2f} before {row['ppl_before']:.2f} ({row['recovered_before']:.0%}) "
                      f"default {row['ppl_default']:.2f} ({row['recovered_default']:.0%} "
                      f"[{row['recovered_default_low']:.0%}, {row['recovered_default_high']:.0%}]) gap "
                      f"{row['gap_default_vs_before']:+.2%} [{row['gap_default_vs_before_low']:+.2%}, "
                      f"{row['gap_default_vs_before_high']:+.2%}] {row['plan']} {row['compensation']} "
                      f"({time.perf_counter() - started:.0f}s)", flush=True)
    write(rows, args)
    return rows


def write(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    with atomic_path(args.output_dir, overwrite=True, directory=True) as tmp:
        with open(tmp / "cells.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        lines = ["| model | calibration | ratio | unpruned | paper | before (linear) | recovered | default (now) | "
                 "recovered [95 %] | default vs before [95 %] | compensation chosen |", "|" + "---|" * 11]
        for r in rows:
            lines.append(
                f"| {r['model'].removeprefix('shipped:')} | {r['calibration']} | {r['ratio']:g} | "
                f"{r['ppl_unpruned']:.2f} | {r['ppl_paper']:.2f} | {r['ppl_before']:.2f} | "
                f"{r['recovered_before']:.0%} | {r['ppl_default']:.2f} | {r['recovered_default']:.0%} "
                f"[{r['recovered_default_low']:.0%}, {r['recovered_default_high']:.0%}] | "
                f"{r['gap_default_vs_before']:+.2%} [{r['gap_default_vs_before_low']:+.2%}, "
                f"{r['gap_default_vs_before_high']:+.2%}] | {r['compensation']} |")
        (tmp / "loss_recovered.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.output_dir}/cells.csv and loss_recovered.md")


if __name__ == "__main__":
    main()
