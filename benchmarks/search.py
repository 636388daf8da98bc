"""Search-cost benchmark of OMP-MoE: statistics pass, selection at model scale, Gram vs cached atoms.

Run ``python benchmarks/search.py`` (about 4 minutes on a 2-core CPU, most of it (d); ``--skip d``
for the quick ones). Everything runs on one CPU thread; each figure is the median over repeats,
and each ratio compares numbers measured in this run. Times are CPU seconds of this process
(``time.process_time``, robust to other load on the machine; with one thread they equal wall time
on an idle machine); wall-clock medians are shown too.

(a) statistics pass / plain forward on the same batches, tiny Qwen3-MoE-shaped models (target <= 1.10)
(b) plan_pruning of all layers at one ratio from synthetic Grams, Qwen3-30B-A3B and DeepSeek-V3
    shapes (target < 0.1 s), and the greedy pursuit alone
(c) greedy selection from the Gram vs Algorithm 1 on cached atoms at equal tokens: time and memory
(d) statistics pass / plain forward at real layer shapes (random weights, one decoder layer):
    Qwen3-30B-A3B (512 tokens) and DeepSeek-V3 (``--deepseek_tokens``, all experts backed by one
    expert's storage so it fits in memory; the compute per pair is unchanged), target <= 1.05, with
    the peak memory of each (a forked process per measurement on CPU, peak allocated on CUDA)
    ``--device cuda --dtype bfloat16`` runs (d) on a GPU.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ompmoe import collect_stats, plan_pruning
from ompmoe.engine.planning.selection import greedy_pursuit
from ompmoe.engine.collect.statistics import LayerStats, MoEStats
from ompmoe.engine.tiny import tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from literal_pursuit import pursuit_on_atoms  # noqa: E402  (the literal Algorithm 1 the tests compare against)
from shapes import DEEPSEEK_V3, QWEN3_30B_A3B, build_model, describe  # noqa: E402


def measure(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median CPU and wall seconds of ``fn`` over ``repeats`` runs (after one warm-up run)."""
    fn()
    cpu, wall = [], []
    for _ in range(repeats):
        c, w = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return statistics.median(cpu), statistics.median(wall)


def measure_pair(a: Callable[[], object], b: Callable[[], object], repeats: int) -> list[tuple[float, float]]:
    """Like :func:`measure` for two functions, interleaved so that background load hits both alike."""
    a(), b()
    samples: list[list[tuple[float, float]]] = [[], []]
    for _ in range(repeats):
        for i, fn in enumerate((a, b)):
            c, w = time.process_time(), time.perf_counter()
            fn()
            samples[i].append((time.process_time() - c, time.perf_counter() - w))
    return [(statistics.median(s[0] for s in runs), statistics.median(s[1] for s in runs)) for runs in samples]


WIDTH = 48


def row(label: str, cpu: float, wall: float, note: str = "") -> None:
    print(f"  {label:<{WIDTH}} {cpu * 1e3:>9.1f} {wall * 1e3:>9.1f}  {note}".rstrip())


def header(title: str) -> None:
    print(f"\n{title}\n  {'':<{WIDTH}} {'cpu ms':>9} {'wall ms':>9}")


