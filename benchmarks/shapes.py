"""Real MoE layer shapes with random weights, built fast: on the meta device, then materialized.

Random weights cost exactly what trained ones do, so the shapes below time the statistics pass
and adaptive inference at the sizes users run. ``build_model`` creates the model on ``meta``,
allocates every non-expert tensor on the target device and runs the model's own initializer on
it (rotary buffers included), then fills the fused expert tensors with ``normal(0, std)``.
``share_expert_weights`` backs all experts of a layer by one expert's storage (a stride-0 view):
the compute per routed pair is unchanged, and a DeepSeek-V3 layer (45 GB of float32 experts)
fits on a small machine. Figures measured that way are labelled as such by the benchmarks.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import nn

from ompmoe import find_moe_layers

QWEN3_30B_A3B: dict[str, Any] = dict(
    model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
    num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128, norm_topk_prob=True,
    mlp_only_layers=[], decoder_sparse_step=1, rms_norm_eps=1e-6, max_position_embeddings=40960, vocab_size=151936,
    tie_word_embeddings=False,
)
"""Qwen/Qwen3-30B-A3B's config.json (48 layers, every one sparse)."""
QWEN3_30B_A3B_LAYERS = 48

DEEPSEEK_V3: dict[str, Any] = dict(
    model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4,
    first_k_dense_replace=0, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, num_attention_heads=128, num_key_value_heads=128, routed_scaling_factor=2.5, norm_topk_prob=True,
    vocab_size=129280, max_position_embeddings=163840, tie_word_embeddings=False,
)
"""deepseek-ai/DeepSeek-V3's config.json with ``first_k_dense_replace=0`` so a one-layer model is sparse."""

SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B, "deepseek-v3": DEEPSEEK_V3}


def build_model(
    shape: dict[str, Any],
    num_layers: int = 1,
    *,
    vocab_size: int | None = 256,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    share_expert_weights: bool = False,
    std: float = 0.02,
    router_std: float | None = None,
    seed: int = 0,
    experts_implementation: str | None = "grouped_mm",
) -> nn.Module:
    """A random ``num_layers``-layer causal LM of ``shape``, in eval mode (``vocab_size=None`` keeps the real vocabulary)."""
    overrides = {"num_hidden_layers": num_layers}
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    config = transformers.AutoConfig.for_model(**{**shape, **overrides})
    if experts_implementation is not None:
        config._experts_implementation = experts_implementation
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    layers = find_moe_layers(model)
    fused = {id(layer.experts) for layer in layers}
    for module in model.modules():
        if id(module) not in fused:
            module.to_empty(device=device, recurse=False)
    torch.manual_seed(seed)
    model.init_weights()  # the model's own initializer; the experts stay on meta until below
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for layer in layers:
            for name, parameter in list(layer.experts.named_parameters(recurse=False)):
                full = tuple(parameter.shape)
                stored = (1, *full[1:]) if share_expert_weights else full
                value = torch.empty(stored, dtype=dtype, device=device).normal_(0.0, std, generator=generator)
                setattr(layer.experts, name, nn.Parameter(value.expand(full), requires_grad=False))
            if router_std is not None:
                layer.router.weight.normal_(0.0, router_std, generator=generator)
    return model.eval().requires_grad_(False)


def describe(shape: dict[str, Any]) -> str:
    experts = shape.get("num_experts", shape.get("n_routed_experts"))
    groups = f", {shape['n_group']} groups" if shape.get("n_group", 1) > 1 else ""
    return (
        f"{shape['model_type']}: hidden {shape['hidden_size']}, {experts} experts, top-{shape['num_experts_per_tok']}, "
        f"expert width {shape['moe_intermediate_size']}{groups}"
    )
