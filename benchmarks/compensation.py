"""Compensation after pruning (``ompmoe.engine.apply.compensation``): held-out perplexity without and with it, and its cost.

    python benchmarks/compensation.py                         # both shipped models, ratios 0.5 and 0.25, 1 thread
    python benchmarks/compensation.py --models shipped:tiny-moe-64 --ratios 0.5 --plans omp/waterfill

Per model (float32, ``eager`` experts, as ``benchmarks/quality.py``): calibration = the first ``--calib_blocks``
blocks of ``--seq_len`` tokens of the prose calibration split and as many of the code split, interleaved (prose,
code, prose, ...), so every evenly spaced subset holds both domains; one loss-aware statistics pass on them; held-out
= the first ``--eval_blocks`` blocks of each domain's held-out split. For each ratio and plan (``method/allocation``,
``min_kept_fraction`` 0.375), the pruned model (``ompmoe.prune``) is evaluated without compensation and with each
variant (``compensation_sums`` on the unpruned model, ``fit_scales``, ``apply_compensation`` on a pruned copy):

- ``layer``: one factor per MoE layer; ``expert r=R``: one per kept expert, ridge ``R`` toward the layer's factor
  (0: plain per-expert least squares); ``linear r=R``: a ``d x d`` map of the layer's routed output, ridge
  ``R * tr(P) / d`` toward the layer factor times the identity; fitted on every calibration block, non-sequential;
- ``seq ...``: the same, sequential (each layer fitted on the pruned-and-compensated model's inputs);
- ``... @T``: fitted on ``T`` tokens only (``spread_blocks``: evenly spaced calibration blocks);
- ``linear auto ...`` (``--variants auto``): the engine's default, ``linear`` with the automatic ridge ``d / T``;
- with ``--variants explore``: a routing temperature and one factor per output channel (see :func:`explore`).

Columns: held-out perplexity per domain and their geometric mean (``ppl``), its change against no compensation, the
same change on the ``--choice_blocks`` calibration blocks after the calibration set (where a run can decide whether
compensation helps, as ``auto`` tries its candidates), the relative routed-output error on the fitting tokens
before/after (mean over layers) and the factors' range (a map's diagonal). Cost (same run, one thread, medians of
``--repeats`` interleaved rounds, wall-clock and process CPU time): a plain forward over all calibration blocks
(batches of 8, LM head included) against the compensation pass at each token budget and the sequential pass, and the
decision where it helps (``heldout_losses``: the pruned model without and with compensation on the choice blocks).
Writes ``--output`` (CSV, one row per variant; timings in ``<output>_cost.csv``) and prints markdown tables and the
summary over cells (``--summary CSV ...`` prints it again from written rows).
"""

from __future__ import annotations

import argparse
import copy
import csv
import math
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # shared CPUs: spinning OpenMP threads stall each other
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import ompmoe  # noqa: E402
import ompmoe.engine.apply.compensation as compensation_module  # noqa: E402
from ompmoe.data import CORPUS_DOMAINS, corpus_token_stream, shipped_model_path, token_blocks  # noqa: E402
from ompmoe.engine.apply.compensation import (  # noqa: E402
    Compensation, apply_compensation, compensate, compensation_record, compensation_sums, fit_scales, heldout_losses,
    spread_blocks,
)
from ompmoe.engine.io import atomic_path  # noqa: E402
from ompmoe.engine.planning.strategy import strategy_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BATCH_SIZE = 8
EXPERT_RIDGES = (0.0, 0.1, 1.0)
LINEAR_RIDGES = (0.001, 0.01, 0.1, 1.0)


@torch.no_grad()
def perplexity(model: torch.nn.Module, blocks: torch.Tensor) -> float:
    total, count = 0.0, 0
    for batch in blocks.split(BATCH_SIZE):
        logits = model(input_ids=batch, use_cache=False).logits.float()
        total += float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(),
                                                         reduction="sum"))
        count += batch[:, 1:].numel()
    return math.exp(total / count)


def heldout(model: torch.nn.Module, eval_blocks: dict[str, torch.Tensor]) -> dict[str, float]:
    ppl = {d: perplexity(model, blocks) for d, blocks in eval_blocks.items()}
    return {**ppl, "mean": math.exp(sum(math.log(v) for v in ppl.values()) / len(ppl))}