# ------------------------------------------------------------------------- (a) stats pass
def bench_stats_pass(repeats: int) -> None:
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, 256, (4, 256), generator=generator) for _ in range(2)]
    header(
        "(a) statistics pass / plain forward on the same 2 batches of 4 x 256 tokens: qwen3_moe, hidden 256, "
        "4 MoE layers x 32 experts, top-4"
    )
    # The flattened expert call adds a few passes over (tokens * top_k, hidden) activations, so its
    # relative cost shrinks as experts get wider (real models: moe_intermediate_size 768 and up).
    for width, implementations in ((128, ("grouped_mm", "eager")), (512, ("grouped_mm",))):
        model = tiny_model(
            "qwen3_moe", hidden_size=256, intermediate_size=512, moe_intermediate_size=width, num_experts=32,
            num_experts_per_tok=4, num_hidden_layers=4, mlp_only_layers=[], head_dim=64, num_attention_heads=4,
            num_key_value_heads=2,
        )

        @torch.no_grad()
        def plain() -> None:
            for batch in batches:
                model(input_ids=batch, use_cache=False)

        def stats() -> None:
            collect_stats(model, batches)

        for implementation in implementations:
            try:
                model.set_experts_implementation(implementation)
            except Exception as error:  # not available in this transformers build
                print(f"  experts implementation {implementation!r} unavailable: {error}")
                continue
            (pc, pw), (sc, sw) = measure_pair(plain, stats, repeats)
            label = f"expert width {width}, {implementation}"
            row(f"plain forward, {label}", pc, pw)
            row(f"collect_stats, {label}", sc, sw, f"ratio {sc / pc:.3f} (wall {sw / pw:.3f}); target <= 1.10")


# --------------------------------------------------------------------- (b) model-scale plan
def synthetic_stats(num_layers: int, num_experts: int, top_k: int, num_groups: int = 1, topk_group: int = 1,
                    group_score_topk: int = 1, seed: int = 0) -> MoEStats:
    """Random PSD Grams ``A A^T`` (low rank plus a diagonal, like real expert outputs) and routing sums."""
    generator = torch.Generator().manual_seed(seed)
    layers = []
    for index in range(num_layers):
        atoms = torch.randn(num_experts, 96, generator=generator, dtype=torch.float64)
        atoms *= torch.rand(num_experts, 1, generator=generator, dtype=torch.float64) + 0.1
        gram = atoms @ atoms.T + torch.diag(torch.rand(num_experts, generator=generator, dtype=torch.float64))
        tokens = torch.rand(num_experts, generator=generator, dtype=torch.float64) * 1e4
        layers.append(LayerStats(
            name=f"model.layers.{index}.mlp", num_experts=num_experts, top_k=top_k, num_groups=num_groups,
            topk_group=topk_group, group_score_topk=group_score_topk, gram=gram,
            routing_mass=tokens * (0.1 + 0.5 * torch.rand(num_experts, generator=generator, dtype=torch.float64)),
            token_count=tokens, sq_norm_sum=gram.diagonal() * 3.0, norm_sum=tokens, weighted_norm_sum=tokens * 0.2,
        ))
    return MoEStats(layers=layers, num_tokens=262_144, fingerprint="synthetic")


def bench_selection(repeats: int) -> None:
    header("(b) selection of all layers at ratio 0.5 from synthetic Grams (target < 100 ms)")
    shapes = {
        "Qwen3-30B-A3B 48x128 top-8": dict(num_layers=48, num_experts=128, top_k=8),
        "DeepSeek-V3 58x256 top-8/8 groups": dict(
            num_layers=58, num_experts=256, top_k=8, num_groups=8, topk_group=4, group_score_topk=2
        ),
    }
    for label, shape in shapes.items():
        stats = synthetic_stats(**shape)
        grams = torch.stack([layer.gram for layer in stats.layers])
        num_groups = shape.get("num_groups", 1)
        print(f"  {label}")
        cpu, wall = measure(lambda: greedy_pursuit(grams, num_groups=num_groups, with_gains=False), repeats)
        row("  pursuit alone (orders + residual curves)", cpu, wall)
        cpu, wall = measure(lambda: greedy_pursuit(grams, num_groups=num_groups), repeats)
        row("  pursuit alone, also recording all gains", cpu, wall)
        for allocation in ("waterfill", "optimal"):
            cpu, wall = measure(lambda: plan_pruning(stats, 0.5, allocation=allocation), repeats)
            verdict = "ok" if cpu < 0.1 else "MISSES target"
            row(f"  plan_pruning, {allocation}", cpu, wall, verdict)


