"""Tiny random models of every supported architecture, built from transformers configs.

No download, milliseconds on a CPU, and each architecture's routing quirks kept, so tests and the offline demo
exercise the real code paths.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

from .adapters import ARCHITECTURES
from .model_classes import default_model_class, text_config_attribute

_COMMON: dict[str, Any] = dict(
    vocab_size=256, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)

TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    model_type: spec.tiny_config for model_type, spec in ARCHITECTURES.items() if spec.tiny_config is not None
}
"""``model_type -> (config class, overrides)`` of the built-in architectures' tiny models (from their specs)."""


_GENERIC: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts_per_tok=2,
    max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 8))
"""Applied to the defaults of a model type recognized by its modules, each key only where the config has it."""

_MLA = dict(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, head_dim=8,
            num_key_value_heads=4)
_HYBRID = ["linear_attention", "full_attention", "linear_attention"]
_SHARED_TOPK = dict(index_topk=4, indexer_types=["full", "shared", "full"])
"""DSA indexers that keep fewer tokens than a test block has, one layer reusing the previous layer's choice."""
GENERIC_EXTRAS: dict[str, dict[str, Any]] = {
    "axk1": dict(_MLA, n_group=2, topk_group=1),
    "axk2": dict(_MLA),
    "bailing_hybrid": dict(_MLA, layer_group_size=2, num_experts_per_token=2, first_k_dense_replace=1,
                           num_expert_group=2, topk_group=1),
    "beam": dict(mlp_layer_types=["dense", "sparse", "sparse"], n_group=2, topk_group=1),
    "deepseek_v32": dict(_MLA, first_k_dense_replace=1, n_group=2, topk_group=1),
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, attn_config={"kv_n_heads": 2, "rope_theta": 1e4, "clip_qkv": 8.0},
                 ffn_config={"hidden_size": 64, "ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 2}),
    "deepseek_v4": dict(mlp_layer_types=["hash_moe", "moe", "moe"]),  # a hash-routed layer, left whole
    "dots1": dict(n_shared_experts=1, first_k_dense_replace=1),
    "dots3_note_vision_encoder": dict(pyramid_num_routed=[4], num_experts_per_tok=2),  # a vision MoE, left alone
    "dots3_note_text": dict(num_key_value_heads=4, n_group=2, topk_group=1),
    "ernie4_5_moe": dict(moe_k=2),
    "glm4v_moe_text": dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                                            "mrope_section": [2, 1, 1]}),  # sums to head_dim * 0.5 / 2
    "mistral_large4_text": dict(_MLA, qk_head_dim=16, index_head_dim=16, index_n_heads=2, no_rope_layers=[1, 1, 0],
                                kv_source_layers=[0, 0, 2], **_SHARED_TOPK),  # layer 1 reuses layer 0's keys too
    "ernie4_5_vl_moe_text": dict(moe_k=2, moe_intermediate_size=[32, 16], mlp_layer_types=["dense", "sparse", "sparse"],
                                 rope_parameters={"rope_type": "default", "rope_theta": 5e5, "mrope_section": [3, 3, 2]}),
    "deepseek_ocr2_text": dict(mlp_layer_types=["dense", "sparse", "sparse"]),
    "glm5_next_text": dict(_MLA, qk_rope_head_dim=0, qk_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, head_dim=0,
                           mlp_layer_types=["dense", "sparse", "sparse"], index_head_dim=16, index_n_heads=2,
                           index_topk=8, index_kpool=4, indexer_types=_SHARED_TOPK["indexer_types"],
                           layer_types=["indexed_attention", "indexed_attention", "linear_attention"],
                           linear_head_dim=16, linear_num_heads=4),
    "muse_spark_text": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                            layer_rope_theta=[5e5, 0, 5e5], mlp_layer_types=["sparse"] * 3, moe_hidden_size=32),
    "muse_spark_vision": dict(layer_types=["full_attention"]),
    "muse_spark_audio": dict(patch_sizes=[16], hidden_sizes=[32], depths=[1]),
    "inkling_vision": dict(n_layers=2),  # 24 by default: a 1.5 TB tower
    "gemma4_text": dict(enable_moe_block=True, top_k_experts=2, vocab_size_per_layer_input=256),
    "zaya": dict(num_experts_per_tok=1, router_hidden_size=16),
    "glm_moe_dsa": dict(_MLA, mlp_layer_types=["dense", "sparse", "sparse"], **_SHARED_TOPK),
    "granitemoehybrid": dict(layer_types=_HYBRID, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                             mamba_chunk_size=16),
    "hunyuan_v1_moe": dict(moe_topk=2),
    "hy_v4": dict(_SHARED_TOPK),
    "hy_v4_vl_text": dict(_SHARED_TOPK),
    # attention-residual blocks of one layer: a block boundary after each (the loop of Inkling2-Loop is left out:
    # tests/engine/test_layerwise.py runs one)
    "inkling2_text": dict(unpadded_vocab_size=256, n_layers_per_attn_res_block=1),
    "inkling2_loop_text": dict(unpadded_vocab_size=256, n_layers_per_attn_res_block=1),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0,
                  mamba_d_state=8, mamba_dt_rank=8),
    "kimi_linear": dict(_MLA, layer_types=_HYBRID, num_experts_per_token=2),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv"], num_dense_layers=1),
    # its router's std-0.02 weights under the randomized correction bias would route every token to one expert
    "longcat_flash": dict(_MLA, num_layers=2, ffn_hidden_size=64, moe_topk=2, zero_expert_num=2,
                          expert_ffn_hidden_size=32, initializer_range=0.1),
    "mistral4": {key: value for key, value in _MLA.items() if key != "head_dim"},
    "qwen3_5_moe_text": dict(layer_types=_HYBRID),
    # Step 3.7's text decoder: MoE from layer 3 on by default (none of three), a sliding layer needs its window
    "step3p5": dict(mlp_layer_types=["dense", "sparse", "sparse"], sliding_window=8,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # Its modeling code reads vision_start_token_id, which the thinker's own config class lacks (real checkpoints'
    # config.json carries it): a forward with an attention mask needs it.
    "qwen3_omni_moe_thinker": dict(vision_start_token_id=151652),
    "qwen3_next": dict(layer_types=_HYBRID),
    "qwen4_exp_text": dict(layer_types=["linear_attention", "indexed_attention", "linear_attention"],
                           indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=4, ngram_vocab_size_base=1024, split_ngram_parts=8),
}
"""What a model type recognized by its modules needs beyond :data:`_GENERIC` to build and run a forward (a hybrid
needs one attention layer, an MLA model its low-rank sizes, ...)."""


