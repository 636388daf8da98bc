"""GPU figures: statistics pass and OMP-MoE+ at real layer shapes, a full-depth Qwen3-30B-A3B, the whole pruning job.

    python benchmarks/gpu.py --out DIR                 # on a CUDA machine, about 4 minutes on an H100/H200
    python benchmarks/gpu.py --small --device cpu      # smoke test of the script itself (seconds to a minute)

Sections (``--sections``, in this order; ``DIR/gpu.json`` is rewritten after each, so a run cut short keeps what it
measured):

``layer``  one decoder layer of Qwen3-30B-A3B and of DeepSeek-V3 in bf16 with ``grouped_mm`` experts, per token
           count (``--layer_tokens``): plain forward vs the statistics pass (interleaved medians of
           CUDA-synchronized wall clock, peak allocated memory); then OMP-MoE+ on the sparse block alone (router,
           rule, experts) with adaptive inference off, at epsilon 0, and at epsilon 0.01 / 0.1 with each skipping
           path (``masked``: static shapes, no host read; ``compact``: the kept pairs gathered, one host read), the
           two paths' outputs compared, host synchronizations counted (``torch.cuda.set_sync_debug_mode``), and the
           block captured in a CUDA graph with and without adaptive inference.
``full``   a random-init Qwen3-30B-A3B-shaped model at full depth (48 layers, real vocabulary, bf16, about 61 GB;
           built on meta, then materialized on the GPU: the job's "load"), the statistics the paper's setting
           (``omp``, ``waterfill``) needs over ``--sequences`` x ``--seq_len`` tokens timed against a plain forward
           over the same tokens, then end-to-end forwards at 4,096 and 16,384 tokens per call: the unpruned model
           with adaptive inference off, OMP-MoE+ epsilon 0.1 on each path, and the model as if statically pruned
           at 0.25 (``pruned_view``).
``compensation``  on the ``full`` section's model, the compensation pass as a run fits it by default (``linear``,
           ``fitting_tokens`` of the calibration text: 16 per hidden dimension, at most a quarter of it; the paper's
           plan at 0.5) timed against a plain forward over the same fitting tokens; its ratio to the plain forward
           over the whole calibration text (the goal: at most 0.5), peak memory, the ``d x d`` sums' size and the host
           synchronizations of one batch's pass.
``job``    the rest of the whole job as ``ompmoe fit`` runs it by default (``method=auto, allocation=auto``, ratio
           0.5): the statistics ``auto`` needs for this layout (for Qwen3-MoE the loss-aware sums: one backward per
           batch), plan (every candidate), choose (each candidate tried on one held-out block), prune, save (to
           ``/dev/shm`` when it has room, else a temporary directory on disk; ``--save_dir`` to choose), then the
           same model saved again by stock ``save_pretrained`` for the ratio and a byte comparison of the weight
           files (``--no_stock_save`` skips it). Then the
           pruned model's end-to-end forwards with OMP-MoE+ off and at epsilon 0.1. The breakdown per step and the
           two totals (``auto``, and the paper's setting with the ``full`` section's statistics) are printed last.

Routers get ``normal(0, --router_std)`` weights (0.05: peaked gates, as trained routers have; the default 0.02 gives
nearly uniform top-k weights and OMP-MoE+ would skip nothing). Everything else is random; the compute equals that of
real weights. Tokens are random ids.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from search import measure_pair, peak_bytes, stats_bytes, synchronized  # noqa: E402
from shapes import DEEPSEEK_V3, QWEN3_30B_A3B, QWEN3_30B_A3B_LAYERS, build_model, describe  # noqa: E402

import ompmoe  # noqa: E402
import ompmoe.engine.collect.replay as replay_module  # noqa: E402
from ompmoe.engine.apply.adaptive import (  # noqa: E402
    adaptive_paths,
    adaptive_report,
    adaptive_totals,
    disable_adaptive,
    enable_adaptive,
    masked_path_supported,
)

GiB = 2**30
PAPER = {"search_s": 641.0, "search_gpus": "8 x H20", "eval_speedup_omp_plus": 1.46, "eval_speedup_static": 1.35}


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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def interleaved(fns: dict[str, Any], repeats: int, device: torch.device) -> dict[str, float]:
    """Median seconds of each ``(setup, fn)``, interleaved after one warm-up round; only ``fn`` is timed."""
    for setup, fn in fns.values():
        setup()
        timed(fn, device)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, (setup, fn) in fns.items():
            setup()
            samples[name].append(timed(fn, device))
    return {name: statistics.median(values) for name, values in samples.items()}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def layer_settings() -> dict[str, tuple[float | None, str]]:
    """Name -> (epsilon or None for off, path)."""
    return {"off": (None, "auto"), "eps 0": (0.0, "auto"), "eps 0.01 masked": (0.01, "masked"),
            "eps 0.01 compact": (0.01, "compact"), "eps 0.1 masked": (0.1, "masked"),
            "eps 0.1 compact": (0.1, "compact")}


def configure(model, stats, epsilon: float | None, path: str) -> None:
    if epsilon is None:
        disable_adaptive(model)
    else:
        enable_adaptive(model, stats, epsilon, path=path)


def count_syncs(fn, device: torch.device) -> int | None:
    """Host synchronizations one call of ``fn`` makes (``torch.cuda.set_sync_debug_mode('warn')``)."""
    if device.type != "cuda":
        return None
    sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync(device)
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def graph_timing(fn, repeats: int, device: torch.device) -> dict[str, Any]:
    """Capture ``fn`` in a CUDA graph; median replay seconds and its output (or the error)."""
    if device.type != "cuda":
        return {"error": "no CUDA"}
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        graph.replay()
        sync(device)
        seconds = statistics.median(timed(graph.replay, device) for _ in range(repeats))
        first = out[0] if isinstance(out, tuple) else out
        return {"seconds": seconds, "output": first.detach().clone()}
    except Exception as error:  # report, do not stop the run
        return {"error": f"{type(error).__name__}: {str(error)[:300]}"}


# --------------------------------------------------------------------------------- one layer
def section_layer(args, device, dtype, results, save) -> None:
    shapes = {"qwen3": ("Qwen3-30B-A3B", QWEN3_30B_A3B), "deepseek": ("DeepSeek-V3", DEEPSEEK_V3)}
    for key in args.shapes:
        label, shape = shapes[key]
        shape = shrink(shape) if args.small else shape
        model = build_model(shape, 1, dtype=dtype, device=device, router_std=args.router_std)
        layer = ompmoe.find_moe_layers(model)[0]
        if not masked_path_supported(layer.experts):
            raise SystemExit(f"the masked path does not apply to this {label} layer (transformers "
                             f"{__import__('transformers').__version__}): stop, the adaptive figures would be wrong")
        for tokens in args.layer_tokens:
            batch = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)

            @torch.no_grad()
            def plain(model: torch.nn.Module = model, batch: torch.Tensor = batch) -> None:  # bound: deleted below
                model(input_ids=batch, use_cache=False)

            # Steady state of a long pass: one collector, timed per batch (its set-up, a few ms of host work, is
            # paid once per collect_stats call and would dominate a 5 ms layer).
            collector = ompmoe.StatisticsCollector(model)
            collector.metric.to(device)

            @torch.no_grad()
            def stats_pass(collector: ompmoe.StatisticsCollector = collector, batch: torch.Tensor = batch) -> None:
                with collector:
                    collector.forward({"input_ids": batch})

            (_, pw), (_, sw) = measure_pair(synchronized(plain, device), synchronized(stats_pass, device),
                                            args.repeats)
            plain_peak, stats_peak = peak_bytes(plain, device), peak_bytes(stats_pass, device)
            collected = collector.result()
            entry = dict(shape=label, describe=describe(shape), tokens=tokens, plain_s=pw, stats_s=sw,
                         ratio=sw / pw, plain_peak=plain_peak, stats_peak=stats_peak,
                         stats_bytes=stats_bytes(collected))
            print(f"[layer] {label} {tokens} tokens: plain {pw * 1e3:.2f} ms, stats {sw * 1e3:.2f} ms, ratio "
                  f"{sw / pw:.3f}; peak {plain_peak / GiB:.2f} -> {stats_peak / GiB:.2f} GiB", flush=True)
            results["layer"].append(entry)
            if tokens >= args.adaptive_min_tokens:
                results["layer_adaptive"].append(layer_adaptive(args, model, layer, collected, label, tokens,
                                                                device, dtype))
            save()
            del collector
        del model, layer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


@torch.no_grad()
def layer_adaptive(args, model, layer, stats, label, tokens, device, dtype) -> dict[str, Any]:
    """The sparse block alone on random hidden states: the MoE-layer time per setting, paths compared."""
    hidden = torch.randn(1, tokens, model.config.hidden_size, device=device, dtype=dtype,
                         generator=torch.Generator(device=device).manual_seed(1))
    settings = layer_settings()
    fns = {name: ((lambda e=epsilon, p=path: configure(model, stats, e, p)), lambda: layer.block(hidden))
           for name, (epsilon, path) in settings.items()}
    medians = interleaved(fns, args.repeats, device)
    entry: dict[str, Any] = {"shape": label, "tokens": tokens, "settings": {}}
    outputs = {}
    for name, (epsilon, path) in settings.items():
        configure(model, stats, epsilon, path)
        out = layer.block(hidden)
        outputs[name] = (out[0] if isinstance(out, tuple) else out).clone()
        row = dict(seconds=medians[name], speedup_vs_off=medians["off"] / medians[name])
        if epsilon is not None:
            totals = adaptive_totals(adaptive_report(model))
            row.update(skip_ratio=totals["skip_ratio"], flops_ratio=totals["flops_ratio"],
                       path_taken=sorted(set(adaptive_paths(model).values())))
        row["host_syncs_per_call"] = count_syncs(lambda: layer.block(hidden), device)
        entry["settings"][name] = row
    for epsilon in ("0.01", "0.1"):
        entry[f"masked_vs_compact_rel_error_eps_{epsilon}"] = relative_error(outputs[f"eps {epsilon} masked"],
                                                                           outputs[f"eps {epsilon} compact"])
    entry["eps0_vs_off_rel_error"] = relative_error(outputs["eps 0"], outputs["off"])
    disable_adaptive(model)
    for name, row in entry["settings"].items():
        extra = (f", skip {row['skip_ratio']:.3f}, path {'/'.join(row['path_taken'])}" if "skip_ratio" in row else "")
        print(f"[layer adaptive] {label} {tokens} tokens, {name}: MoE block {row['seconds'] * 1e3:.3f} ms, "
              f"x{row['speedup_vs_off']:.3f} vs off{extra}; host syncs per call {row['host_syncs_per_call']}",
              flush=True)
    print(f"[layer adaptive] {label} {tokens} tokens: masked vs compact rel. error eps 0.01 "
          f"{entry['masked_vs_compact_rel_error_eps_0.01']:.2e}, eps 0.1 {entry['masked_vs_compact_rel_error_eps_0.1']:.2e}",
          flush=True)
    return entry


@torch.no_grad()
def section_graph(args, device, dtype, results, save) -> None:
    """The Qwen3-30B-A3B sparse block captured in a CUDA graph, adaptive inference off and masked at epsilon 0.1
    (last, so that a failed capture cannot disturb the other sections)."""
    shape = shrink(QWEN3_30B_A3B) if args.small else QWEN3_30B_A3B
    model = build_model(shape, 1, dtype=dtype, device=device, router_std=args.router_std)
    layer = ompmoe.find_moe_layers(model)[0]
    for tokens in args.graph_tokens:
        batch = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)
        stats = ompmoe.collect_stats(model, [batch])
        hidden = torch.randn(1, tokens, model.config.hidden_size, device=device, dtype=dtype,
                             generator=torch.Generator(device=device).manual_seed(1))
        entry: dict[str, Any] = {"tokens": tokens}
        for name, epsilon, path in (("off", None, "auto"), ("eps 0.1 masked", 0.1, "masked")):
            configure(model, stats, epsilon, path)
            eager_out = layer.block(hidden)
            eager_out = (eager_out[0] if isinstance(eager_out, tuple) else eager_out).clone()
            eager_s = statistics.median(timed(lambda: layer.block(hidden), device) for _ in range(args.repeats))
            result = graph_timing(lambda: layer.block(hidden), args.repeats, device)
            if "output" in result:
                result["rel_error_vs_eager"] = relative_error(result.pop("output"), eager_out)
            result["eager_seconds"] = eager_s
            if epsilon is not None:
                result["counted_tokens"] = adaptive_totals(adaptive_report(model))["tokens"]
            entry[name] = result
            print(f"[graph] Qwen3-30B-A3B block {tokens} tokens, {name}: {json.dumps(result, default=str)}",
                  flush=True)
        if "seconds" in entry["off"] and "seconds" in entry["eps 0.1 masked"]:
            entry["speedup_eps_0.1_masked_vs_off"] = entry["off"]["seconds"] / entry["eps 0.1 masked"]["seconds"]
        disable_adaptive(model)
        results["graph"].append(entry)
        save()


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


def end_to_end(args, model, stats, calls: dict[str, list[torch.Tensor]], settings, device) -> dict[str, Any]:
    """Median seconds of forwarding each list of batches (logits of the last position only), per setting."""
    out: dict[str, Any] = {}
    for per_call, batches in calls.items():
        def forward_all(batches=batches) -> None:
            with torch.no_grad():
                for batch in batches:
                    model(input_ids=batch, use_cache=False, logits_to_keep=1)

        fns = {name: (setup, forward_all) for name, setup in settings.items()}
        medians = interleaved(fns, args.e2e_repeats, device)
        rows = {}
        for name, setup in settings.items():
            setup()
            forward_all()
            row = {"seconds": medians[name]}
            report = adaptive_report(model)
            if report:
                totals = adaptive_totals(report)
                row.update(skip_ratio=totals["skip_ratio"], flops_ratio=totals["flops_ratio"],
                           path_taken=sorted(set(adaptive_paths(model).values())))
            rows[name] = row
        base = rows[next(iter(rows))]["seconds"]
        for name, row in rows.items():
            row["speedup_vs_first"] = base / row["seconds"]
            extra = f", skip {row['skip_ratio']:.3f}" if "skip_ratio" in row else ""
            print(f"[e2e] {per_call} tokens per call x {len(batches)} calls, {name}: {row['seconds']:.3f} s, "
                  f"x{row['speedup_vs_first']:.3f} vs {next(iter(rows))}{extra}", flush=True)
        out[per_call] = {"calls": len(batches), "tokens": sum(b.numel() for b in batches), "settings": rows}
    return out


def e2e_calls(args, vocab: int, device) -> dict[str, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    seq = args.seq_len
    calls = {}
    for sequences_per_call in args.e2e_sequences_per_call:
        count = max(1, args.e2e_tokens // (sequences_per_call * seq))
        calls[str(sequences_per_call * seq)] = [
            torch.randint(0, vocab, (sequences_per_call, seq), generator=generator).to(device) for _ in range(count)]
    return calls


def section_full(args, device, dtype, results, save, state) -> None:
    start = time.perf_counter()
    model, layers = build_full(args, device, dtype)
    sync(device)
    build_s = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"[full] {layers} layers, {params / 1e9:.2f} B parameters, {weights / GiB:.1f} GiB of weights, built "
          f"(the job's load) in {build_s:.1f} s", flush=True)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (args.batch, args.seq_len), generator=generator).to(device)
               for _ in range(args.sequences // args.batch)]
    tokens = sum(b.numel() for b in batches)

    def plain_pass() -> None:
        with torch.no_grad():
            for batch in batches:
                model(input_ids=batch, use_cache=False, logits_to_keep=1)

    holder: list[ompmoe.MoEStats] = []

    def stats_pass() -> None:
        holder[:] = [ompmoe.collect_stats(model, batches)]

    with torch.no_grad():  # warm-up: kernels of both passes at the timed shapes
        timed(lambda: model(input_ids=batches[0], use_cache=False, logits_to_keep=1), device)
    timed(lambda: ompmoe.collect_stats(model, [batches[0]]), device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    stats_s = timed(stats_pass, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    plain_s = timed(plain_pass, device)
    stats = holder[0]
    plan_start = time.perf_counter()
    paper_plan = ompmoe.plan_pruning(stats, 0.5, method="omp", allocation="waterfill")
    paper_plan_s = time.perf_counter() - plan_start
    scale = QWEN3_30B_A3B_LAYERS / layers
    entry = dict(layers=layers, extrapolated_to_48=layers != QWEN3_30B_A3B_LAYERS, parameters=params,
                 weight_bytes=weights, tokens=tokens, batch=args.batch, seq_len=args.seq_len, load_s=build_s,
                 stats_s=stats_s, plain_s=plain_s, ratio=stats_s / plain_s, peak=peak,
                 stats_s_48_layers=stats_s * scale, paper_plan_s=paper_plan_s, paper=PAPER)
    print(f"[full] {tokens} tokens: statistics pass {stats_s:.2f} s, plain forward {plain_s:.2f} s (ratio "
          f"{stats_s / plain_s:.3f}); peak {peak / GiB:.1f} GiB; plan (omp, waterfill, 0.5) {paper_plan_s * 1e3:.0f} ms; "
          f"paper: 641 s on 8 x H20", flush=True)
    results["full"] = entry
    save()

    calls = e2e_calls(args, vocab, device)
    quarter = ompmoe.plan_pruning(stats, 0.25, method="omp", allocation="waterfill")
    from ompmoe.engine.apply.trial import pruned_view

    view_state: dict[str, Any] = {}

    def as_pruned(plan):
        def setup() -> None:
            leave_view()
            disable_adaptive(model)
            view_state["context"] = pruned_view(model, plan)
            view_state["context"].__enter__()
        return setup

    def leave_view() -> None:
        if "context" in view_state:
            view_state.pop("context").__exit__(None, None, None)

    def adaptive_setup(epsilon, path):
        def setup() -> None:
            leave_view()
            configure(model, stats, epsilon, path)
        return setup

    settings = {"unpruned, off": adaptive_setup(None, "auto"),
                "unpruned, OMP-MoE+ eps 0.1 masked": adaptive_setup(0.1, "masked"),
                "unpruned, OMP-MoE+ eps 0.1 compact": adaptive_setup(0.1, "compact"),
                "static 0.25 (pruned_view)": as_pruned(quarter),
                "static 0.5 (pruned_view)": as_pruned(paper_plan)}
    try:
        results["full_e2e"] = end_to_end(args, model, stats, calls, settings, device)
    finally:
        leave_view()
        disable_adaptive(model)
    save()
    state.update(model=model, batches=batches, calls=calls, paper_stats=stats, layers=layers)


# ------------------------------------------------------------------------------- compensation
def section_compensation(args, device, dtype, results, save, state) -> None:
    from ompmoe.engine.apply.compensation import (
        compensate, compensation_sums, fitting_tokens, linear_sum_bytes, spread_blocks,
    )

    model, batches = state["model"], state["batches"]
    plan = ompmoe.plan_pruning(state["paper_stats"], 0.5, method="omp", allocation="waterfill")
    calibration = torch.cat(batches)
    blocks = spread_blocks(calibration, fitting_tokens(model, calibration.numel()))
    fit_batches = list(blocks.split(args.batch))
    fit_tokens = blocks.numel()

    def plain_pass() -> None:
        with torch.no_grad():
            for batch in fit_batches:
                model(input_ids=batch, use_cache=False, logits_to_keep=1)

    def compensation_pass() -> None:  # the fit and its record included, as compensate runs in the job
        compensate(model, plan, blocks, args.batch, max_tokens=None)

    compensate(model, plan, fit_batches[0], args.batch, max_tokens=None)  # warm-up at the timed shapes
    syncs = count_syncs(lambda: compensation_sums(model, plan, [fit_batches[0]]), device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    compensate_s = timed(compensation_pass, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    plain_s = timed(plain_pass, device)
    calibration_s = results["full"]["plain_s"]  # the same batches, over every calibration token
    entry = dict(granularity="linear", fitting_tokens=fit_tokens, calibration_tokens=calibration.numel(),
                 batch=args.batch, compensate_s=compensate_s, plain_s=plain_s, ratio=compensate_s / plain_s,
                 ratio_vs_calibration_forward=compensate_s / calibration_s, peak=peak,
                 sum_bytes=sum(linear_sum_bytes(ompmoe.find_moe_layers(model)).values()),
                 host_syncs_one_batch=syncs)
    print(f"[compensation] linear on {fit_tokens} of {calibration.numel()} calibration tokens: {compensate_s:.2f} s, "
          f"plain forward over them {plain_s:.2f} s (ratio {entry['ratio']:.3f}; "
          f"{entry['ratio_vs_calibration_forward']:.3f} x the forward over the calibration text, goal <= 0.5); "
          f"d x d sums {entry['sum_bytes'] / GiB:.2f} GiB, "
          f"peak {peak / GiB:.1f} GiB, {syncs} host syncs for one batch's sums", flush=True)
    results["compensation"] = entry
    save()


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def section_job(args, device, dtype, results, save, state) -> None:
    from ompmoe import PruningRun, PruningStrategy
    from ompmoe.engine.apply.plan_choice import choose_plan
    from ompmoe.engine.ranks import RunContext
    from ompmoe.engine.apply.compensation_step import compensation_line, fit_compensation

    model, batches = state["model"], state["batches"]
    job: dict[str, Any] = {"load_s": results["full"]["load_s"]}
    run = PruningRun(strategy=PruningStrategy(ratio=0.5, method="auto", allocation="auto"), plots=False)
    collector = run.start(model, RunContext(), model_id="random Qwen3-30B-A3B shape")
    job["statistics_collected"] = sorted(run.statistics)
    job["batch"] = args.job_batch
    sequences = torch.cat(batches)
    job_batches = list(sequences.split(args.job_batch))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    try:
        run.collect(job_batches)
        stats = collector.result()
    except torch.OutOfMemoryError as error:  # the loss-aware backward does not fit: the paper's setting instead
        stats = None
        job["auto_error"] = f"out of memory at {args.job_batch} sequences per forward: {str(error)[:200]}"
        print(f"[job] {job['auto_error']}; the job goes on with the paper's setting (omp, waterfill) and the full "
              "section's statistics", flush=True)
    del collector
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    sync(device)
    if stats is not None:
        job["statistics_s"] = time.perf_counter() - started
        job["statistics_peak"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        print(f"[job] statistics for auto ({', '.join(job['statistics_collected']) or 'plain'}): "
              f"{job['statistics_s']:.2f} s, peak {job['statistics_peak'] / GiB:.1f} GiB", flush=True)
        started = time.perf_counter()
        candidates = run.strategy.candidates(stats)
        job["plan_s"] = time.perf_counter() - started
    else:
        stats = state["paper_stats"]
        job["statistics_s"] = results["full"]["stats_s"]
        started = time.perf_counter()
        candidates = [ompmoe.plan_pruning(stats, 0.5, method="omp", allocation="waterfill")]
        job["plan_s"] = time.perf_counter() - started
    job["candidates"] = [f"{plan.method}/{plan.allocation}" for plan in candidates]
    blocks = torch.randint(0, model.config.vocab_size, (1, args.seq_len),
                           generator=torch.Generator().manual_seed(9)).to(device)
    started = time.perf_counter()
    if len(candidates) > 1:
        choice = choose_plan(model, candidates, blocks, 1)
        plan, job["losses"] = candidates[choice.index], choice.losses
    else:
        plan = candidates[0]
    sync(device)
    job["choose_s"] = time.perf_counter() - started
    job["chosen"] = f"{plan.method}/{plan.allocation}"
    print(f"[job] plan {job['plan_s'] * 1e3:.0f} ms ({', '.join(job['candidates'])}), choose {job['choose_s']:.2f} s "
          f"-> {job['chosen']}", flush=True)
    started = time.perf_counter()  # the run's compensation step: fit, check on the choice blocks, apply after prune
    loss_without = job.get("losses", {}).get(f"{plan.method} + {plan.allocation}")
    compensation, record = fit_compensation(model, plan, sequences, args.job_batch, "linear", blocks, loss_without)
    sync(device)
    job["compensate_s"] = time.perf_counter() - started
    job["compensation"] = {key: value for key, value in record.items() if key != "layer_scales"}
    print(f"[job] compensate {job['compensate_s']:.2f} s ({record['num_tokens']} tokens): {compensation_line(record)}",
          flush=True)
    started = time.perf_counter()
    ompmoe.prune(model, plan)
    if compensation is not None:
        compensation.apply(model)
    sync(device)
    job["prune_s"] = time.perf_counter() - started
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    pruned_weights = sum(p.numel() * p.element_size() for p in model.parameters())
    job["pruned_weight_bytes"] = pruned_weights
    print(f"[job] prune {job['prune_s']:.2f} s: {pruned_weights / GiB:.1f} GiB of weights left", flush=True)
    results["job"] = job
    save()

    # The pruned model's end-to-end forwards, off and with OMP-MoE+ (alphas of the unpruned statistics).
    settings = {"pruned 0.5, off": lambda: disable_adaptive(model),
                "pruned 0.5, OMP-MoE+ eps 0.1 masked": lambda: enable_adaptive(model, stats, 0.1, path="masked"),
                "pruned 0.5, OMP-MoE+ eps 0.1 compact": lambda: enable_adaptive(model, stats, 0.1, path="compact")}
    results["pruned_e2e"] = end_to_end(args, model, stats, state["calls"], settings, device)
    disable_adaptive(model)
    save()

    if args.no_save:
        job["save"] = "skipped (--no_save)"
    else:
        need = pruned_weights * 1.1 + GiB
        base = Path(args.save_dir) if args.save_dir else None
        if base is None:
            shm = Path("/dev/shm")
            base = shm if shm.is_dir() and shutil.disk_usage(shm).free > need else Path(tempfile.gettempdir())
        job["save_target"] = f"{base} ({'RAM-backed tmpfs' if str(base).startswith('/dev/shm') else 'disk'}, "
        job["save_target"] += f"{shutil.disk_usage(base).free / GiB:.0f} GiB free before)"
        target = base / "ompmoe_gpu_job_model"
        if target.exists():
            shutil.rmtree(target)
        started = time.perf_counter()
        try:
            ompmoe.save_pruned(model, target, calibration="random tokens")
            job["save_s"] = time.perf_counter() - started
            job["saved_bytes"] = dir_bytes(target)
            print(f"[job] save {job['save_s']:.2f} s: {job['saved_bytes'] / GiB:.1f} GiB to {job['save_target']}",
                  flush=True)
            if not args.no_stock_save:
                stock_save(model, target, base, need, job)
        except Exception as error:
            job["save_error"] = f"{type(error).__name__}: {str(error)[:300]}"
            print(f"[job] save failed after {time.perf_counter() - started:.1f} s: {job['save_error']}", flush=True)
        finally:
            shutil.rmtree(target, ignore_errors=True)
    steps = ["load_s", "statistics_s", "plan_s", "choose_s", "compensate_s", "prune_s", "save_s"]
    job["total_s"] = sum(job.get(step, 0.0) for step in steps)
    full = results["full"]
    job["paper_setting_total_s"] = (full["load_s"] + full["stats_s"] + full["paper_plan_s"] + job["prune_s"]
                                    + job.get("save_s", 0.0))
    save()


def stock_save(model, saved: Path, base: Path, need: float, job: dict[str, Any]) -> None:
    """The same model saved by stock ``save_pretrained`` (safetensors' own single-threaded writer) beside
    ``save_pruned``'s copy: its time, the ratio, and whether the weight files are the same bytes."""
    import filecmp

    from ompmoe._quiet import quiet_calls

    if shutil.disk_usage(base).free < need:
        job["stock_save"] = f"skipped: {base} has no room for a second copy"
        return
    target = base / "ompmoe_gpu_job_model_stock"
    shutil.rmtree(target, ignore_errors=True)
    try:
        started = time.perf_counter()
        with quiet_calls():
            model.save_pretrained(target)
        job["stock_save_s"] = time.perf_counter() - started
        weights = sorted(path.name for path in target.iterdir() if path.name.startswith("model"))
        job["stock_save_same_bytes"] = all(filecmp.cmp(target / name, saved / name, shallow=False) for name in weights)
        print(f"[job] stock save_pretrained {job['stock_save_s']:.2f} s ({job['stock_save_s'] / job['save_s']:.2f}x "
              f"save_pruned's); weight files the same bytes: {job['stock_save_same_bytes']}", flush=True)
    finally:
        shutil.rmtree(target, ignore_errors=True)


def summary(results: dict[str, Any]) -> None:
    print("\n==== summary ====")
    print(f"device: {results['device']}; torch {results['torch']}, transformers {results['transformers']}, "
          f"CUDA {results['cuda']}")
    for entry in results["layer"]:
        print(f"stats/plain  {entry['shape']:<14} {entry['tokens']:>6} tokens: {entry['ratio']:.3f} "
              f"({entry['plain_s'] * 1e3:.2f} -> {entry['stats_s'] * 1e3:.2f} ms)")
    for entry in results["layer_adaptive"]:
        row = entry["settings"]
        cells = ", ".join(f"{name} x{r['speedup_vs_off']:.2f}" + (f" (skip {r['skip_ratio']:.2f})"
                                                                 if "skip_ratio" in r else "")
                          for name, r in row.items() if name != "off")
        print(f"MoE block    {entry['shape']:<14} {entry['tokens']:>6} tokens: off {row['off']['seconds'] * 1e3:.3f} ms; "
              f"{cells}")
    for entry in results.get("graph", []):
        cells = "; ".join(f"{name}: graph {r['seconds'] * 1e3:.3f} ms, eager {r['eager_seconds'] * 1e3:.3f} ms"
                          if "seconds" in r else f"{name}: {r.get('error')}"
                          for name, r in entry.items() if isinstance(r, dict))
        print(f"CUDA graph   Qwen3-30B-A3B  {entry['tokens']:>6} tokens: {cells}")
    for key in ("full_e2e", "pruned_e2e"):
        for per_call, block in results.get(key, {}).items():
            for name, row in block["settings"].items():
                print(f"e2e {per_call:>6} tokens/call: {name:<38} {row['seconds']:.3f} s "
                      f"x{row['speedup_vs_first']:.3f}" + (f" skip {row['skip_ratio']:.2f}" if "skip_ratio" in row else ""))
    if "full" in results:
        full = results["full"]
        print(f"full depth: statistics pass {full['stats_s']:.2f} s vs plain {full['plain_s']:.2f} s "
              f"(ratio {full['ratio']:.3f}) for {full['tokens']} tokens, {full['layers']} layers")
    if "compensation" in results:
        c = results["compensation"]
        print(f"compensation (linear): {c['compensate_s']:.2f} s vs plain {c['plain_s']:.2f} s over "
              f"{c['fitting_tokens']} fitting tokens (ratio {c['ratio']:.3f}); "
              f"{c['ratio_vs_calibration_forward']:.3f} x the forward over "
              f"{c['calibration_tokens']} calibration tokens")
    if "job" in results:
        job = results["job"]
        parts = ", ".join(f"{step[:-2]} {job[step]:.2f} s" for step in
                          ("load_s", "statistics_s", "plan_s", "choose_s", "compensate_s", "prune_s", "save_s")
                          if step in job)
        print(f"whole job (auto: {job['chosen']}): {parts}; total {job.get('total_s', float('nan')):.1f} s; "
              f"paper setting (omp/waterfill) total {job.get('paper_setting_total_s', float('nan')):.1f} s; "
              f"save to {job.get('save_target', job.get('save'))}")
        if "stock_save_s" in job:
            print(f"save: save_pruned {job['save_s']:.2f} s, stock save_pretrained {job['stock_save_s']:.2f} s "
                  f"({job['stock_save_s'] / job['save_s']:.2f}x); same bytes: {job['stock_save_same_bytes']}")


def tables(results: dict[str, Any]) -> str:
    """The Markdown tables of docs/performance.md's GPU section from a ``gpu.json``."""
    lines = [f"Device: {results['device']}; torch {results['torch']}, transformers {results['transformers']}, "
             f"CUDA {results['cuda']}, {results['dtype'].removeprefix('torch.')}, `grouped_mm` experts.", "",
             "| layer | tokens | plain forward | with statistics | ratio |", "|---|---:|---|---|---:|"]
    for e in results.get("layer", []):
        lines.append(f"| {e['shape']} | {e['tokens']:,} | {e['plain_s'] * 1e3:.2f} ms, peak {e['plain_peak'] / GiB:.2f} "
                     f"GiB | {e['stats_s'] * 1e3:.2f} ms, peak {e['stats_peak'] / GiB:.2f} GiB | {e['ratio']:.3f} |")
    names = ["off", "eps 0", "eps 0.01 masked", "eps 0.01 compact", "eps 0.1 masked", "eps 0.1 compact"]
    lines += ["", "| MoE block | tokens | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for e in results.get("layer_adaptive", []):
        cells = []
        for n in names:
            r = e["settings"][n]
            skip = f" ({r['skip_ratio'] * 100:.0f} %)" if r.get("skip_ratio") else ""
            cells.append(f"{r['seconds'] * 1e3:.2f} ms{skip}" + ("" if n == "off" else f": {r['speedup_vs_off']:.2f}x"))
        lines.append(f"| {e['shape']} | {e['tokens']:,} | " + " | ".join(cells) + " |")
    lines += ["", "| MoE block | tokens | host syncs per call: off / eps 0.1 masked / eps 0.1 compact | masked vs "
              "compact rel. error (eps 0.1) |", "|---|---:|---|---:|"]
    for e in results.get("layer_adaptive", []):
        syncs = " / ".join(str(e["settings"][n]["host_syncs_per_call"]) for n in ("off", "eps 0.1 masked",
                                                                               "eps 0.1 compact"))
        lines.append(f"| {e['shape']} | {e['tokens']:,} | {syncs} | {e['masked_vs_compact_rel_error_eps_0.1']:.1e} |")
    if results.get("graph"):
        lines += ["", "| CUDA graph, Qwen3-30B-A3B block | tokens | off: graph / eager | eps 0.1 masked: graph / "
                  "eager | graph speedup |", "|---|---:|---|---|---:|"]
        for e in results["graph"]:
            def cell(r):
                return (f"{r['seconds'] * 1e3:.2f} / {r['eager_seconds'] * 1e3:.2f} ms" if "seconds" in r
                        else f"failed: {r.get('error')}")
            speed = e.get("speedup_eps_0.1_masked_vs_off")
            lines.append(f"| | {e['tokens']:,} | {cell(e['off'])} | {cell(e['eps 0.1 masked'])} | "
                         f"{'' if speed is None else f'{speed:.2f}x'} |")
    for key, title in (("full_e2e", "unpruned model"), ("pruned_e2e", "pruned 0.5 model (the job's)")):
        if key not in results:
            continue
        lines += ["", f"| whole {title} | tokens per call | calls | seconds | speedup | skipped |",
                  "|---|---:|---:|---:|---:|---:|"]
        for per_call, block in results[key].items():
            for n, r in block["settings"].items():
                skip = f"{r['skip_ratio'] * 100:.0f} %" if "skip_ratio" in r else ""
                lines.append(f"| {n} | {int(per_call):,} | {block['calls']} | {r['seconds']:.3f} | "
                             f"{r['speedup_vs_first']:.2f}x | {skip} |")
    if "full" in results:
        f = results["full"]
        lines += ["", f"Full depth ({f['layers']} layers, {f['parameters'] / 1e9:.2f} B parameters, "
                  f"{f['weight_bytes'] / GiB:.1f} GiB): statistics pass {f['stats_s']:.2f} s, plain forward "
                  f"{f['plain_s']:.2f} s over {f['tokens']:,} tokens (ratio {f['ratio']:.3f}), peak "
                  f"{f['peak'] / GiB:.1f} GiB."]
    if "compensation" in results:
        c = results["compensation"]
        lines += ["", f"Compensation (`linear`, {c['fitting_tokens']:,} fitting tokens of "
                  f"{c['calibration_tokens']:,}): {c['compensate_s']:.2f} s against a plain forward over them of "
                  f"{c['plain_s']:.2f} s (ratio {c['ratio']:.2f}), {c['ratio_vs_calibration_forward']:.2f}x the "
                  "forward over the calibration text; "
                  f"sums {c['sum_bytes'] / GiB:.2f} GiB, peak {c['peak'] / GiB:.1f} GiB."]
    if "job" in results:
        j = results["job"]
        steps = [("load", "load_s"), ("statistics", "statistics_s"), ("plan", "plan_s"), ("choose", "choose_s"),
                 ("prune", "prune_s"), ("save", "save_s")]
        lines += ["", "| step | seconds |", "|---|---:|"]
        lines += [f"| {label} | {j[key]:.2f} |" for label, key in steps if key in j]
        lines += [f"| **whole job** (`auto` -> {j['chosen']}) | **{j['total_s']:.1f}** |",
                  f"| whole job, paper's setting (omp, waterfill) | {j['paper_setting_total_s']:.1f} |"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", default=["layer", "full", "compensation", "job", "graph"],
                        choices=["layer", "full", "compensation", "job", "graph"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny stand-in shapes (smoke test)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--shapes", nargs="+", default=["qwen3", "deepseek"], choices=["qwen3", "deepseek"])
    parser.add_argument("--layer_tokens", nargs="+", type=int, default=[512, 4096, 16384])
    parser.add_argument("--graph_tokens", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--job_batch", type=int, default=1,
                        help="sequences per forward of the job's statistics (loss-aware: a backward each)")
    parser.add_argument("--adaptive_min_tokens", type=int, default=4096, help="OMP-MoE+ timed from this many tokens")
    parser.add_argument("--router_std", type=float, default=0.05)
    parser.add_argument("--full_layers", type=int, default=QWEN3_30B_A3B_LAYERS)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--seq_len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2, help="sequences per forward pass of the statistics")
    parser.add_argument("--headroom_gib", type=float, default=6.0)
    parser.add_argument("--e2e_sequences_per_call", nargs="+", type=int, default=[1, 4],
                        help="end-to-end forwards: sequences of --seq_len per call")
    parser.add_argument("--e2e_tokens", type=int, default=32768, help="tokens per timed end-to-end sample")
    parser.add_argument("--e2e_repeats", type=int, default=3)
    parser.add_argument("--save_dir", default=None, help="where the job saves the pruned model (then deleted)")
    parser.add_argument("--no_save", action="store_true")
    parser.add_argument("--no_stock_save", action="store_true",
                        help="skip the job's second save by stock save_pretrained (time ratio and byte comparison)")
    parser.add_argument("--out", default=None, help="directory for gpu.json")
    parser.add_argument("--tables", default=None, metavar="GPU_JSON",
                        help="print docs/performance.md's Markdown tables from a gpu.json and stop")
    args = parser.parse_args()
    if args.tables:
        print(tables(json.loads(Path(args.tables).read_text())))
        return
    if args.small:  # the token counts too, so a smoke test on CPU takes seconds, not the full run's hours
        args.sequences, args.seq_len, args.full_layers = min(args.sequences, 4), min(args.seq_len, 64), 4
        args.e2e_tokens, args.e2e_sequences_per_call, args.e2e_repeats = min(args.e2e_tokens, 256), [1], 1
        args.layer_tokens = [min(tokens, 256) for tokens in args.layer_tokens][:1]
        args.graph_tokens = [min(tokens, 256) for tokens in args.graph_tokens][:1]
        args.repeats, args.adaptive_min_tokens = min(args.repeats, 3), min(args.adaptive_min_tokens, 64)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        torch.set_num_threads(1)
    import transformers

    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.version.cuda,
        "ompmoe": ompmoe.__version__, "dtype": str(dtype), "router_std": args.router_std, "args": vars(args),
        "grouped_mm_replay": replay_module._grouped_linear is not None, "layer": [], "layer_adaptive": [], "graph": [],
    }
    print(json.dumps({k: v for k, v in results.items() if k not in ("layer", "layer_adaptive", "graph")}), flush=True)
    if not results["grouped_mm_replay"]:
        raise SystemExit("transformers.integrations.moe._grouped_linear is missing: neither the replay nor the "
                         "masked path applies; stop")

    def save() -> None:
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "gpu.json").write_text(json.dumps(results, indent=1, default=str))

    state: dict[str, Any] = {}
    # A `timeout` sends SIGTERM: end through the finally below, so the summary and gpu.json are still written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.perf_counter()
    try:
        if "layer" in args.sections:
            section_layer(args, device, dtype, results, save)
        if "full" in args.sections or "compensation" in args.sections or "job" in args.sections:
            section_full(args, device, dtype, results, save, state)
        if "compensation" in args.sections:  # before the job, which prunes the model
            section_compensation(args, device, dtype, results, save, state)
        if "job" in args.sections:
            section_job(args, device, dtype, results, save, state)
        state.clear()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if "graph" in args.sections:
            section_graph(args, device, dtype, results, save)
    finally:
        results["script_s"] = time.perf_counter() - started
        save()
        summary(results)
        print(f"script {results['script_s']:.0f} s")


if __name__ == "__main__":
    main()
