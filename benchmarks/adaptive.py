"""OMP-MoE+ adaptive inference benchmark: experts per token, skip ratio, FLOPs and speed vs epsilon.

Run ``python benchmarks/adaptive.py`` (a few minutes on one CPU thread). For epsilon in 0, 0.01,
0.05, 0.1, 0.2, 0.3 (and the plain model, adaptive inference off) it reports:

- average experts executed per token and MoE layer, skip ratio, and the routed-expert FLOPs
  ratio ``E[m] / K`` (the paper's appendix: the rest of the layer is unchanged);
- wall-clock time of the MoE layers (router, selection and experts, summed over layers, timed
  by hooks on the sparse blocks) and of the whole forward pass, with speedups relative to
  epsilon = 0 measured in the same run (median over repeats, settings interleaved so background
  load hits all alike), in wall-clock and in process CPU time (which other processes disturb less);
- the overhead ``o = t_MoE(eps) / t_MoE(0) - FLOPs ratio`` (CPU time; rule plus compaction, as a share of
  the epsilon = 0 MoE time): adaptive inference breaks even once the skip ratio exceeds ``o``;
- held-out perplexity.

Two models, sections ``--models``:

``shipped``  the trained ``shipped:tiny-moe`` (Qwen3-MoE, 6 layers x 16 experts, top-4, d = 256),
             alphas from 16 x 256 tokens of the shipped corpus' calibration split (prose and code),
             perplexity on 8 x 256 tokens of the held-out splits (4 per domain); timing on 4 x 256 tokens.
``real``     one decoder layer at the Qwen3-30B-A3B shape (hidden 2048, 128 experts, top-8, width
             768), random weights with routers ``normal(0, 0.05)`` (peaked gates like trained
             routers; the default 0.02 makes top-k weights nearly uniform), alphas from 2 x 512
             tokens, timing on 512 tokens; no perplexity (random weights).

Both the ``grouped_mm`` (transformers' default) and ``eager`` experts implementations are timed on
the shipped model, ``grouped_mm`` at the real shape. ``--paths`` times ``grouped_mm`` experts with each
skipping path of ``enable_adaptive(path=...)``: ``auto`` (``masked`` for ``grouped_mm``: static shapes, no
host read), ``masked`` and ``compact`` (the kept pairs gathered into a flattened call; always the path of
``eager``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import ompmoe
from ompmoe.engine.apply.adaptive import adaptive_report, adaptive_totals, disable_adaptive, enable_adaptive, reset_adaptive_counters
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from ompmoe.data import corpus_token_stream, shipped_model_path, token_blocks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import QWEN3_30B_A3B, build_model  # noqa: E402

EPSILONS = (0.0, 0.01, 0.05, 0.1, 0.2, 0.3)
SEQ_LEN = 256


def shipped_model() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The trained shipped model in float32, calibration blocks and held-out blocks (prose then code)."""
    path = shipped_model_path("tiny-moe")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    calibration, held_out = [], []
    for domain in ("prose", "code"):
        calibration.append(token_blocks(corpus_token_stream(tokenizer, domain, "calibration", SEQ_LEN * 8), SEQ_LEN, 8))
        held_out.append(token_blocks(corpus_token_stream(tokenizer, domain, "heldout", SEQ_LEN * 4), SEQ_LEN, 4))
    return model, torch.cat(calibration), torch.cat(held_out)


