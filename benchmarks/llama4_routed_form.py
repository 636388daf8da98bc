"""Llama 4's statistics pass against its own forward, in one run: the stock block runs every expert on every token,
the routed form ompmoe calibrates in runs each expert on its routed tokens only (ompmoe/engine/input_weighted.py).

    python benchmarks/llama4_routed_form.py                      # about 2 minutes, 1 thread
    python benchmarks/llama4_routed_form.py --output benchmarks/results/llama4_routed_form.json

For each expert count (Scout's 16, Maverick's 128; top-1 as released), a Llama 4 text model of ``--layers`` MoE
decoder layers at a reduced width (``--hidden``, ``--intermediate``; random weights, float32) runs ``--tokens`` tokens
(batches of ``--seq_len``), three passes interleaved per round after one warm-up round: ``stock`` (the stock forward,
``torch.no_grad``), ``routed`` (the same forward in the routed form) and ``stats`` (``ompmoe.collect_stats``). Medians
over ``--repeats`` rounds of wall-clock and process CPU time; the ratios are of this run's medians, and the routed
form's logits are compared with the stock ones (largest absolute difference).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from typing import Any

import torch

PASSES = ("stock", "routed", "stats")


def build(experts: int, args: argparse.Namespace) -> torch.nn.Module:
    from ompmoe.engine.tiny import tiny_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_model("llama4_text", seed=0, hidden_size=args.hidden, intermediate_size=args.intermediate,
                          intermediate_size_mlp=args.intermediate, num_local_experts=experts, num_experts_per_tok=1,
                          num_hidden_layers=args.layers, interleave_moe_layer_step=1, num_attention_heads=8,
                          num_key_value_heads=8, head_dim=args.hidden // 8, vocab_size=1024)


def timed(run: Any) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(experts: int, args: argparse.Namespace) -> dict[str, Any]:
    import ompmoe
    from ompmoe.engine.input_weighted import routed_form

    model = build(experts, args)
    layers = ompmoe.find_moe_layers(model)
    generator = torch.Generator().manual_seed(1)
    batches = torch.randint(0, 1024, (args.tokens // args.seq_len, args.seq_len), generator=generator).split(1)

    @torch.no_grad()
    def stock() -> None:
        for batch in batches:
            model(batch)

    @torch.no_grad()
    def routed() -> None:
        with routed_form(layers):
            for batch in batches:
                model(batch)

    def stats() -> None:
        ompmoe.collect_stats(model, batches, progress=False)

    runs = {"stock": stock, "routed": routed, "stats": stats}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in PASSES}
    for round_ in range(args.repeats + 1):
        for name in PASSES:
            result = timed(runs[name])
            if round_:  # the first round warms up
                times[name].append(result)
    with torch.no_grad():
        expected = model(batches[0]).logits
        with routed_form(layers):
            difference = float((model(batches[0]).logits - expected).abs().max())
    wall = {name: statistics.median(t[0] for t in times[name]) for name in PASSES}
    cpu = {name: statistics.median(t[1] for t in times[name]) for name in PASSES}
    return {"experts": experts, "top_k": 1, "wall_s": wall, "cpu_s": cpu,
            "stats_over_stock_cpu": cpu["stats"] / cpu["stock"], "routed_over_stock_cpu": cpu["routed"] / cpu["stock"],
            "stats_over_routed_cpu": cpu["stats"] / cpu["routed"], "routed_logits_max_abs_difference": difference}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=None, help="write the JSON here (atomically)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {"settings": {key: value for key, value in vars(args).items() if key != "output"},
              "torch": torch.__version__, "runs": [measure(experts, args) for experts in args.experts]}
    print("| experts | stock forward (CPU s) | routed form | statistics pass | stats / stock | routed / stock |")
    print("|---:|---:|---:|---:|---:|---:|")
    for run in result["runs"]:
        cpu = run["cpu_s"]
        print(f"| {run['experts']} | {cpu['stock']:.2f} | {cpu['routed']:.2f} | {cpu['stats']:.2f} | "
              f"{run['stats_over_stock_cpu']:.2f}x | {run['routed_over_stock_cpu']:.2f}x |")
    if args.output:
        from ompmoe.engine.io import atomic_path

        with atomic_path(args.output, overwrite=True) as path:
            path.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
