"""Pruning quality on a shipped tiny MoE: methods x allocations x ratios x calibration domains.

    python benchmarks/quality.py --eval_blocks 8    # the committed runs (README "Quality"): 4-7 minutes per run
    python benchmarks/quality.py --model shipped:tiny-moe-64 --output_dir docs/quality/tiny-moe-64 --methods ...

Model: ``--model``, ``shipped:tiny-moe`` by default (``ompmoe/data/tiny-moe``: Qwen3-MoE, 6 sparse layers of 16
experts, top-4, trained here on the train split of the shipped corpus) or ``shipped:tiny-moe-64``, in float32.
``--methods`` defaults to the score and pursuit strategies; name the loss-aware and rerouting methods to include
them (``exact`` is refused above 20 experts, so leave it out on ``tiny-moe-64``).

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
from ompmoe.engine.methods import required_statistics  # noqa: E402
from ompmoe.engine.io import atomic_path  # noqa: E402
from ompmoe.engine.methods import METHODS  # noqa: E402
from ompmoe.engine.planning.strategy import strategy_for  # noqa: E402

import calibration_cost as calibration_cost_benchmark  # noqa: E402  (benchmarks/calibration_cost.py)
import quality_report  # noqa: E402  (benchmarks/quality_report.py)

RATIOS = (0.25, 0.5, 0.75)
ALLOCATIONS = ("uniform", "waterfill", "optimal", "loss", "loss_risk")
CALIBRATIONS = ("prose", "code", "mix")


def needs(statistics: str, method: str, allocation: str | None = None) -> bool:
    """Whether the method (and allocation) need the optional ``statistics`` (``loss_aware``, ``reroute``)."""
    return statistics in required_statistics(method, allocation)

ROOT = Path(__file__).resolve().parents[1]


def min_ratio_for(ratio: float) -> float:
    return 0.125 if ratio > 0.625 else 0.375


@torch.no_grad()
def perplexity(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int = 8) -> float:
    return evaluate(model, blocks, None, batch_size)[0]


@torch.no_grad()
def evaluate(model: torch.nn.Module, blocks: torch.Tensor, reference: list[torch.Tensor] | None,
             batch_size: int = 8) -> tuple[float, float]:
    """Held-out perplexity and mean per-token ``KL(P_unpruned || P_model)`` (nats) against ``reference`` log-probs."""
    total, count, kl = 0.0, 0, 0.0
    for i, batch in enumerate(blocks.split(batch_size)):
        logits = model(input_ids=batch, use_cache=False).logits.float()
        total += float(torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(), reduction="sum"))
        count += batch[:, 1:].numel()
        if reference is not None:
            log_q = torch.log_softmax(logits[:, :-1], dim=-1)
            log_p = reference[i]
            kl += float((log_p.exp() * (log_p - log_q)).sum())
    return math.exp(total / count), kl / count


@torch.no_grad()
def reference_log_probs(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int = 8) -> list[torch.Tensor]:
    return [torch.log_softmax(model(input_ids=b, use_cache=False).logits.float()[:, :-1], dim=-1)
            for b in blocks.split(batch_size)]


def calibration_cost(model: torch.nn.Module, blocks: torch.Tensor, repeats: int, args: argparse.Namespace,
                     calibration: str) -> dict[str, Any]:
    """``benchmarks/calibration_cost.py`` on these blocks: median seconds of the plain forward, forward plus
    backward, and the three statistics passes (interleaved in this run), and each pass's peak memory in a fresh
    process relative to the plain forward's (skipped with ``--no_memory``)."""
    times = calibration_cost_benchmark.time_passes(calibration_cost_benchmark.passes(model, blocks), repeats)
    memory = None
    if not args.no_memory:
        memory = calibration_cost_benchmark.memory_in_subprocesses(argparse.Namespace(
            model=args.model, calibration=calibration, calib_blocks=args.calib_blocks, seq_len=args.seq_len,
            threads=args.threads))
    return calibration_cost_benchmark.cost_report(times, memory)