def calibration_blocks(tokenizer: Any, seq_len: int, per_domain: int, choice: int = 0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_domain`` blocks of each domain's calibration split, interleaved (prose, code, prose, ...), and the
    ``choice`` blocks after them in each domain, interleaved too (what ``auto``'s choice blocks are to the run)."""
    domain = [token_blocks(corpus_token_stream(tokenizer, d, "calibration"), seq_len, per_domain + choice)
              for d in CORPUS_DOMAINS]
    calib = torch.stack([blocks[:per_domain] for blocks in domain], dim=1).reshape(-1, seq_len)
    return calib, torch.stack([blocks[per_domain:] for blocks in domain], dim=1).reshape(-1, seq_len)


def timed(function: Any, repeats: int) -> dict[str, tuple[float, float]]:
    """Median (wall-clock, process CPU) seconds of each of ``function``'s passes over ``repeats`` interleaved rounds,
    after a warm-up round (with one thread the CPU time is the work done, less disturbed by other processes)."""
    for run in function.values():
        run()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in function}
    for _ in range(repeats):
        for name, run in function.items():
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {name: (statistics.median(v[0] for v in values), statistics.median(v[1] for v in values))
            for name, values in times.items()}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=["shipped:tiny-moe-64", "shipped:tiny-moe"])
    parser.add_argument("--ratios", nargs="*", type=float, default=[0.5, 0.25])
    parser.add_argument("--plans", nargs="*", default=["omp/waterfill", "reap/waterfill", "omp_normalized/loss"])
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--calib_blocks", type=int, default=32, help="per domain")
    parser.add_argument("--eval_blocks", type=int, default=32, help="per domain")
    parser.add_argument("--choice_blocks", type=int, default=4,
                        help="per domain: calibration blocks after the calibration set, where a run could decide")
    parser.add_argument("--budgets", nargs="*", type=int, default=[1024, 2048, 4096, 8192], help="fitting tokens")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", nargs="*", default=["main"], choices=["main", "auto", "explore"],
                        help="main: the variants of ompmoe.engine.apply.compensation with fixed ridges; auto: the "
                             "default (linear, ridge d / T) at each token budget; explore: a routing temperature and "
                             "one factor per output channel (measured here only)")
    parser.add_argument("--output", default=str(ROOT / "docs" / "quality" / "compensation.csv"))
    parser.add_argument("--summary", nargs="*", metavar="CSV",
                        help="print the summary over cells of these CSVs (rows of earlier runs) and exit")
    args = parser.parse_args(argv)
    if args.summary:
        rows = [row for path in args.summary for row in read_rows(Path(path))]
        print(summary(rows))
        return rows
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows: list[dict[str, Any]] = []
    costs: list[dict[str, Any]] = []
    start = time.perf_counter()
    for name in args.models:
        path = shipped_model_path(name)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        calib, choice = calibration_blocks(tokenizer, args.seq_len, args.calib_blocks, args.choice_blocks)
        eval_blocks = {d: token_blocks(corpus_token_stream(tokenizer, d, "heldout",
                                                           max_tokens=args.eval_blocks * args.seq_len),
                                       args.seq_len, args.eval_blocks) for d in CORPUS_DOMAINS}
        stats = ompmoe.collect_stats(model, calib.split(BATCH_SIZE), model_id=name, loss_aware=True)
        base = heldout(model, eval_blocks)
        print(f"{name}: unpruned held-out ppl prose {base['prose']:.2f} code {base['code']:.2f} "
              f"[{time.perf_counter() - start:.0f} s]", flush=True)
        rows.append({"model": name, "ratio": 0.0, "plan": "unpruned", "variant": "none", "tokens": 0,
                     **{f"ppl_{k}": v for k, v in base.items()}})
        for ratio in args.ratios:
            for setting in args.plans:
                method, allocation = setting.split("/")
                plan = strategy_for(method, ratio=ratio, allocation=allocation, min_kept_fraction=0.375).plan(stats)
                pruned = ompmoe.prune(copy.deepcopy(model), plan)
                none = heldout(pruned, eval_blocks)
                none_choice = perplexity(pruned, choice)
                cell = {"model": name, "ratio": ratio, "plan": setting}

                def add(variant: str, record: dict[str, Any] | None, compensated: torch.nn.Module) -> None:
                    ppl = heldout(compensated, eval_blocks)
                    row = {**cell, "variant": variant, "tokens": record["num_tokens"] if record else 0,
                           **{f"ppl_{k}": v for k, v in ppl.items()},
                           "change": ppl["mean"] / none["mean"] - 1.0,
                           "choice_change": perplexity(compensated, choice) / none_choice - 1.0,
                           "error_before": record["routed_error_before"] if record else math.nan,
                           "error_after": record["routed_error_after"] if record else math.nan,
                           "scale_min": record["scale_min"] if record else math.nan,
                           "scale_max": record["scale_max"] if record else math.nan}
                    rows.append(row)
                    print(f"{name} {ratio:<5} {setting:<20} {variant:<22} tokens {row['tokens']:>6}  ppl prose "
                          f"{ppl['prose']:7.2f} code {ppl['code']:7.2f} mean {ppl['mean']:7.2f} ({row['change']:+.2%})"
                          f" choice {row['choice_change']:+.2%}  err {row['error_before']:.3f}->"
                          f"{row['error_after']:.3f}  s [{row['scale_min']:.2f}, {row['scale_max']:.2f}]  "
                          f"[{time.perf_counter() - start:.0f} s]", flush=True)

                def evaluate(variant: str, sums: Any, granularity: str, ridge: float | None) -> None:
                    scales = fit_scales(sums, granularity, ridge)
                    compensation = Compensation(scales, {layer.name: layer.kept for layer in sums.layers},
                                                compensation_record(sums, scales, granularity, ridge))
                    compensated = apply_compensation(copy.deepcopy(pruned), compensation)
                    add(variant, compensation.record, compensated)

                add("none", None, pruned)
                if "explore" in args.variants:
                    explore(model, plan, pruned, calib, add)
                if "auto" in args.variants:  # the default: linear, ridge d / T, at each token budget
                    for budget in [*args.budgets, None]:
                        blocks = calib if budget is None else spread_blocks(calib, budget)
                        subset = compensation_sums(model, plan, blocks, batch_size=BATCH_SIZE, granularity="linear")
                        evaluate("linear auto" + ("" if budget is None else f" @{budget}"), subset, "linear", None)
                if "main" not in args.variants:
                    continue
                full = compensation_sums(model, plan, calib, batch_size=BATCH_SIZE, granularity="linear")
                evaluate("layer", full, "layer", 0.0)
                for ridge in EXPERT_RIDGES:
                    evaluate(f"expert r={ridge:g}", full, "expert", ridge)
                for ridge in LINEAR_RIDGES:
                    evaluate(f"linear r={ridge:g}", full, "linear", ridge)
                for granularity, ridge in (("layer", 0.0), ("expert", 0.1), ("linear", 0.01)):
                    sequential = compensation_sums(model, plan, calib, sequential=True, granularity=granularity,
                                                   ridge=ridge)
                    evaluate(f"seq {granularity}" + (f" r={ridge:g}" if granularity != "layer" else ""), sequential,
                             granularity, ridge)
                for budget in args.budgets:
                    subset = compensation_sums(model, plan, spread_blocks(calib, budget), batch_size=BATCH_SIZE,
                                               granularity="linear")
                    for granularity, ridge in (("layer", 0.0), ("expert", 0.1), ("linear", 0.01), ("linear", 0.1)):
                        evaluate(f"{granularity}" + (f" r={ridge:g}" if granularity != "layer" else "") + f" @{budget}",
                                 subset, granularity, ridge)
        if args.repeats == 0:
            continue
        # Cost: the paper's plan at the first ratio; every pass on the same warm model.
        plan = strategy_for("omp", ratio=args.ratios[0], allocation="waterfill", min_kept_fraction=0.375).plan(stats)

        def forward() -> None:
            with torch.no_grad():
                for batch in calib.split(BATCH_SIZE):
                    model(input_ids=batch, use_cache=False)

        passes = {"forward": forward,
                  "layer/expert sums (all)": lambda: compensation_sums(model, plan, calib, batch_size=BATCH_SIZE,
                                                                       granularity="expert"),
                  "linear sums (all)": lambda: compensation_sums(model, plan, calib, batch_size=BATCH_SIZE),
                  "sequential linear (all)": lambda: compensation_sums(model, plan, calib, sequential=True)}
        for budget in args.budgets:
            passes[f"linear sums @{budget}"] = (
                lambda b=budget: compensation_sums(model, plan, spread_blocks(calib, b), batch_size=BATCH_SIZE))
        fitted = compensate(model, plan, calib, BATCH_SIZE, max_tokens=4096)
        passes["decision on choice blocks"] = lambda: heldout_losses(model, plan, fitted, choice, BATCH_SIZE)
        seconds = timed(passes, args.repeats)
        wall, cpu = seconds["forward"]
        for name_, (w, c) in seconds.items():
            costs.append({"model": name, "pass": name_, "wall_s": w, "cpu_s": c, "wall_over_forward": w / wall,
                          "cpu_over_forward": c / cpu})
            print(f"{name} cost {name_:<22} wall {w:7.2f} s ({w / wall:.2f}x forward)  cpu {c:7.2f} s "
                  f"({c / cpu:.2f}x forward)", flush=True)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with atomic_path(out, overwrite=True) as tmp, open(tmp, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()} for row in rows)
    if costs:
        with atomic_path(out.with_name(out.stem + "_cost.csv"), overwrite=True) as tmp, \
                open(tmp, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(costs[0]))
            writer.writeheader()
            writer.writerows({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()} for row in costs)
    print(tables(rows, costs, args))
    print(summary(rows))
    print(f"wrote {out} in {(time.perf_counter() - start) / 60:.1f} min")
    return rows


