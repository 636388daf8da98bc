"""Prune a checkpoint bigger than this machine's memory, layer by layer: the figures of docs/performance.md.

    python benchmarks/bigger_than_memory.py --out DIR [--layers N] [--tokens T] [--compensation down]
        [--loss_aware] [--device cuda] [--fp8 | --mxfp4 | --int4 [--experts E]]

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
With ``--loss_aware`` the statistics include the
loss-aware sums (a backward down the layers after the forward sweep, each layer read again; the layers' inputs kept
in memory or, past half the memory available, in ``DIR``), the plan is ``omp_normalized`` + ``loss`` and the
resident slice check is skipped (the loss needs the whole model). With ``--fp8`` the checkpoint (``DIR/source-fp8``) stores its linear weights in block FP8 as DeepSeek-V3's and
Qwen3's -FP8 releases do (128 x 128 blocks, one float32 multiplier each): each layer is dequantized as it is read,
the pruned checkpoint keeps the kept experts' FP8 tensors as stored, and the resident check loads the 2-layer slice
through transformers' own FP8 dequantization. With ``--mxfp4`` the checkpoint (``DIR/source-mxfp4``) has
gpt-oss-120b's shape and format instead (128 experts of 2880 x 2880, top-4; each experts projection's blocks and
scales in MXFP4, random codes; attention, routers and biases bf16): each layer's experts are dequantized as read,
the pruned checkpoint keeps the kept experts' blocks and scales, and the resident check loads the 2-layer slice
through transformers' own MXFP4 dequantization. With ``--int4`` the checkpoint (``DIR/source-int4-E``) has Kimi K2
Thinking's shape and format (DeepSeek-V3's model with ``E`` routed experts of 7168 x 2048, 384 by default as Kimi's,
top-8, one shared expert, every layer MoE; the routed experts in compressed-tensors' pack-quantized INT4, one bf16
scale per 32 inputs, random codes; attention, shared experts and routers bf16; its ``config.json`` as Kimi ships it,
``model_type`` ``kimi_k2`` with an ``auto_map`` to remote code that is not there): each expert is dequantized as read,
the pruned checkpoint keeps the kept experts' packed values, scales and shapes, and the resident check loads the
2-layer slice through transformers' own compressed-tensors decompression (the compressed-tensors package needed).
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


OSS_HIDDEN, OSS_EXPERTS, OSS_TOP_K, OSS_INTERMEDIATE, OSS_HEADS, OSS_KV_HEADS, OSS_HEAD_DIM, OSS_VOCAB = (
    2880, 128, 4, 2880, 64, 8, 64, 201088)
"""gpt-oss-120b's shape (its experts in MXFP4: 32 values per power-of-two scale)."""