def reconstruction(stats: ompmoe.MoEStats, kept: dict[str, list[int]]) -> float:
    """Mean over layers of the normalized residual ``||Y - sum_kept V||^2 / ||Y||^2`` of the kept sets."""
    errors = []
    for layer in stats.layers:
        mask = torch.zeros(layer.num_experts, dtype=torch.bool)
        mask[kept[layer.name]] = True
        errors.append(float(removed_energy(layer.gram, mask)) / max(layer.signal_energy, 1e-30))
    return sum(errors) / len(errors)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description="Pruning quality benchmark on shipped:tiny-moe (see module docstring).")
    parser.add_argument("--output_dir", default=str(ROOT / "docs" / "quality"))
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--calib_blocks", type=int, default=32)
    parser.add_argument("--eval_blocks", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", nargs="*", default=list(METHODS))
    parser.add_argument("--allocations", nargs="*", default=list(ALLOCATIONS))
    parser.add_argument("--calibrations", nargs="*", default=list(CALIBRATIONS))
    parser.add_argument("--ratios", nargs="*", type=float, default=list(RATIOS))
    parser.add_argument("--model", default="shipped:tiny-moe")
    parser.add_argument("--timing_repeats", type=int, default=5)
    parser.add_argument("--no_memory", action="store_true",
                        help="calibration cost: time only (no fresh process per pass for the peak memory)")
    parser.add_argument("--from_csv", action="store_true", help="rebuild quality.md and quality.png from quality.csv")
    args = parser.parse_args(argv)
    if args.from_csv:
        return write_reports(read_csv(Path(args.output_dir) / "quality.csv"), args)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    start = time.perf_counter()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ompmoe.lightning.calibration_data import CalibrationDataModule

    path = shipped_model_path(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    calib_blocks = {
        c: CalibrationDataModule(f"shipped:{c}", tokenizer=str(path), seq_len=args.seq_len, num_blocks=args.calib_blocks).blocks
        for c in args.calibrations
    }
    eval_blocks = {
        d: token_blocks(corpus_token_stream(tokenizer, d, "heldout", max_tokens=args.eval_blocks * args.seq_len),
                        args.seq_len, args.eval_blocks)
        for d in CORPUS_DOMAINS
    }
    stats = {c: ompmoe.collect_stats(model, b.split(8), model_id=args.model, source=f"shipped:{c}", loss_aware=True,
                                  reroute=any(needs("reroute", m) for m in args.methods))
             for c, b in calib_blocks.items()}
    timing = {"model": args.model, "calibration": args.calibrations[-1], "tokens": args.calib_blocks * args.seq_len,
              "batch_size": calibration_cost_benchmark.BATCH_SIZE, "threads": args.threads,
              "repeats": args.timing_repeats, "torch": torch.__version__,
              **calibration_cost(model, calib_blocks[args.calibrations[-1]], args.timing_repeats, args,
                                 args.calibrations[-1])}
    cost = {k: timing[f"seconds_{k}"] for k in calibration_cost_benchmark.PASSES if f"seconds_{k}" in timing}
    print(f"calibration cost ({args.calib_blocks} x {args.seq_len} tokens, medians of {args.timing_repeats} "
          f"interleaved rounds):\n" + calibration_cost_benchmark.summary_line(timing), flush=True)
    heldout_stats = {d: ompmoe.collect_stats(model, b.split(8), model_id=args.model, source=f"heldout:{d}")
                     for d, b in eval_blocks.items()}
    base = {d: perplexity(model, eval_blocks[d]) for d in CORPUS_DOMAINS}
    reference = {d: reference_log_probs(model, eval_blocks[d]) for d in CORPUS_DOMAINS}
    print(f"unpruned held-out perplexity: prose {base['prose']:.3f}, code {base['code']:.3f} "
          f"({args.eval_blocks} x {args.seq_len} tokens each); setup {time.perf_counter() - start:.0f} s", flush=True)

    cache: dict[tuple, dict[str, float]] = {}
    rows = []
    jobs = [(m, a) for m in args.methods for a in args.allocations]
    for calibration in args.calibrations:
        for ratio in args.ratios:
            for method, allocation in jobs:
                    strategy = strategy_for(method, ratio=ratio, allocation=allocation, min_kept_fraction=min_ratio_for(ratio))
                    plan = strategy.plan(stats[calibration])
                    loss_aware = needs("loss_aware", method, allocation)
                    kept = plan.kept_by_layer()
                    key = tuple(tuple(kept[name]) for name in sorted(kept))
                    if key not in cache:
                        pruned = ompmoe.prune(copy.deepcopy(model), plan)
                        results = {d: evaluate(pruned, eval_blocks[d], reference[d]) for d in CORPUS_DOMAINS}
                        cache[key] = {**{d: r[0] for d, r in results.items()},
                                      **{f"kl_{d}": r[1] for d, r in results.items()}}
                        del pruned
                    ppl = cache[key]
                    row = {
                        "calibration": calibration, "ratio": ratio, "method": method,
                        "allocation": allocation,
                        "min_ratio": min_ratio_for(ratio), "achieved_ratio": round(plan.achieved_ratio, 4),
                        "kept_per_layer": "/".join(str(len(kept[layer.name])) for layer in plan.layers),
                        "recon_calib": reconstruction(stats[calibration], kept),
                        "recon_heldout_prose": reconstruction(heldout_stats["prose"], kept),
                        "recon_heldout_code": reconstruction(heldout_stats["code"], kept),
                        "ppl_prose": ppl["prose"], "ppl_code": ppl["code"],
                        "ppl_mean": math.sqrt(ppl["prose"] * ppl["code"]),
                        "kl_prose": ppl["kl_prose"], "kl_code": ppl["kl_code"],
                        "kl_mean": (ppl["kl_prose"] + ppl["kl_code"]) / 2,
                        "calib_cost": (cost["loss_stats"] / cost["stats"] if loss_aware else 1.0)
                        + (cost["reroute_stats"] / cost["stats"] - 1.0 if needs("reroute", method) else 0.0),
                    }
                    rows.append(row)
                    print(f"{calibration:<6}{ratio:<6}{method:<16}{allocation:<10} kept {row['kept_per_layer']:<18} "
                          f"recon {row['recon_calib']:.3f} (held-out {row['recon_heldout_prose']:.3f}/"
                          f"{row['recon_heldout_code']:.3f})  ppl prose {row['ppl_prose']:8.2f}  code {row['ppl_code']:8.2f}"
                          f"  kl {row['kl_mean']:.4f}"
                          f"  [{time.perf_counter() - start:.0f} s, {len(cache)} pruned models]", flush=True)

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    base_rows = [{"calibration": "none", "ratio": 0.0, "method": "unpruned", "allocation": "", "min_ratio": "",
                  "achieved_ratio": 0.0, "kept_per_layer": "", "recon_calib": 0.0, "recon_heldout_prose": 0.0,
                  "recon_heldout_code": 0.0, "ppl_prose": base["prose"], "ppl_code": base["code"],
                  "ppl_mean": math.sqrt(base["prose"] * base["code"]), "kl_prose": 0.0, "kl_code": 0.0,
                  "kl_mean": 0.0, "calib_cost": 0.0}]
    csv_path = out / "quality.csv"
    with atomic_path(csv_path, overwrite=True) as tmp, open(tmp, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()} for row in base_rows + rows)
    with atomic_path(out / "timing.json", overwrite=True) as tmp:
        tmp.write_text(__import__("json").dumps(timing, indent=1))
    write_reports(base_rows + rows, args)
    print(f"wrote {out} in {(time.perf_counter() - start) / 60:.1f} min")
    return rows


def with_cost_vs_forward(rows: list[dict[str, Any]], timing: dict[str, Any]) -> list[dict[str, Any]]:
    """``rows`` with ``calib_time_vs_forward`` (``calib_cost`` x stats / forward) and ``calib_memory_vs_forward``
    (peak memory of the pass the row needs / the plain forward's) from ``timing.json``; NaN where it lacks them."""
    time_ratio = timing.get("stats_over_forward", math.nan)
    memory = timing.get("memory_over_forward")
    out = []
    for row in rows:
        method = row["method"].removesuffix("_seq")
        passes = ["loss_stats"] if needs("loss_aware", method, row["allocation"]) else ["stats"]
        passes += ["reroute_stats"] if needs("reroute", method) else []
        out.append({**row, "calib_time_vs_forward": row["calib_cost"] * time_ratio,
                    "calib_memory_vs_forward": max(memory[n] for n in passes) if memory else math.nan})
    return out


def read_csv(path: Path) -> list[dict[str, Any]]:
    numeric = {"ratio", "achieved_ratio", "recon_calib", "recon_heldout_prose", "recon_heldout_code", "ppl_prose",
               "ppl_code", "ppl_mean", "kl_prose", "kl_code", "kl_mean", "calib_cost"}
    with open(path, newline="") as handle:
        return [{k: (float(v) if k in numeric else v) for k, v in row.items()} for row in csv.DictReader(handle)]


def write_reports(all_rows: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """quality.md and quality.png from the rows (the first, method ``unpruned``, holds the base perplexities)."""
    out = Path(args.output_dir)
    base_row = next(r for r in all_rows if r["method"] == "unpruned")
    rows = [r for r in all_rows if r["method"] != "unpruned"]
    timing_path = out / "timing.json"
    timing = __import__("json").loads(timing_path.read_text()) if timing_path.is_file() else {}
    rows = with_cost_vs_forward(rows, timing)
    text = "\n".join([
        "# Quality benchmark (`benchmarks/quality.py`)", "",
        f"{timing.get('model', 'shipped:tiny-moe')}, calibration {args.calib_blocks} x {args.seq_len} tokens, held-out "
        f"{args.eval_blocks} x {args.seq_len} tokens per domain (the first blocks of the held-out split), torch "
        f"{torch.__version__}; min_ratio 0.375 at ratios 0.25 and 0.5, 0.125 at 0.75 (all strategies), risk_weight 3.0. "
        f"Unpruned held-out perplexity: prose {base_row['ppl_prose']:.2f}, code {base_row['ppl_code']:.2f}. "
        "ppl = geometric mean of the prose and code held-out perplexities; KL = mean per-token "
        "KL(unpruned || pruned) on the held-out tokens (nats), averaged over the two domains.", "",
        "## Ranking over all (calibration, ratio) cells", "",
        "wins: cells where the pair has the lowest ppl (ties count); gap: ppl / best ppl of the cell - 1; "
        "vs omp/waterfill: geometric mean over cells of ppl / ppl of the paper's method; calibration cost: time / peak "
        "memory of the statistics pass(es) it needs relative to a plain forward on the same batches (time: median of "
        "interleaved runs; memory: peak resident size above the loaded model, each pass in a fresh process; "
        "`benchmarks/calibration_cost.py`, figures below); \"x stats\": time relative to the plain statistics pass "
        "where timing.json has no forward ratio.", "",
        quality_report.ranking_table(rows), "",
        "## Calibration cost", "",
        "```json", __import__("json").dumps(timing, indent=1), "```", "",
        "## Summary per cell", "", "```text", quality_report.summary(rows), "```", "",
        "## All results", "", quality_report.cell_tables(rows),
    ])
    with atomic_path(out / "quality.md", overwrite=True) as tmp:
        tmp.write_text(text + "\n", encoding="utf-8")
    with atomic_path(out / "quality.png", overwrite=True) as tmp:
        quality_report.figure(rows, tmp.with_suffix(".png"))
        if tmp.with_suffix(".png").is_file():
            tmp.with_suffix(".png").replace(tmp)
    print(quality_report.ranking_table(rows))
    print(quality_report.summary(rows))
    return rows


if __name__ == "__main__":
    main()
