"""Tiny random models of every supported architecture, built from transformers configs.

No download, milliseconds on a CPU, and each architecture's routing quirks kept, so tests and the offline demo
exercise the real code paths.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

from .adapters import ARCHITECTURES

_COMMON: dict[str, Any] = dict(
    vocab_size=256, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)

TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    model_type: spec.tiny_config for model_type, spec in ARCHITECTURES.items() if spec.tiny_config is not None
}
"""``model_type -> (config class, overrides)`` of the built-in architectures' tiny models (from their specs)."""


def tiny_config(model_type: str, **overrides: Any) -> transformers.PreTrainedConfig:
    """A small config of ``model_type`` (see :data:`TINY_CONFIGS`; later registered architectures too), with
    ``overrides`` applied."""
    available = sorted(name for name, spec in ARCHITECTURES.items() if spec.tiny_config is not None)
    if model_type not in available:
        raise ValueError(f"No tiny config for {model_type!r}; available: {available}.")
    class_name, arch = ARCHITECTURES[model_type].tiny_config  # type: ignore[misc]
    return getattr(transformers, class_name)(**{**_COMMON, **arch, **overrides})


def tiny_model(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> torch.nn.Module:
    """A randomly initialised tiny causal LM in eval mode; router biases are randomised too."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=dtype)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            # Zero-initialised router and expert biases would hide slicing bugs.
            if name.endswith(("router.bias", "e_score_correction_bias", "gate_up_proj_bias", "down_proj_bias")):
                tensor.copy_(torch.randn_like(tensor, dtype=torch.float32).to(tensor.dtype) * 0.1)
            elif name.endswith(("gate.weight", "router.weight")) and tensor.abs().max() == 0:
                tensor.normal_(0.0, 0.2)
    return model.eval()
