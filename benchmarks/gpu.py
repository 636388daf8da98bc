"""GPU figures: statistics pass at real shapes, a full-depth Qwen3-30B-A3B pass, adaptive speedup.

    python benchmarks/gpu.py --out results/           # on a CUDA machine, a few minutes
    python benchmarks/gpu.py --small --device cpu     # smoke test of the script itself

Sections (``--sections``):

``layer``  one decoder layer of Qwen3-30B-A3B and of DeepSeek-V3 in bf16 with ``grouped_mm``
           experts: plain forward vs ``collect_stats`` (interleaved medians, CUDA-synchronized wall
           clock, peak allocated memory), then OMP-MoE+ on the Qwen3 sparse block alone (the MoE
           layer: router, rule, experts) at epsilon 0, 0.01, 0.1 and off.
``full``   a random-init Qwen3-30B-A3B-shaped model at full depth (48 layers, real vocabulary, bf16,
           about 61 GB; built on meta, then materialized on the GPU), statistics over
           ``--sequences`` x ``--seq_len`` tokens, timed against plain forwards over the same
           tokens; if it does not fit, the most layers that do, extrapolated and labelled. Then
           end-to-end adaptive speedup at epsilon 0.1 vs 0 on the same model.

Routers get ``normal(0, --router_std)`` weights (0.05: peaked gates, as trained routers have; the
default 0.02 gives nearly uniform top-k weights and OMP-MoE+ would skip nothing). Everything else
is random; the compute equals that of real weights. Figures go to stdout and ``--out/gpu.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from search import measure_pair, peak_bytes, stats_bytes, synchronized  # noqa: E402
from shapes import DEEPSEEK_V3, QWEN3_30B_A3B, QWEN3_30B_A3B_LAYERS, build_model, describe  # noqa: E402

import ompmoe  # noqa: E402
import ompmoe.engine.replay as replay_module  # noqa: E402
from ompmoe.engine.adaptive import adaptive_report, adaptive_totals, disable_adaptive, enable_adaptive  # noqa: E402

GiB = 2**30


def shrink(shape: dict[str, Any]) -> dict[str, Any]:
    """A small stand-in of ``shape`` for smoke tests of this script."""
    small = dict(shape, hidden_size=128, moe_intermediate_size=32, intermediate_size=64)
    for key in ("num_experts", "n_routed_experts"):
        if key in small:
            small[key] = 16
    if "q_lora_rank" in small:
        small.update(q_lora_rank=32, kv_lora_rank=16, num_attention_heads=4, num_key_value_heads=4)
    else:
        small.update(num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    return small


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def interleaved(fns: dict[str, Any], repeats: int, device: torch.device) -> dict[str, float]:
    """Median seconds of each ``(setup, fn)``, interleaved; only ``fn`` is timed."""
    for setup, fn in fns.values():
        setup()
        timed(fn, device)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, (setup, fn) in fns.items():
            setup()
            samples[name].append(timed(fn, device))
    return {name: statistics.median(values) for name, values in samples.items()}


# --------------------------------------------------------------------------------- one layer
def section_layer(args, device, dtype, results) -> None:
    for label, shape, tokens in (("Qwen3-30B-A3B", QWEN3_30B_A3B, args.layer_tokens),
                                 ("DeepSeek-V3", DEEPSEEK_V3, args.layer_tokens)):
        shape = shrink(shape) if args.small else shape
        for tokens_now in sorted({512, tokens}):
            model = build_model(shape, 1, dtype=dtype, device=device, router_std=args.router_std)
            batch = torch.randint(0, 256, (1, tokens_now), generator=torch.Generator().manual_seed(0)).to(device)

            @torch.no_grad()
            def plain() -> None:
                model(input_ids=batch, use_cache=False)

            # Steady state of a long pass: one collector, timed per batch (its set-up, a few ms of
            # host work, is paid once per collect_stats call and would dominate a 5 ms layer).
            collector = ompmoe.StatisticsCollector(model)
            collector.metric.to(device)

            @torch.no_grad()
            def stats() -> None:
                with collector:
                    collector.forward({"input_ids": batch})

            (_, pw), (_, sw) = measure_pair(synchronized(plain, device), synchronized(stats, device), args.repeats)
            plain_peak, stats_peak = peak_bytes(plain, device), peak_bytes(stats, device)
            collected = collector.result()
            entry = dict(shape=label, describe=describe(shape), tokens=tokens_now, plain_s=pw, stats_s=sw,
                         ratio=sw / pw, plain_peak=plain_peak, stats_peak=stats_peak, stats_bytes=stats_bytes(collected))
            print(f"[layer] {label} {tokens_now} tokens: plain {pw * 1e3:.2f} ms, stats {sw * 1e3:.2f} ms, "
                  f"ratio {sw / pw:.3f}; peak {plain_peak / GiB:.2f} -> {stats_peak / GiB:.2f} GiB", flush=True)
            results["layer"].append(entry)
            if label == "Qwen3-30B-A3B" and tokens_now == tokens:
                results["layer_adaptive"] = layer_adaptive(args, model, collected, tokens_now, device, dtype)
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()


@torch.no_grad()
def layer_adaptive(args, model, stats, tokens, device, dtype) -> dict[str, Any]:
    """The sparse block alone on normalized random hidden states: the MoE-layer time per epsilon."""
    layer = ompmoe.find_moe_layers(model)[0]
    hidden = torch.randn(1, tokens, model.config.hidden_size, device=device, dtype=dtype,
                         generator=torch.Generator(device=device).manual_seed(1))
    settings = {"off": None, "0": 0.0, "0.01": 0.01, "0.1": 0.1}
    fns, counters = {}, {}
    for name, epsilon in settings.items():
        def setup(epsilon=epsilon) -> None:
            if epsilon is None:
                disable_adaptive(model)
            else:
                enable_adaptive(model, stats, epsilon)
        fns[name] = (setup, lambda: layer.block(hidden))
    medians = interleaved(fns, args.repeats, device)
    for name, epsilon in settings.items():
        if epsilon is not None:
            enable_adaptive(model, stats, epsilon)
            layer.block(hidden)
            counters[name] = adaptive_totals(adaptive_report(model))
    disable_adaptive(model)
    out = {name: dict(seconds=medians[name], speedup_vs_eps0=medians["0"] / medians[name],
                      **({} if name == "off" else {k: counters[name][k] for k in ("skip_ratio", "flops_ratio")}))
           for name in settings}
    for name, entry in out.items():
        extra = f", skip {entry['skip_ratio']:.3f}, FLOPs {entry['flops_ratio']:.3f}" if "skip_ratio" in entry else ""
        print(f"[layer adaptive] eps {name}: MoE layer {entry['seconds'] * 1e3:.2f} ms, "
              f"x{entry['speedup_vs_eps0']:.3f} vs eps 0{extra}", flush=True)
    return out


# ------------------------------------------------------------------------------- full depth
def build_full(args, device, dtype) -> tuple[torch.nn.Module, int]:
    shape = shrink(QWEN3_30B_A3B) if args.small else QWEN3_30B_A3B
    layers = args.full_layers
    while True:
        try:
            model = build_model(shape, layers, vocab_size=256 if args.small else None, dtype=dtype, device=device,
                                router_std=args.router_std)
            if device.type == "cuda":  # leave room for the activations of one batch
                free, total = torch.cuda.mem_get_info(device)
                if free < args.headroom_gib * GiB:
                    raise torch.OutOfMemoryError(f"only {free / GiB:.1f} GiB free after the weights")
            return model, layers
        except torch.OutOfMemoryError as error:
            print(f"[full] {layers} layers do not fit ({error}); trying {layers - 4}", flush=True)
            model = None
            gc.collect()
            torch.cuda.empty_cache()
            layers -= 4


@torch.no_grad()
def section_full(args, device, dtype, results) -> None:
    start = time.perf_counter()
    model, layers = build_full(args, device, dtype)
    build_s = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"[full] {layers} layers, {params / 1e9:.2f} B parameters, {weights / GiB:.1f} GiB of weights, "
          f"built in {build_s:.1f} s", flush=True)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (args.batch, args.seq_len), generator=generator).to(device)
               for _ in range(args.sequences // args.batch)]
    tokens = sum(b.numel() for b in batches)

    def plain_pass() -> None:
        for batch in batches:
            model(input_ids=batch, use_cache=False, logits_to_keep=1)

    stats_holder: list[ompmoe.MoEStats] = []

    def stats_pass() -> None:
        stats_holder[:] = [ompmoe.collect_stats(model, batches)]

    timed(lambda: model(input_ids=batches[0], use_cache=False, logits_to_keep=1), device)  # warm-up
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    plain_s = timed(plain_pass, device)
    stats_s = timed(stats_pass, device)
    plain_s2 = timed(plain_pass, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    plain_med = min(plain_s, plain_s2)
    scale = QWEN3_30B_A3B_LAYERS / layers
    entry = dict(layers=layers, extrapolated_to_48=layers != QWEN3_30B_A3B_LAYERS, parameters=params,
                 weight_bytes=weights, tokens=tokens, batch=args.batch, seq_len=args.seq_len, build_s=build_s,
                 plain_s=[plain_s, plain_s2], stats_s=stats_s, ratio=stats_s / plain_med, peak=peak,
                 stats_s_48_layers=stats_s * scale, paper_search_s=641.0, paper_gpus=8)
    label = "" if layers == QWEN3_30B_A3B_LAYERS else f" (EXTRAPOLATED from {layers} layers: {stats_s * scale:.1f} s)"
    print(f"[full] {tokens} tokens: plain forward {plain_s:.1f} / {plain_s2:.1f} s, statistics pass {stats_s:.1f} s "
          f"(ratio {stats_s / plain_med:.3f}){label}; peak {peak / GiB:.1f} GiB; paper: 641 s on 8 GPUs", flush=True)
    results["full"] = entry

    # End-to-end adaptive speedup on the same model: epsilon 0.1 vs 0 vs off.
    stats = stats_holder[0]
    timing = batches[: args.adaptive_batches]

    def forward_all() -> None:
        for batch in timing:
            model(input_ids=batch, use_cache=False, logits_to_keep=1)

    fns = {}
    for name, epsilon in (("off", None), ("0", 0.0), ("0.1", 0.1)):
        def setup(epsilon=epsilon) -> None:
            if epsilon is None:
                disable_adaptive(model)
            else:
                enable_adaptive(model, stats, epsilon)
        fns[name] = (setup, forward_all)
    medians = interleaved(fns, args.adaptive_repeats, device)
    enable_adaptive(model, stats, 0.1)
    forward_all()
    counters = adaptive_totals(adaptive_report(model))
    disable_adaptive(model)
    adaptive = {name: dict(seconds=value, speedup_vs_eps0=medians["0"] / value) for name, value in medians.items()}
    adaptive["0.1"].update(skip_ratio=counters["skip_ratio"], flops_ratio=counters["flops_ratio"])
    results["full_adaptive"] = adaptive
    print(f"[full adaptive] {sum(b.numel() for b in timing)} tokens per pass: off {medians['off']:.2f} s, eps 0 "
          f"{medians['0']:.2f} s, eps 0.1 {medians['0.1']:.2f} s (x{medians['0'] / medians['0.1']:.3f} end to end; "
          f"skip {counters['skip_ratio']:.3f}, FLOPs {counters['flops_ratio']:.3f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", default=["layer", "full"], choices=["layer", "full"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny stand-in shapes (smoke test)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--layer_tokens", type=int, default=4096)
    parser.add_argument("--router_std", type=float, default=0.05)
    parser.add_argument("--full_layers", type=int, default=QWEN3_30B_A3B_LAYERS)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--seq_len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2, help="sequences per forward pass")
    parser.add_argument("--headroom_gib", type=float, default=6.0)
    parser.add_argument("--adaptive_batches", type=int, default=4)
    parser.add_argument("--adaptive_repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="directory for gpu.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        torch.set_num_threads(1)
    import transformers

    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.version.cuda,
        "ompmoe": ompmoe.__version__, "dtype": str(dtype), "router_std": args.router_std, "layer": [],
        "grouped_mm_replay": replay_module._grouped_linear is not None,
    }
    print(json.dumps({k: v for k, v in results.items() if k != "layer"}), flush=True)
    try:
        if "layer" in args.sections:
            section_layer(args, device, dtype, results)
        if "full" in args.sections:
            section_full(args, device, dtype, results)
    finally:
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "gpu.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
