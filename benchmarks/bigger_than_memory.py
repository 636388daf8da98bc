"""Prune a checkpoint bigger than this machine's memory, layer by layer: the figures of docs/performance.md.

    python benchmarks/bigger_than_memory.py --out DIR [--layers N] [--tokens T] [--compensation down] [--fp8]

Builds once (kept for later runs) a Qwen3-30B-A3B-shaped bf16 checkpoint of ``N`` decoder layers in ``DIR/source``
(48 by default, about 57 GiB; per-expert tensors as the hub stores them, one shard per layer; a few random buffers
rolled per expert: cheap and deterministic), then, in this process: statistics from ``T`` random token ids one
decoder layer at a time (``ompmoe.collect_stats_layerwise``, in the checkpoint's bf16), the paper's plan at 0.5 (``omp`` +
``waterfill``), the pruned checkpoint written from the files into ``DIR/pruned`` (``ompmoe.save_pruned_from_files``),
with ``--compensation down`` first the down refit of the kept experts fitted on the same tokens in one more pass
over the layers (``ompmoe.engine.apply.layer_by_layer.measure_layer_by_layer``; its per-layer rows kept in a scratch
directory) and folded into the rows as they are written; a check that it loads with ``ompmoe.load_pruned`` on the meta device (shapes and config) and that a resident run of
a 2-layer slice of the same files keeps the same experts in those layers, then ``DIR/pruned`` is deleted. The peak
anonymous memory is sampled from ``/proc/self/status`` (RssAnon) every 20 ms; the write step is compared with ``cp``
of the pruned files' bytes on the same disk (two shards copied, scaled). The last line printed is one JSON object.
With ``--fp8`` the checkpoint (``DIR/source-fp8``) stores its linear weights in block FP8 as DeepSeek-V3's and
Qwen3's -FP8 releases do (128 x 128 blocks, one float32 multiplier each): each layer is dequantized as it is read,
the pruned checkpoint keeps the kept experts' FP8 tensors as stored, and the resident check loads the 2-layer slice
through transformers' own FP8 dequantization.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

HIDDEN, EXPERTS, TOP_K, MOE_INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 128, 8, 768, 32, 4, 128, 151936
BASES = 4
FP8_BLOCK = 128
"""Random buffers per tensor shape, rolled per expert (distinct experts without generating 57 GB of noise)."""


def qwen3_30b_config(layers: int):
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=6144, moe_intermediate_size=MOE_INTERMEDIATE,
        num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True, max_position_embeddings=40960,
        rope_theta=1e6, tie_word_embeddings=False, dtype="bfloat16", architectures=["Qwen3MoeForCausalLM"])


def block_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 values, float32 multipliers)`` of a weight whose sides are multiples of :data:`FP8_BLOCK`, as the
    releases quantize it (one multiplier per block: max |w| / 448)."""
    rows, cols = weight.shape
    blocks = weight.float().reshape(rows // FP8_BLOCK, FP8_BLOCK, cols // FP8_BLOCK, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    values = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
    return values, scale


def build_source(directory: Path, layers: int, fp8: bool = False) -> float:
    """Write the checkpoint (skipped when a complete one is there); returns its size in GiB."""
    from safetensors.torch import save_file

    index_file = directory / "model.safetensors.index.json"
    if index_file.is_file() and json.loads(index_file.read_text()).get("layers") == layers:
        return sum(f.stat().st_size for f in directory.glob("*.safetensors")) / 2**30
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)

    def noise(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * std).to(torch.bfloat16)

    expert_bases = {name: [noise(*shape) for _ in range(BASES)] for name, shape in
                    (("gate_proj", (MOE_INTERMEDIATE, HIDDEN)), ("up_proj", (MOE_INTERMEDIATE, HIDDEN)),
                     ("down_proj", (HIDDEN, MOE_INTERMEDIATE)))}
    attention = {"q_proj": noise(HEADS * HEAD_DIM, HIDDEN), "k_proj": noise(KV_HEADS * HEAD_DIM, HIDDEN),
                 "v_proj": noise(KV_HEADS * HEAD_DIM, HIDDEN), "o_proj": noise(HIDDEN, HEADS * HEAD_DIM)}
    count = layers + 1
    weight_map: dict[str, str] = {}
    total = 0
    for index in range(count):
        name = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
        if index == layers:  # embeddings, final norm and head in the last shard
            tensors = {"model.embed_tokens.weight": noise(VOCAB, HIDDEN), "lm_head.weight": noise(VOCAB, HIDDEN),
                       "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}
        else:
            prefix = f"model.layers.{index}."
            tensors = {f"{prefix}self_attn.{key}.weight": value.roll(index, 0).clone() for key, value in
                       attention.items()}
            tensors.update({f"{prefix}self_attn.q_norm.weight": torch.ones(HEAD_DIM, dtype=torch.bfloat16),
                            f"{prefix}self_attn.k_norm.weight": torch.ones(HEAD_DIM, dtype=torch.bfloat16),
                            f"{prefix}input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                            f"{prefix}post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                            f"{prefix}mlp.gate.weight": noise(EXPERTS, HIDDEN, std=0.05)})
            for expert in range(EXPERTS):
                for key, bases in expert_bases.items():
                    shift = (expert * 7 + index * 13) % bases[0].shape[1]
                    tensors[f"{prefix}mlp.experts.{expert}.{key}.weight"] = \
                        bases[(expert + index) % BASES].roll(shift, 1).contiguous()
            if fp8:  # the linear weights, as the -FP8 releases store them (router, norms, embeddings, head stay)
                for key in [key for key in tensors if key.endswith("proj.weight")]:
                    tensors[key], tensors[key + "_scale_inv"] = block_fp8(tensors[key])
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    config = qwen3_30b_config(layers)
    if fp8:
        config.quantization_config = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    config.save_pretrained(directory)
    index_file.write_text(json.dumps({"metadata": {"total_size": total}, "layers": layers,
                                      "weight_map": weight_map}, indent=1))
    return total / 2**30


class AnonymousPeak:
    """The process's peak anonymous memory (RssAnon), sampled every 20 ms on a thread."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def now() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
        return 0

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.02)

    def __enter__(self) -> AnonymousPeak:
        self.peak = self.now()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def cp_seconds(files: list[Path], scratch: Path) -> tuple[float, int]:
    """Seconds ``cp`` takes to copy ``files`` into ``scratch`` on the same disk (then deleted), and their bytes.
    The files are first dropped from the page cache (``posix_fadvise``), so cp reads them from the disk as the
    writer reads its source: the files were just written and would otherwise be copied from memory."""
    scratch.mkdir(parents=True, exist_ok=True)
    subprocess.run(["sync"], check=True)
    for file in files:
        descriptor = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)
    started = time.perf_counter()
    subprocess.run(["cp", *map(str, files), str(scratch)], check=True)
    subprocess.run(["sync"], check=True)
    elapsed = time.perf_counter() - started
    shutil.rmtree(scratch)
    return elapsed, sum(f.stat().st_size for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--compensation", choices=("off", "down"), default="off")
    parser.add_argument("--fp8", action="store_true", help="a block-FP8 checkpoint (DeepSeek-V3's format)")
    args = parser.parse_args()
    if args.fp8 and args.compensation != "off":
        parser.error("--fp8 writes the kept experts' FP8 tensors as stored, which a compensation would change "
                     "(ompmoe refuses it); use --compensation off")
    torch.set_num_threads(os.cpu_count() or 1)
    warnings.simplefilter("ignore")
    import ompmoe
    from ompmoe.engine.lazy_checkpoint import checkpoint_files

    source, pruned = args.out / ("source-fp8" if args.fp8 else "source"), args.out / "pruned"
    steps: dict[str, float] = {}
    started = time.perf_counter()
    checkpoint_gib = build_source(source, args.layers, args.fp8)
    steps["build"] = time.perf_counter() - started
    generator = torch.Generator().manual_seed(1)
    blocks = [torch.randint(0, VOCAB, (1, args.seq_len), generator=generator)
              for _ in range(max(1, args.tokens // args.seq_len))]
    shutil.rmtree(pruned, ignore_errors=True)
    peaks: dict[str, float] = {}
    timings: dict[str, float] = {}
    with AnonymousPeak() as memory:
        tick = time.perf_counter()
        stats = ompmoe.collect_stats_layerwise(source, blocks, timings=timings)
        steps["calibrate"] = time.perf_counter() - tick
        peaks["calibrate"] = memory.peak / 2**30
        tick = time.perf_counter()
        plan = ompmoe.plan_pruning(stats, 0.5, method="omp", allocation="waterfill")
        steps["plan"] = time.perf_counter() - tick
    compensation, scratch = None, tempfile.TemporaryDirectory(dir=args.out)
    if args.compensation == "down":
        from ompmoe.engine.apply.layer_by_layer import measure_layer_by_layer
        from ompmoe.engine.export.config import load_stock_config
        from ompmoe.engine.lazy_checkpoint import build_skeleton

        with AnonymousPeak() as fitting:
            tick = time.perf_counter()
            skeleton = build_skeleton(load_stock_config(source), dtype=torch.bfloat16)
            compensation = measure_layer_by_layer(source, skeleton, plan, scratch.name, granularity="down",
                                                  text=torch.cat(blocks), batch_size=len(blocks)).compensation
            steps["compensate"] = time.perf_counter() - tick
        peaks["compensate"] = fitting.peak / 2**30
    with AnonymousPeak() as writing:
        tick = time.perf_counter()
        ompmoe.save_pruned_from_files(source, plan, pruned, compensation=compensation)
        subprocess.run(["sync"], check=True)
        steps["write"] = time.perf_counter() - tick
    peaks["write"] = writing.peak / 2**30
    scratch.cleanup()
    pruned_files = checkpoint_files(pruned)
    pruned_gib = sum(f.stat().st_size for f in pruned_files) / 2**30
    copied, copied_bytes = cp_seconds(pruned_files[:4], args.out / "cp-scratch")
    cp_estimate = copied * pruned_gib * 2**30 / copied_bytes
    with torch.device("meta"):
        loaded = ompmoe.load_pruned(pruned, device_map="meta")
    kept_counts = [layer.num_experts for layer in ompmoe.find_moe_layers(loaded)]
    loads = kept_counts == [len(layer.kept) for layer in plan.layers]
    same_plan = resident_slice_agrees(source, blocks, stats)
    shutil.rmtree(pruned)
    layer_gib = (EXPERTS * 3 * HIDDEN * MOE_INTERMEDIATE + 2 * HIDDEN * HEADS * HEAD_DIM
                 + 2 * HIDDEN * KV_HEADS * HEAD_DIM) * 2 / 2**30  # bf16 compute
    hidden_gib = sum(block.numel() for block in blocks) * HIDDEN * 2 / 2**30
    print(json.dumps({
        "layers": args.layers, "tokens": sum(block.numel() for block in blocks), "compensation": args.compensation,
        "fp8": args.fp8,
        "checkpoint_gib": round(checkpoint_gib, 2), "pruned_gib": round(pruned_gib, 2),
        "mem_total_gib": round(mem_total() / 2**30, 2), "peak_anon_gib": round(max(peaks.values()), 2),
        "peak_anon_gib_per_step": {key: round(value, 2) for key, value in peaks.items()},
        "memory_bound_gib": round(2 * layer_gib + hidden_gib + 2, 2),
        "wall_s": round(time.perf_counter() - started, 1), "steps": {k: round(v, 1) for k, v in steps.items()},
        "calibrate_steps": {k: round(v, 1) for k, v in timings.items()},
        "write_vs_cp": round(steps["write"] / cp_estimate, 2), "cp_estimate_s": round(cp_estimate, 1),
        **({"compensate_vs_calibrate": round(steps["compensate"] / steps["calibrate"], 2)}
           if "compensate" in steps else {}),
        "loads_on_meta": loads, "same_plan_as_resident": same_plan}))


def resident_slice_agrees(source: Path, blocks: list[torch.Tensor], stats) -> bool:
    """A resident run of the first two layers (the same files, a 2-layer config) keeps the experts the layer-by-layer
    statistics keep in those layers (statistics equal to 1e-6 relative, the same uniform plan)."""
    import transformers

    import ompmoe

    config = transformers.AutoConfig.from_pretrained(source)
    config.num_hidden_layers = 2
    with tempfile.TemporaryDirectory() as directory:  # a config of two layers pointing at the same files
        for file in source.iterdir():
            if file.name != "config.json":
                os.symlink(file, Path(directory) / file.name)
        config.save_pretrained(directory)
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    resident = ompmoe.collect_stats(model, blocks, progress=False)
    layered = ompmoe.MoEStats(layers=stats.layers[:2], num_tokens=stats.num_tokens, fingerprint=resident.fingerprint,
                              model_id=stats.model_id, model_type=stats.model_type)
    close = all(torch.allclose(a.gram, b.gram, rtol=1e-6, atol=0) for a, b in zip(layered.layers, resident.layers))
    planned = ompmoe.plan_pruning(layered, 0.5, allocation="uniform").kept_by_layer()
    return close and planned == ompmoe.plan_pruning(resident, 0.5, allocation="uniform").kept_by_layer()


if __name__ == "__main__":
    main()