_TOWER: dict[str, Any] = dict(
    depth=1, num_hidden_layers=1, num_layers=1, hidden_size=32, num_heads=2, num_attention_heads=2,
    num_key_value_heads=2, head_dim=16, intermediate_size=64, moe_intermediate_size=32, encoder_layers=1, d_model=32,
    encoder_attention_heads=2, encoder_ffn_dim=64, downsample_hidden_size=16, adapter_in_dim=32, adapter_input_size=32,
    **dict.fromkeys(("out_hidden_size", "output_dim", "adapter_out_dim", "text_hidden_size"), _GENERIC["hidden_size"]))
"""Applied to a multimodal container's vision or audio sub-configs, each key only where the config has it: towers
text calibration never runs, small enough to build in milliseconds."""


def _made_small(config_class: type, generic: dict[str, Any], extras: dict[str, Any]) -> dict[str, Any]:
    defaults = config_class().to_dict()
    return {**{key: value for key, value in generic.items() if key in defaults}, **extras}


def _small_tower(config: transformers.PreTrainedConfig) -> dict[str, Any]:
    """A vision or audio tower's config made small (:data:`_TOWER`), the encoders nested in it too (a SAM and a
    CLIP encoder in one OCR tower)."""
    small = _made_small(type(config), _TOWER, GENERIC_EXTRAS.get(config.model_type, {}))
    for name in getattr(type(config), "sub_configs", None) or {}:
        if isinstance(inner := getattr(config, name, None), transformers.PreTrainedConfig):
            small[name] = _small_tower(inner)
    return small


def _container_config(config_class: type, text_attribute: str, **overrides: Any) -> transformers.PreTrainedConfig:
    """A multimodal container's config with its text decoder made small as any type's (:data:`_GENERIC`) and its
    towers smaller still (:data:`_TOWER`)."""
    defaults = config_class()
    parts: dict[str, Any] = {}
    for name in config_class.sub_configs:
        sub = getattr(defaults, name, None)
        if name == text_attribute:  # the text decoder type's own tiny config, as the matrix checks it alone
            parts[name] = tiny_config(sub.model_type) if sub.model_type in transformers.CONFIG_MAPPING else \
                type(sub)(**_made_small(type(sub), _GENERIC, GENERIC_EXTRAS.get(sub.model_type, {})))
        elif isinstance(sub, transformers.PreTrainedConfig):
            parts[name] = _small_tower(sub)
    return config_class(**{**parts, **GENERIC_EXTRAS.get(defaults.model_type, {}), **overrides})


def tiny_config(model_type: str, **overrides: Any) -> transformers.PreTrainedConfig:
    """A small config of ``model_type``: a registered architecture's own (:data:`TINY_CONFIGS`, later registered ones
    too), else the type's defaults made small (:data:`_GENERIC`, :data:`GENERIC_EXTRAS`); ``overrides`` applied."""
    spec = ARCHITECTURES.get(model_type)
    if spec is not None and spec.tiny_config is not None:
        class_name, arch = spec.tiny_config
        return getattr(transformers, class_name)(**{**_COMMON, **arch, **overrides})
    if model_type not in transformers.CONFIG_MAPPING:
        available = sorted(name for name, spec in ARCHITECTURES.items() if spec.tiny_config is not None)
        raise ValueError(f"No tiny config for {model_type!r}: transformers has no such model type; registered: "
                         f"{available}.")
    config_class = transformers.CONFIG_MAPPING[model_type]
    if (text_attribute := text_config_attribute(config_class())) is not None:
        return _container_config(config_class, text_attribute, **overrides)
    return config_class(**{**_made_small(config_class, _GENERIC, GENERIC_EXTRAS.get(model_type, {})), **overrides})


def tiny_model(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> torch.nn.Module:
    """A randomly initialised tiny causal LM (a multimodal container for a container's type) in eval mode; router
    biases are randomised too."""
    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    model = default_model_class(config)._from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            # Zero-initialised router and expert biases would hide slicing bugs.
            if name.endswith(("router.bias", "e_score_correction_bias", "gate_up_proj_bias", "down_proj_bias",
                              "expert_bias")) and tensor.is_floating_point():
                tensor.copy_(torch.randn_like(tensor, dtype=torch.float32).to(tensor.dtype) * 0.1)
            elif name.endswith(("gate.weight", "router.weight", ".wg.weight")) and tensor.abs().max() == 0:
                tensor.normal_(0.0, 0.2)
            elif tensor.dim() == 3 and tensor.is_floating_point() and tensor.abs().max() == 0:
                tensor.normal_(0.0, 0.05)  # fused experts some types initialise to zero
    return model.eval()
