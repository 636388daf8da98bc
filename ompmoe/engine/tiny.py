"""Tiny random models of every supported architecture, built from transformers configs.

They need no download, run in milliseconds on a CPU, and keep each architecture's routing
quirks (shared experts, dense first layers, group-limited and sigmoid routers, GPT-OSS's
biased clamped experts) so tests and the offline demo exercise the real code paths.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=16,
             num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[0]),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
             num_experts=16, num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1),
    ),
    "mixtral": ("MixtralConfig", dict(intermediate_size=24, num_local_experts=8, num_experts_per_tok=2)),
    "olmoe": (
        "OlmoeConfig",
        dict(intermediate_size=16, num_experts=16, num_experts_per_tok=4, norm_topk_prob=False),
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
             n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
             qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, num_key_value_heads=4, topk_method="greedy",
             n_group=4, topk_group=2, routed_scaling_factor=1.0),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
             n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
             qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, num_key_value_heads=4, n_group=4, topk_group=2,
             routed_scaling_factor=2.5, norm_topk_prob=True),
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        dict(head_dim=8, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=16,
             num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
             topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True),
    ),
    "gpt_oss": (
        "GptOssConfig",
        dict(head_dim=8, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
             sliding_window=16, swiglu_limit=7.0),
    ),
}
"""``model_type -> (config class, overrides)`` of the tiny test models."""


def tiny_config(model_type: str, **overrides: Any) -> transformers.PreTrainedConfig:
    """A small config of ``model_type`` (see :data:`TINY_CONFIGS`), with ``overrides`` applied."""
    if model_type not in TINY_CONFIGS:
        raise ValueError(f"No tiny config for {model_type!r}; available: {sorted(TINY_CONFIGS)}.")
    class_name, arch = TINY_CONFIGS[model_type]
    kwargs = {**_COMMON, **arch, **overrides}
    return getattr(transformers, class_name)(**kwargs)


def tiny_model(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> torch.nn.Module:
    """A randomly initialised tiny causal LM in eval mode; router biases are randomised too."""
    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            # Zero-initialised router and expert biases would hide slicing bugs.
            if name.endswith(("router.bias", "e_score_correction_bias", "gate_up_proj_bias", "down_proj_bias")):
                tensor.copy_(torch.randn_like(tensor, dtype=torch.float32).to(tensor.dtype) * 0.1)
            elif name.endswith(("gate.weight", "router.weight")) and tensor.abs().max() == 0:
                tensor.normal_(0.0, 0.2)
    return model.eval()