# --------------------------------------------------------------- (c) Gram vs cached atoms
def atom_pursuit(atoms: torch.Tensor) -> list[int]:
    """Algorithm 1 on cached atoms, vectorized: one matrix-vector product over all atoms per step."""
    flat = atoms.reshape(atoms.shape[0], -1)
    energy = torch.einsum("ij,ij->i", flat, flat)
    residual = flat.sum(dim=0)
    available = torch.ones(flat.shape[0], dtype=torch.bool)
    order = []
    for _ in range(flat.shape[0]):
        gains = (2.0 * (flat @ residual) - energy).masked_fill_(~available, float("-inf"))
        best = int(gains.argmax())
        residual -= flat[best]
        available[best] = False
        order.append(best)
    return order


def bench_gram_vs_atoms(repeats: int, num_experts: int, num_tokens: int, dim: int, top_k: int) -> None:
    header(
        f"(c) Gram vs cached atoms: {num_experts} experts, {num_tokens} tokens, d={dim}, top-{top_k} routing "
        "(atoms float32, Gram float64)"
    )
    generator = torch.Generator().manual_seed(0)
    # Atoms V_e = g_e(x) F_e(x): zero unless the token routes to e, as the paper caches them.
    logits = torch.randn(num_tokens, num_experts, generator=generator) + torch.linspace(-1, 1, num_experts)
    weights, experts = logits.softmax(-1).topk(top_k, dim=-1)
    outputs = torch.randn(num_experts, num_tokens, dim, generator=generator)
    outputs += 0.5 * torch.randn(1, num_tokens, dim, generator=generator)  # correlated experts
    gate = torch.zeros(num_tokens, num_experts).scatter_(1, experts, weights)
    atoms = (outputs * gate.T.unsqueeze(-1)).contiguous()
    del outputs
    flat = atoms.reshape(num_experts, -1)
    start = time.process_time()
    gram = torch.zeros(num_experts, num_experts, dtype=torch.float64)
    for chunk in flat.split(1 << 18, dim=1):  # exact float64 Gram of the same atoms
        chunk = chunk.double()
        gram += chunk @ chunk.T
    build = time.process_time() - start

    gram_cpu, gram_wall = measure(lambda: greedy_pursuit(gram), repeats)
    atom_cpu, atom_wall = measure(lambda: atom_pursuit(atoms), max(1, repeats // 3))
    same = greedy_pursuit(gram).order.tolist() == atom_pursuit(atoms)
    row("greedy_pursuit on the Gram", gram_cpu, gram_wall)
    row("Algorithm 1 on atoms, 1 matmul per step", atom_cpu, atom_wall, f"same order: {same}")
    atom_bytes = atoms.element_size() * atoms.numel()
    gram_bytes = gram.element_size() * gram.numel()
    print(f"  time ratio atoms / Gram: {atom_cpu / gram_cpu:,.0f}x (wall {atom_wall / gram_wall:,.0f}x)")
    print(
        f"  memory: atoms {atom_bytes / 2**20:,.1f} MiB vs Gram {gram_bytes / 2**10:,.1f} KiB: "
        f"ratio {atom_bytes / gram_bytes:,.0f}x"
    )
    print(
        f"  (the Gram of these cached atoms takes {build * 1e3:,.0f} ms CPU to form at once; ompmoe never caches "
        "atoms and accumulates it in the statistics pass, see (a))"
    )
    small = atoms[:, : num_tokens // 16].double()
    start = time.process_time()
    literal, _ = pursuit_on_atoms(small)
    literal_cpu = time.process_time() - start
    small_gram = torch.einsum("etd,ftd->ef", small, small)
    agrees = literal == greedy_pursuit(small_gram).order.tolist()
    row(f"literal pursuit_on_atoms, {num_tokens // 16} tokens, 1 run", literal_cpu, literal_cpu,
        f"same order as its Gram: {agrees}")


# ------------------------------------------------------------------ (d) real layer shapes
def synchronized(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    if device.type != "cuda":
        return fn

    def run() -> object:
        result = fn()
        torch.cuda.synchronize(device)
        return result

    return run


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak memory of one call: CUDA peak allocated, or on CPU the peak RSS of a forked process running it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: run once, report its own peak resident set
        os.close(read)
        try:
            fn()
            os.write(write, str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        value = pipe.read()
    os.waitpid(pid, 0)
    return int(value or 0)


def stats_bytes(stats: MoEStats) -> int:
    return sum(t.numel() * t.element_size() for layer in stats.layers for t in layer.tensors().values())


def bench_real_shapes(repeats: int, device: torch.device, dtype: torch.dtype, deepseek_tokens: int,
                      qwen_tokens: int = 512, shapes: tuple[str, ...] = ("qwen3", "deepseek")) -> list[dict]:
    header(f"(d) statistics pass / plain forward, one decoder layer at real shapes, {dtype}, {device} "
           "(grouped_mm experts; target <= 1.05)")
    cases = []
    if "qwen3" in shapes:
        cases.append(("Qwen3-30B-A3B", QWEN3_30B_A3B, qwen_tokens, False))
    if "deepseek" in shapes:
        cases.append(("DeepSeek-V3", DEEPSEEK_V3, deepseek_tokens, device.type == "cpu"))
    results = []
    for label, shape, tokens, shared in cases:
        model = build_model(shape, 1, dtype=dtype, device=device, share_expert_weights=shared)
        batch = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)
        note = ", experts backed by one expert's storage" if shared else ""
        print(f"  {label}: {describe(shape)}; {tokens} tokens{note}")

        @torch.no_grad()
        def plain(model: torch.nn.Module = model, batch: torch.Tensor = batch) -> None:  # bound: deleted below
            model(input_ids=batch, use_cache=False)

        def stats(model: torch.nn.Module = model, batch: torch.Tensor = batch) -> MoEStats:
            return collect_stats(model, [batch])

        plain_s, stats_s = synchronized(plain, device), synchronized(stats, device)
        (pc, pw), (sc, sw) = measure_pair(plain_s, stats_s, repeats)
        plain_peak, stats_peak = peak_bytes(plain_s, device), peak_bytes(stats_s, device)
        size = stats_bytes(stats())
        if device.type == "cuda":  # process CPU time means nothing for asynchronous kernels
            pc, sc = pw, sw
        row("  plain forward", pc, pw, f"peak {plain_peak / 2**20:,.0f} MiB")
        row("  collect_stats", sc, sw, f"ratio {sc / pc:.3f} (wall {sw / pw:.3f}); target <= 1.05; "
            f"peak {stats_peak / 2**20:,.0f} MiB (plain + {(stats_peak - plain_peak) / 2**20:,.1f} MiB; "
            f"the statistics are {size / 2**20:.2f} MiB)")
        results.append(dict(shape=label, tokens=tokens, plain_s=pc, stats_s=sc, plain_wall_s=pw, stats_wall_s=sw,
                            ratio=sc / pc, wall_ratio=sw / pw, plain_peak=plain_peak, stats_peak=stats_peak,
                            stats_bytes=size, shared_expert_storage=shared))
        del model
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--skip", nargs="*", default=[], choices=["a", "b", "c", "d"])
    parser.add_argument("--device", default="cpu", help="device of (d); (a)-(c) always run on the CPU")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of (d)")
    parser.add_argument("--deepseek_tokens", type=int, default=128, help="tokens of the DeepSeek-V3 layer in (d)")
    parser.add_argument("--qwen_tokens", type=int, default=512, help="tokens of the Qwen3-30B-A3B layer in (d)")
    parser.add_argument("--real_shapes", nargs="+", default=["qwen3", "deepseek"], choices=["qwen3", "deepseek"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, medians of {args.repeats} runs")
    if "d" not in args.skip:
        bench_real_shapes(args.repeats, torch.device(args.device), getattr(torch, args.dtype), args.deepseek_tokens,
                          args.qwen_tokens, tuple(args.real_shapes))
    if "a" not in args.skip:
        bench_stats_pass(args.repeats)
    if "b" not in args.skip:
        bench_selection(args.repeats)
    if "c" not in args.skip:
        bench_gram_vs_atoms(args.repeats, num_experts=64, num_tokens=4096, dim=256, top_k=8)


if __name__ == "__main__":
    main()