# -- exploration: what folds into a stock checkpoint beyond output scales (measured here, not in the engine) ----------

TEMPERATURES = (0.6, 0.8, 1.0, 1.25, 1.6, 2.0)
CHANNEL_RIDGES = (0.0, 0.1, 1.0)


@contextmanager
def pruned_router_temperature(factor: float) -> Iterator[None]:
    """Within: ``compensation_sums``' pruned routers compute their logits times ``factor`` (router weight scaled)."""
    original = compensation_module._LayerPass.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        with torch.no_grad():
            self.router.weight.mul_(factor)

    compensation_module._LayerPass.__init__ = init
    try:
        yield
    finally:
        compensation_module._LayerPass.__init__ = original


def explore(model: torch.nn.Module, plan: ompmoe.PruningPlan, pruned: torch.nn.Module, calib: torch.Tensor,
            add: Any) -> None:
    """``temperature + layer``: per layer, the routing temperature of a grid (the pruned router's logits times ``a``,
    folded into its weight) whose per-layer factor leaves the least routed error on the calibration tokens, with that
    factor (the row's factor range is the chosen temperatures'); ``channel r=R``: one factor per output channel per
    layer (the diagonal of the ``linear`` map's problem, the same ridge), folded into every kept down projection."""
    from ompmoe.engine.apply.compensation import layer_factor

    by_temperature = {}
    for factor in TEMPERATURES:
        with pruned_router_temperature(factor):
            by_temperature[factor] = compensation_sums(model, plan, calib, batch_size=BATCH_SIZE, granularity="layer")
    names = [layer.name for layer in by_temperature[1.0].layers]
    chosen: dict[str, tuple[float, float]] = {}
    errors = []
    for index, name in enumerate(names):
        options = []
        for factor, sums in by_temperature.items():
            layer = sums.layers[index]
            s = layer_factor(layer)
            options.append((layer.residual(torch.full_like(layer.cross, s)), factor, s))
        error, factor, s = min(options)
        chosen[name] = (factor, s)
        errors.append(error)
    compensated = copy.deepcopy(pruned)
    for layer in ompmoe.find_moe_layers(compensated):
        factor, s = chosen[layer.name]
        with torch.no_grad():
            layer.router.weight.mul_(factor)
            layer.experts.down_proj.mul_(s)
    before = [layer.residual(torch.ones_like(layer.cross)) for layer in by_temperature[1.0].layers]
    record = {"num_tokens": int(by_temperature[1.0].num_tokens), "routed_error_before": sum(before) / len(before),
              "routed_error_after": sum(errors) / len(errors), "scale_min": min(f for f, _ in chosen.values()),
              "scale_max": max(f for f, _ in chosen.values())}
    add("temperature + layer", record, compensated)
    print("  temperatures (a, s) per layer:", {n: (f, round(s, 3)) for n, (f, s) in chosen.items()}, flush=True)

    sums = compensation_sums(model, plan, calib, batch_size=BATCH_SIZE, granularity="linear")
    before = [layer.residual(torch.ones_like(layer.cross)) for layer in sums.layers]
    for ridge in CHANNEL_RIDGES:
        maps = {}
        for layer in sums.layers:
            pp, tp = layer.output_gram, layer.output_cross
            lam = ridge * float(pp.trace()) / pp.shape[0]
            maps[layer.name] = torch.diag((tp.diagonal() + lam * layer_factor(layer)) / (pp.diagonal() + lam))
        errors = [layer.residual(maps[layer.name]) for layer in sums.layers]
        compensated = apply_compensation(copy.deepcopy(pruned), maps, kept={l.name: l.kept for l in sums.layers})
        values = torch.cat([m.diagonal() for m in maps.values()])
        record = {"num_tokens": int(sums.num_tokens), "routed_error_before": sum(before) / len(before),
                  "routed_error_after": sum(errors) / len(errors), "scale_min": float(values.min()),
                  "scale_max": float(values.max())}
        add(f"channel r={ridge:g}", record, compensated)