def gpt_oss_120b_config(layers: int):
    import transformers

    return transformers.GptOssConfig(
        vocab_size=OSS_VOCAB, hidden_size=OSS_HIDDEN, intermediate_size=OSS_INTERMEDIATE, num_hidden_layers=layers,
        num_attention_heads=OSS_HEADS, num_key_value_heads=OSS_KV_HEADS, head_dim=OSS_HEAD_DIM,
        num_local_experts=OSS_EXPERTS, num_experts_per_tok=OSS_TOP_K, sliding_window=128,
        layer_types=["sliding_attention" if index % 2 == 0 else "full_attention" for index in range(layers)],
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
        max_position_embeddings=131072, tie_word_embeddings=False, dtype="bfloat16",
        architectures=["GptOssForCausalLM"],
        quantization_config={"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                        "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"})


KIMI_HIDDEN, KIMI_INTERMEDIATE, KIMI_EXPERTS, KIMI_TOP_K, KIMI_HEADS, KIMI_VOCAB = 7168, 2048, 384, 8, 64, 163840
"""Kimi K2 Thinking's shape (DeepSeek-V3's model; its routed experts in INT4 per group of 32)."""
INT4_GROUP = 32
KIMI_QUANTIZATION = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": INT4_GROUP,
                    "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                    "symmetric": True, "type": "int"}}},
    "format": "pack-quantized", "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                           "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed"}
"""Kimi K2 Thinking's ``quantization_config``."""


def kimi_k2_config(layers: int, experts: int):
    import transformers

    return transformers.DeepseekV3Config(
        vocab_size=KIMI_VOCAB, hidden_size=KIMI_HIDDEN, intermediate_size=18432, moe_intermediate_size=KIMI_INTERMEDIATE,
        num_hidden_layers=layers, num_attention_heads=KIMI_HEADS, num_key_value_heads=KIMI_HEADS, n_shared_experts=1,
        n_routed_experts=experts, routed_scaling_factor=2.827, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=1, topk_group=1,
        num_experts_per_tok=KIMI_TOP_K, first_k_dense_replace=0, norm_topk_prob=True, max_position_embeddings=262144,
        rope_theta=50000.0, tie_word_embeddings=False, dtype="bfloat16", architectures=["DeepseekV3ForCausalLM"])


def build_int4_source(directory: Path, layers: int, experts: int) -> float:
    """A Kimi-K2-Thinking-shaped checkpoint as its release stores it (module docstring), one shard per layer; the
    tensors' names and shapes are those ``save_pretrained`` writes for the model (read off a meta skeleton);
    skipped when a complete one is there."""
    if (size := built_size(directory, layers)) is not None:
        return size
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        skeleton = transformers.DeepseekV3ForCausalLM(kimi_k2_config(1, experts))
    saved = {name: list(tensor.shape) for name, tensor in revert_weight_conversion(skeleton, skeleton.state_dict()).items()}
    generator, noise = noise_source()
    words = {(rows, cols): [torch.randint(-2**31, 2**31 - 1, (rows, cols * 4 // 32), generator=generator,
                                          dtype=torch.int32) for _ in range(BASES)]
             for rows, cols in ((KIMI_INTERMEDIATE, KIMI_HIDDEN), (KIMI_HIDDEN, KIMI_INTERMEDIATE))}

    def shard(index: int) -> dict[str, torch.Tensor]:
        if index == layers:
            return {name: (noise(*shape) if len(shape) == 2 else torch.ones(shape, dtype=torch.bfloat16))
                    for name, shape in saved.items() if not name.startswith("model.layers.")}
        tensors = {}
        for name, shape in saved.items():
            if not name.startswith("model.layers.0."):
                continue
            name = f"model.layers.{index}." + name.removeprefix("model.layers.0.")
            if ".mlp.experts." in name:  # packed INT4: random codes (rolled bases), scales making values ~0.02
                expert = int(name.split(".mlp.experts.")[1].split(".")[0])
                base = words[tuple(shape)][(expert + index) % BASES]
                tensors[name + "_packed"] = base.roll((expert * 7 + index * 13) % base.shape[1], 1).contiguous()
                tensors[name + "_scale"] = torch.full((shape[0], shape[1] // INT4_GROUP), 0.005, dtype=torch.bfloat16)
                tensors[name + "_shape"] = torch.tensor(shape)
            elif name.endswith("e_score_correction_bias"):
                tensors[name] = torch.zeros(shape)
            elif len(shape) == 2:
                tensors[name] = noise(*shape, std=0.05 if name.endswith("mlp.gate.weight") else 0.02)
            else:
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        return tensors

    config = kimi_k2_config(layers, experts)
    config.quantization_config = KIMI_QUANTIZATION
    size = write_shards(directory, layers, shard, config)
    released = json.loads((directory / "config.json").read_text())  # as Kimi ships it: its type, its remote code
    released.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                                                     "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    (directory / "config.json").write_text(json.dumps(released, indent=2))
    return size


def built_size(directory: Path, layers: int) -> float | None:
    """The size in GiB of a complete checkpoint of ``layers`` layers already in ``directory``, else ``None``."""
    index_file = directory / "model.safetensors.index.json"
    if index_file.is_file() and json.loads(index_file.read_text()).get("layers") == layers:
        return sum(f.stat().st_size for f in directory.glob("*.safetensors")) / 2**30
    return None


def write_shards(directory: Path, layers: int, shard, config) -> float:
    """``directory`` written afresh: ``shard(index)``'s tensors for each decoder layer, then ``shard(layers)``'s
    (embeddings, final norm, head), one file each, ``config`` and the index; returns the size in GiB."""
    from safetensors.torch import save_file

    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    count = layers + 1
    weight_map: dict[str, str] = {}
    total = 0
    for index in range(count):
        name = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
        tensors = shard(index)
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    config.save_pretrained(directory)
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "layers": layers, "weight_map": weight_map}, indent=1))
    return total / 2**30


def noise_source(seed: int = 0):
    """``(generator, noise)``: bf16 normal noise of a shape and standard deviation, deterministic from ``seed``."""
    generator = torch.Generator().manual_seed(seed)

    def noise(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * std).to(torch.bfloat16)

    return generator, noise


def build_mxfp4_source(directory: Path, layers: int) -> float:
    """A gpt-oss-120b-shaped checkpoint as its release stores it (experts in MXFP4: random codes, scales of 2^-7,
    so that values are about 0.02; the rest bf16), one shard per layer; skipped when a complete one is there."""
    if (size := built_size(directory, layers)) is not None:
        return size
    generator, noise = noise_source()

    def mxfp4(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.randint(0, 256, (OSS_EXPERTS, rows, cols // 32, 16), generator=generator, dtype=torch.uint8)
        return codes, torch.full((OSS_EXPERTS, rows, cols // 32), 127 - 7, dtype=torch.uint8)

    def shard(index: int) -> dict[str, torch.Tensor]:
        if index == layers:
            return {"model.embed_tokens.weight": noise(OSS_VOCAB, OSS_HIDDEN),
                    "lm_head.weight": noise(OSS_VOCAB, OSS_HIDDEN),
                    "model.norm.weight": torch.ones(OSS_HIDDEN, dtype=torch.bfloat16)}
        prefix = f"model.layers.{index}."
        heads, kv_heads = OSS_HEADS * OSS_HEAD_DIM, OSS_KV_HEADS * OSS_HEAD_DIM
        sizes = {"q_proj": (heads, OSS_HIDDEN), "k_proj": (kv_heads, OSS_HIDDEN), "v_proj": (kv_heads, OSS_HIDDEN),
                 "o_proj": (OSS_HIDDEN, heads)}
        tensors = {}
        for key, shape in sizes.items():
            tensors[f"{prefix}self_attn.{key}.weight"] = noise(*shape)
            tensors[f"{prefix}self_attn.{key}.bias"] = noise(shape[0])
        tensors.update({f"{prefix}self_attn.sinks": noise(OSS_HEADS, std=1.0),
                        f"{prefix}input_layernorm.weight": torch.ones(OSS_HIDDEN, dtype=torch.bfloat16),
                        f"{prefix}post_attention_layernorm.weight": torch.ones(OSS_HIDDEN, dtype=torch.bfloat16),
                        f"{prefix}mlp.router.weight": noise(OSS_EXPERTS, OSS_HIDDEN, std=0.05),
                        f"{prefix}mlp.router.bias": noise(OSS_EXPERTS, std=0.1),
                        f"{prefix}mlp.experts.gate_up_proj_bias": noise(OSS_EXPERTS, 2 * OSS_INTERMEDIATE),
                        f"{prefix}mlp.experts.down_proj_bias": noise(OSS_EXPERTS, OSS_HIDDEN)})
        for key, (rows, cols) in (("gate_up_proj", (2 * OSS_INTERMEDIATE, OSS_HIDDEN)),
                                  ("down_proj", (OSS_HIDDEN, OSS_INTERMEDIATE))):
            tensors[f"{prefix}mlp.experts.{key}_blocks"], tensors[f"{prefix}mlp.experts.{key}_scales"] = \
                mxfp4(rows, cols)
        return tensors

    return write_shards(directory, layers, shard, gpt_oss_120b_config(layers))


def build_source(directory: Path, layers: int, fp8: bool = False) -> float:
    """Write the checkpoint (skipped when a complete one is there); returns its size in GiB."""
    if (size := built_size(directory, layers)) is not None:
        return size
    _, noise = noise_source()
    expert_bases = {name: [noise(*shape) for _ in range(BASES)] for name, shape in
                    (("gate_proj", (MOE_INTERMEDIATE, HIDDEN)), ("up_proj", (MOE_INTERMEDIATE, HIDDEN)),
                     ("down_proj", (HIDDEN, MOE_INTERMEDIATE)))}
    attention = {"q_proj": noise(HEADS * HEAD_DIM, HIDDEN), "k_proj": noise(KV_HEADS * HEAD_DIM, HIDDEN),
                 "v_proj": noise(KV_HEADS * HEAD_DIM, HIDDEN), "o_proj": noise(HIDDEN, HEADS * HEAD_DIM)}

    def shard(index: int) -> dict[str, torch.Tensor]:
        if index == layers:  # embeddings, final norm and head in the last shard
            return {"model.embed_tokens.weight": noise(VOCAB, HIDDEN), "lm_head.weight": noise(VOCAB, HIDDEN),
                    "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}
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
        return tensors

    config = qwen3_30b_config(layers)
    if fp8:
        config.quantization_config = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    return write_shards(directory, layers, shard, config)


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
    parser.add_argument("--device", default="cpu", help="where each layer computes (cuda: the GPU's peak is reported)")
    parser.add_argument("--loss_aware", action="store_true",
                        help="also the loss-aware sums (a backward down the layers) and plan omp_normalized + loss")
    stored = parser.add_mutually_exclusive_group()
    stored.add_argument("--fp8", action="store_true", help="a block-FP8 checkpoint (DeepSeek-V3's format)")
    stored.add_argument("--mxfp4", action="store_true", help="gpt-oss-120b's shape, its experts in MXFP4")
    stored.add_argument("--int4", action="store_true", help="Kimi K2 Thinking's shape, its experts in INT4 "
                        "(compressed-tensors)")
    parser.add_argument("--experts", type=int, default=KIMI_EXPERTS, help="with --int4: routed experts per layer")
    args = parser.parse_args()
    if (args.fp8 or args.mxfp4 or args.int4) and args.compensation != "off":
        parser.error("--fp8, --mxfp4 and --int4 measure writing the kept experts' tensors as stored, which a "
                     "compensation would change; use --compensation off")
    torch.set_num_threads(os.cpu_count() or 1)
    warnings.simplefilter("ignore")
    import ompmoe
    from ompmoe.engine.lazy_checkpoint import checkpoint_files

    kind = "fp8" if args.fp8 else "mxfp4" if args.mxfp4 else f"int4-{args.experts}" if args.int4 else None
    source, pruned = args.out / (f"source-{kind}" if kind else "source"), args.out / "pruned"
    vocab = OSS_VOCAB if args.mxfp4 else KIMI_VOCAB if args.int4 else VOCAB
    steps: dict[str, float] = {}
    started = time.perf_counter()
    checkpoint_gib = (build_mxfp4_source(source, args.layers) if args.mxfp4 else
                      build_int4_source(source, args.layers, args.experts) if args.int4 else
                      build_source(source, args.layers, args.fp8))
    steps["build"] = time.perf_counter() - started
    generator = torch.Generator().manual_seed(1)
    blocks = [torch.randint(0, vocab, (1, args.seq_len), generator=generator)
              for _ in range(max(1, args.tokens // args.seq_len))]
    shutil.rmtree(pruned, ignore_errors=True)
    peaks: dict[str, float] = {}
    timings: dict[str, float] = {}
    with AnonymousPeak() as memory:
        tick = time.perf_counter()
        if args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        stats = ompmoe.collect_stats_layerwise(source, blocks, timings=timings, scratch=args.out, device=args.device,
                                               statistics=["loss_aware"] if args.loss_aware else [])
        steps["calibrate"] = time.perf_counter() - tick
        peaks["calibrate"] = memory.peak / 2**30
        tick = time.perf_counter()
        setting = ("omp_normalized", "loss") if args.loss_aware else ("omp", "waterfill")
        plan = ompmoe.plan_pruning(stats, 0.5, method=setting[0], allocation=setting[1])
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
                                                  device=args.device,
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
    same_plan = None if args.loss_aware else resident_slice_agrees(source, blocks, stats)  # a slice has no loss
    shutil.rmtree(pruned)
    if args.int4:  # what a layer computes on, in bf16 (its experts dequantized)
        from ompmoe.engine.export.config import load_stock_config
        from ompmoe.engine.lazy_checkpoint import build_skeleton

        layer = build_skeleton(load_stock_config(source), dtype=torch.bfloat16).model.layers[0]
        layer_gib = sum(tensor.numel() for tensor in layer.state_dict().values()) * 2 / 2**30
    elif args.mxfp4:
        layer_gib = (OSS_EXPERTS * 3 * OSS_HIDDEN * OSS_INTERMEDIATE + 2 * OSS_HIDDEN * OSS_HEADS * OSS_HEAD_DIM
                     + 2 * OSS_HIDDEN * OSS_KV_HEADS * OSS_HEAD_DIM) * 2 / 2**30  # bf16 compute
    else:
        layer_gib = (EXPERTS * 3 * HIDDEN * MOE_INTERMEDIATE + 2 * HIDDEN * HEADS * HEAD_DIM
                     + 2 * HIDDEN * KV_HEADS * HEAD_DIM) * 2 / 2**30  # bf16 compute
    width = OSS_HIDDEN if args.mxfp4 else KIMI_HIDDEN if args.int4 else HIDDEN
    hidden_gib = sum(block.numel() for block in blocks) * width * 2 / 2**30
    print(json.dumps({
        "layers": args.layers, "tokens": sum(block.numel() for block in blocks), "compensation": args.compensation,
        "loss_aware": args.loss_aware, "plan": f"{plan.method} + {plan.allocation}", "device": args.device,
        **({"device_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
           if args.device.startswith("cuda") else {}),
        "fp8": args.fp8, "mxfp4": args.mxfp4, "int4": args.int4,
        "shape": ("gpt-oss-120b" if args.mxfp4 else f"kimi-k2-thinking ({args.experts} experts)" if args.int4
                  else "qwen3-30b-a3b"),
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
    from ompmoe.engine.export.config import load_stock_config
    from ompmoe.engine.export.load import decompress_now

    config = load_stock_config(source)  # Kimi's kimi_k2 config as deepseek_v3
    config.num_hidden_layers = 2
    if getattr(config, "layer_types", None):  # gpt-oss: one attention type per layer
        config.layer_types = config.layer_types[:2]
    with tempfile.TemporaryDirectory() as directory:  # a config of two layers pointing at the same files
        for file in source.iterdir():
            if file.name != "config.json":
                os.symlink(file, Path(directory) / file.name)
        config.save_pretrained(directory)
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, config=config)
    decompress_now(model)  # compressed-tensors: before the statistics' hooks replace forwards
    resident = ompmoe.collect_stats(model, blocks, progress=False)
    layered = ompmoe.MoEStats(layers=stats.layers[:2], num_tokens=stats.num_tokens, fingerprint=resident.fingerprint,
                              model_id=stats.model_id, model_type=stats.model_type)
    close = all(torch.allclose(a.gram, b.gram, rtol=1e-6, atol=0) for a, b in zip(layered.layers, resident.layers))
    planned = ompmoe.plan_pruning(layered, 0.5, allocation="uniform").kept_by_layer()
    return close and planned == ompmoe.plan_pruning(resident, 0.5, allocation="uniform").kept_by_layer()


if __name__ == "__main__":
    main()