class BlockTimer:
    """Wall and CPU seconds spent inside the MoE blocks during one forward pass (summed over layers)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.wall = self.cpu = 0.0
        self._start = self._start_cpu = 0.0
        for layer in ompmoe.find_moe_layers(model):
            layer.block.register_forward_pre_hook(self._before)
            layer.block.register_forward_hook(self._after)

    def _before(self, module, args) -> None:
        self._start, self._start_cpu = time.perf_counter(), time.process_time()

    def _after(self, module, args, output) -> None:
        self.wall += time.perf_counter() - self._start
        self.cpu += time.process_time() - self._start_cpu


def configure(model: torch.nn.Module, stats: ompmoe.MoEStats, epsilon: float | None, path: str = "auto") -> None:
    if epsilon is None:
        disable_adaptive(model)
    else:
        enable_adaptive(model, stats, epsilon, path=path)


@torch.no_grad()
def perplexity(model: torch.nn.Module, blocks: torch.Tensor, batch: int) -> float:
    losses = [model(blocks[i : i + batch], labels=blocks[i : i + batch]).loss for i in range(0, len(blocks), batch)]
    return float(torch.stack(losses).mean().exp())


@torch.no_grad()
def benchmark(model, stats, timing_batch, held_out, repeats: int, batch: int,
              paths: tuple[str, ...] = ("auto",)) -> list[dict[str, float]]:
    """One row per (epsilon, path), all interleaved in each round; epsilon 0 and off once (no path applies)."""
    timer = BlockTimer(model)
    settings: list[tuple[float | None, str]] = [(None, "auto"), (0.0, "auto")]
    settings += [(epsilon, path) for epsilon in EPSILONS if epsilon != 0.0 for path in paths]
    samples = {i: {"moe": [], "moe_cpu": [], "wall": [], "cpu": []} for i in range(len(settings))}
    counters: dict[int, dict[str, float]] = {}
    for round_ in range(repeats + 1):  # round 0 warms up
        for i, (epsilon, path) in enumerate(settings):
            configure(model, stats, epsilon, path)
            timer.wall = timer.cpu = 0.0
            cpu, wall = time.process_time(), time.perf_counter()
            model(timing_batch)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if round_ == 0:
                if epsilon is not None:
                    counters[i] = adaptive_totals(adaptive_report(model))
                continue
            samples[i]["moe"].append(timer.wall)
            samples[i]["moe_cpu"].append(timer.cpu)
            samples[i]["wall"].append(wall)
            samples[i]["cpu"].append(cpu)
    results = []
    for i, (epsilon, path) in enumerate(settings):
        configure(model, stats, epsilon, path)
        if epsilon is not None:
            reset_adaptive_counters(model)
        ppl = perplexity(model, held_out, batch) if held_out is not None else float("nan")
        held = adaptive_totals(adaptive_report(model)) if epsilon is not None else None
        if held is not None and held_out is None:  # no held-out text: count on the timing batch
            held = counters[i]
        results.append(
            {
                "epsilon": epsilon,
                "path": path if epsilon else "",
                **{key: statistics.median(values) for key, values in samples[i].items()},
                "counters": counters.get(i),
                "held_out_counters": held,
                "ppl": ppl,
            }
        )
    disable_adaptive(model)
    return results


def print_table(results: list[dict], top_k: int) -> None:
    base = next(r for r in results if r["epsilon"] == 0.0)
    print(
        f"{'epsilon':>8} {'path':>7} {'experts/tok':>11} {'skip':>6} {'FLOPs':>6} {'MoE ms':>7} {'MoE x':>6} {'MoE x cpu':>9} "
        f"{'fwd ms':>7} {'fwd x':>6} {'fwd x cpu':>9} {'overhead':>8} {'held-out ppl':>12}"
    )
    for r in results:
        if r["epsilon"] is None:
            label, avg, skip, flops = "off", f"{top_k:.3f}", "0.000", "1.000"
        else:
            c = r["held_out_counters"]
            label = f"{r['epsilon']:g}"
            avg, skip, flops = f"{c['avg_experts_per_token']:.3f}", f"{c['skip_ratio']:.3f}", f"{c['flops_ratio']:.3f}"
        timing = r["counters"] if r["epsilon"] is not None else None
        overhead = f"{r['moe_cpu'] / base['moe_cpu'] - timing['flops_ratio']:+.3f}" if timing else ""
        print(
            f"{label:>8} {r['path']:>7} {avg:>11} {skip:>6} {flops:>6} {r['moe'] * 1e3:>7.1f} {base['moe'] / r['moe']:>6.2f} "
            f"{base['moe_cpu'] / r['moe_cpu']:>9.2f} {r['wall'] * 1e3:>7.1f} {base['wall'] / r['wall']:>6.2f} "
            f"{base['cpu'] / r['cpu']:>9.2f} {overhead:>8} {r['ppl']:>12.2f}"
        )


def main() -> None:
    global EPSILONS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--real_repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4, help="sequences of 256 tokens per forward pass")
    parser.add_argument("--models", nargs="+", default=["shipped", "real"], choices=["shipped", "real"])
    parser.add_argument("--implementations", nargs="+", default=["grouped_mm", "eager"])
    parser.add_argument("--paths", nargs="+", default=["auto"], choices=["auto", "masked", "compact"],
                        help="skipping paths timed for grouped_mm experts (eager always uses compact)")
    parser.add_argument("--epsilons", nargs="+", type=float, default=list(EPSILONS))
    args = parser.parse_args()
    EPSILONS = tuple(args.epsilons) if 0.0 in args.epsilons else (0.0, *args.epsilons)
    torch.set_num_threads(1)
    started = time.perf_counter()
    print("experts/tok, skip and FLOPs (= E[m]/K, routed experts) are counted on the held-out tokens (real shape: "
          "the timing batch); x = speedup vs epsilon=0 (wall clock; 'x cpu' from process CPU time); overhead = "
          "MoE CPU time / MoE CPU time at epsilon 0 - FLOPs ratio (break-even skip ratio)\n")
    if "shipped" in args.models:
        model, calibration, held_out = shipped_model()
        stats = ompmoe.collect_stats(model, calibration.split(args.batch))
        layers = ompmoe.find_moe_layers(model)
        alphas = torch.cat([layer.alpha for layer in stats.layers])
        print(
            f"shipped:tiny-moe (trained): {len(layers)} MoE layers x {layers[0].num_experts} experts, "
            f"top-{layers[0].top_k}; alphas from {stats.num_tokens} calibration tokens (median alpha "
            f"{alphas.median():.2f}); held-out {held_out.numel()} tokens (prose + code); timing: "
            f"{args.batch * SEQ_LEN} tokens per forward, median of {args.repeats}, 1 thread"
        )
        for implementation in args.implementations:
            model.set_experts_implementation(implementation)
            print(f"experts implementation: {implementation}")
            paths = tuple(args.paths) if implementation == "grouped_mm" else ("auto",)
            results = benchmark(model, stats, held_out[: args.batch], held_out, args.repeats, args.batch, paths)
            print_table(results, layers[0].top_k)
            print()
    if "real" in args.models:
        model = build_model(QWEN3_30B_A3B, 1, router_std=0.05)
        generator = torch.Generator().manual_seed(0)
        calibration = [torch.randint(0, 256, (1, 512), generator=generator) for _ in range(2)]
        timing_batch = torch.randint(0, 256, (1, 512), generator=generator)
        stats = ompmoe.collect_stats(model, calibration)
        print(
            "Qwen3-30B-A3B layer shape (random weights, routers normal(0, 0.05)): 1 decoder layer, hidden 2048, "
            f"128 experts, top-8, width 768; alphas from {stats.num_tokens} tokens; timing: 512 tokens per "
            f"forward, median of {args.real_repeats}, 1 thread; grouped_mm"
        )
        results = benchmark(model, stats, timing_batch, None, args.real_repeats, 1, tuple(args.paths))
        print_table(results, 8)
        print()
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
