"""OMP-MoE+ adaptive inference benchmark: experts per token, skip ratio, FLOPs and speed vs epsilon.

Run ``python benchmarks/adaptive.py`` (about a minute on one CPU thread). For epsilon in
0, 0.01, 0.05, 0.1, 0.2, 0.3 (and the plain model, adaptive inference off) it reports, on a
Qwen3-MoE-shaped model (4 MoE layers, 32 experts, top-8, d = d_ffn = 256):

- average experts executed per token and MoE layer, skip ratio, and the routed-expert FLOPs
  ratio ``E[m] / K`` (the paper's appendix: the rest of the layer is unchanged);
- wall-clock time of the MoE layers (router, selection and experts, summed over layers, timed
  by hooks on the sparse blocks) and of the whole forward pass, with speedups relative to
  epsilon = 0 measured in the same run (median over repeats, settings interleaved so background
  load hits all alike), in wall-clock and in process CPU time (which other processes disturb less);
- held-out perplexity on the shipped text (byte tokens).

The model is random (``ompmoe.engine.tiny``) until the trained tiny MoE of the quality issue exists, so
the perplexity column is meaningless (a random model is near or above the uniform 256). It is
built with ``initializer_range=0.06`` so expert energies ``alpha_e`` are O(10-100) as in real
models; with the default 0.02 they are ~0.07 and the absolute ``zeta = 1e-6`` already keeps
every expert at epsilon = 0.01. Alphas come from statistics on 16 x 256 calibration tokens.
Both the ``grouped_mm`` (transformers' default) and ``eager`` experts implementations are timed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import ompmoe
from ompmoe.engine.adaptive import adaptive_report, adaptive_totals, disable_adaptive, enable_adaptive, reset_adaptive_counters
from ompmoe.data import byte_tokens, shipped_text, token_blocks
from ompmoe.engine.tiny import tiny_model

EPSILONS = (0.0, 0.01, 0.05, 0.1, 0.2, 0.3)
SEQ_LEN = 256


def build_model(width: int = 256) -> torch.nn.Module:
    return tiny_model(
        "qwen3_moe",
        hidden_size=256,
        moe_intermediate_size=width,
        num_experts=32,
        num_experts_per_tok=8,
        num_hidden_layers=4,
        mlp_only_layers=[],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        initializer_range=0.06,
    )


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


def configure(model: torch.nn.Module, stats: ompmoe.MoEStats, epsilon: float | None) -> None:
    if epsilon is None:
        disable_adaptive(model)
    else:
        enable_adaptive(model, stats, epsilon)


@torch.no_grad()
def perplexity(model: torch.nn.Module, blocks: torch.Tensor, batch: int) -> float:
    losses = [model(blocks[i : i + batch], labels=blocks[i : i + batch]).loss for i in range(0, len(blocks), batch)]
    return float(torch.stack(losses).mean().exp())


@torch.no_grad()
def benchmark(model, stats, timing_batch, held_out, repeats: int, batch: int) -> list[dict[str, float]]:
    timer = BlockTimer(model)
    settings: list[float | None] = [None, *EPSILONS]
    samples = {i: {"moe": [], "moe_cpu": [], "wall": [], "cpu": []} for i in range(len(settings))}
    counters: dict[int, dict[str, float]] = {}
    for round_ in range(repeats + 1):  # round 0 warms up
        for i, epsilon in enumerate(settings):
            configure(model, stats, epsilon)
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
    for i, epsilon in enumerate(settings):
        configure(model, stats, epsilon)
        if epsilon is not None:
            reset_adaptive_counters(model)
        ppl = perplexity(model, held_out, batch)
        held = adaptive_totals(adaptive_report(model)) if epsilon is not None else None
        results.append(
            {
                "epsilon": epsilon,
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
        f"{'epsilon':>8} {'experts/tok':>11} {'skip':>6} {'FLOPs':>6} {'MoE ms':>7} {'MoE x':>6} {'MoE x cpu':>9} "
        f"{'fwd ms':>7} {'fwd x':>6} {'fwd x cpu':>9} {'held-out ppl':>12}"
    )
    for r in results:
        if r["epsilon"] is None:
            label, avg, skip, flops = "off", f"{top_k:.3f}", "0.000", "1.000"
        else:
            c = r["held_out_counters"]
            label = f"{r['epsilon']:g}"
            avg, skip, flops = f"{c['avg_experts_per_token']:.3f}", f"{c['skip_ratio']:.3f}", f"{c['flops_ratio']:.3f}"
        print(
            f"{label:>8} {avg:>11} {skip:>6} {flops:>6} {r['moe'] * 1e3:>7.1f} {base['moe'] / r['moe']:>6.2f} "
            f"{base['moe_cpu'] / r['moe_cpu']:>9.2f} {r['wall'] * 1e3:>7.1f} {base['wall'] / r['wall']:>6.2f} "
            f"{base['cpu'] / r['cpu']:>9.2f} {r['ppl']:>12.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--width", type=int, default=256, help="expert FFN width d_ffn")
    parser.add_argument("--batch", type=int, default=4, help="sequences of 256 tokens per forward pass")
    parser.add_argument("--implementations", nargs="+", default=["grouped_mm", "eager"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()

    tokens = byte_tokens(shipped_text())
    blocks = token_blocks(tokens, SEQ_LEN, 32)
    calibration, held_out = blocks[:16], blocks[24:32]
    timing_batch = held_out[: args.batch]

    model = build_model(args.width)
    stats = ompmoe.collect_stats(model, [calibration[i : i + args.batch] for i in range(0, 16, args.batch)])
    layers = ompmoe.find_moe_layers(model)
    top_k = layers[0].top_k
    alphas = torch.cat([layer.alpha for layer in stats.layers])
    print(
        f"qwen3_moe random: {len(layers)} MoE layers x {layers[0].num_experts} experts, top-{top_k}, d=256, "
        f"d_ffn={args.width}; alphas from {stats.num_tokens} calibration tokens (median alpha {alphas.median():.1f}); "
        f"held-out {held_out.numel()} tokens; timing: {timing_batch.numel()} tokens per forward, "
        f"median of {args.repeats}, 1 thread"
    )
    print("experts/tok, skip and FLOPs (= E[m]/K, routed experts) are counted on the held-out tokens; "
          "x = speedup vs epsilon=0 (wall clock; 'x cpu' from process CPU time); ppl is meaningless "
          "on a random model\n")
    for implementation in args.implementations:
        model.set_experts_implementation(implementation)
        print(f"experts implementation: {implementation}")
        results = benchmark(model, stats, timing_batch, held_out, args.repeats, args.batch)
        print_table(results, top_k)
        print()
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