def read_rows(path: Path) -> list[dict[str, Any]]:
    text = {"model", "plan", "variant"}
    with open(path, newline="") as handle:
        return [{k: (v if k in text else float(v) if v not in ("", None) else math.nan) for k, v in row.items()}
                for row in csv.DictReader(handle)]


def summary(rows: list[dict[str, Any]]) -> str:
    """Per variant over every (model, ratio, plan) cell: mean and worst change of held-out perplexity against no
    compensation, cells it improves, and cells where the choice blocks' change has the held-out change's sign."""
    variants: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row["plan"] != "unpruned" and row["variant"] != "none":
            variants.setdefault(row["variant"], []).append(row)
    lines = ["| variant | cells | mean change | worst cell | best cell | cells improved | choice blocks agree |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for variant, group in variants.items():
        changes = [r["change"] for r in group]
        known = [r for r in group if not math.isnan(r.get("choice_change", math.nan))]
        agree = sum((r["choice_change"] < 0) == (r["change"] < 0) for r in known)
        lines.append(f"| {variant} | {len(group)} | {sum(changes) / len(changes):+.2%} | {max(changes):+.2%} | "
                     f"{min(changes):+.2%} | {sum(c < 0 for c in changes)}/{len(group)} | "
                     f"{f'{agree}/{len(known)}' if known else '-'} |")
    return "\n".join(lines)


def tables(rows: list[dict[str, Any]], costs: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """Markdown: per (model, ratio, plan) the variants' perplexities; the cost table."""
    lines = ["| model | ratio | plan | variant | tokens | prose | code | ppl | vs none | choice blocks vs none | "
             "routed error | factors |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for row in rows:
        if row["plan"] == "unpruned":
            lines.append(f"| {row['model']} | - | unpruned | - | - | {row['ppl_prose']:.2f} | {row['ppl_code']:.2f} | "
                         f"{row['ppl_mean']:.2f} | | | | |")
            continue
        error = "" if math.isnan(row["error_before"]) else f"{row['error_before']:.3f} -> {row['error_after']:.3f}"
        factors = "" if math.isnan(row["scale_min"]) else f"{row['scale_min']:.2f} .. {row['scale_max']:.2f}"
        change = "" if row["variant"] == "none" else f"{row['change']:+.2%}"
        choice_change = "" if row["variant"] == "none" else f"{row['choice_change']:+.2%}"
        lines.append(f"| {row['model']} | {row['ratio']:g} | {row['plan']} | {row['variant']} | {row['tokens']} | "
                     f"{row['ppl_prose']:.2f} | {row['ppl_code']:.2f} | {row['ppl_mean']:.2f} | {change} | "
                     f"{choice_change} | {error} | {factors} |")
    lines += ["", "| model | pass | wall s | x forward | CPU s | x forward |", "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {c['model']} | {c['pass']} | {c['wall_s']:.2f} | {c['wall_over_forward']:.2f} | {c['cpu_s']:.2f} | "
              f"{c['cpu_over_forward']:.2f} |" for c in costs]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
