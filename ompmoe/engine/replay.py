"""Per-pair expert outputs ``F_e(x)`` from the experts' own ``grouped_mm`` computation (same steps, same kernels), with
the module output bit for bit; implementations it cannot replay exactly get ``None`` from :func:`replayable`, and the
caller falls back to a flattened call."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

try:  # transformers' own grouped kernels, so the replay dispatches exactly as the native forward
    from transformers.integrations.moe import _grouped_linear
except ImportError:  # pragma: no cover - older or newer transformers without the helper
    _grouped_linear = None

REQUIRED_ATTRS = ("has_gate", "has_bias", "is_transposed", "_apply_gate")


def replayable(experts: nn.Module) -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
    """The replay matching ``experts``' configured implementation, or ``None`` to use the flattened call."""
    config = getattr(experts, "config", None)
    implementation = getattr(config, "_experts_implementation", None)
    if implementation != "grouped_mm" or _grouped_linear is None:
        return None
    if getattr(experts, "_is_expert_parallel", False) or not all(hasattr(experts, a) for a in REQUIRED_ATTRS):
        return None
    return replay_grouped_mm


def replay_grouped_mm(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(module output, F, g * F)`` with expert outputs ``(tokens * top_k, d)`` token-major, mirroring
    ``transformers.integrations.moe.grouped_mm_experts_forward`` step by step (without expert parallelism)."""
    device = hidden_states.device
    num_tokens, num_top_k = top_k_index.shape
    hidden_dim = hidden_states.size(-1)
    expert_ids = top_k_index.reshape(-1)
    expert_ids_g, perm = torch.sort(expert_ids)
    selected = hidden_states[perm // num_top_k]
    histc_input = expert_ids_g.float() if device.type in ("cpu", "mps") else expert_ids_g.int()
    tokens_per_expert = torch.histc(histc_input, bins=experts.num_experts, min=0, max=experts.num_experts - 1)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    if experts.has_gate:
        weight, bias = experts.gate_up_proj, experts.gate_up_proj_bias if experts.has_bias else None
    else:
        weight, bias = experts.up_proj, experts.up_proj_bias if experts.has_bias else None
    bias = None if bias is None else bias[expert_ids_g]
    projected = _grouped_linear(selected, weight, offsets, bias=bias, is_transposed=experts.is_transposed)
    del selected
    projected = experts._apply_gate(projected) if experts.has_gate else experts.act_fn(projected)
    down_bias = experts.down_proj_bias[expert_ids_g] if experts.has_bias else None
    projected = _grouped_linear(projected, experts.down_proj, offsets, bias=down_bias,
                                is_transposed=experts.is_transposed)
    if getattr(experts, "has_post_expert_norm", False):
        projected = experts.post_expert_norm(projected)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0), device=device)
    pair_outputs = projected[inverse]  # token-major F, (tokens * top_k, d)
    del projected
    weighted = pair_outputs * top_k_weights.reshape(-1).unsqueeze(-1)
    output = weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)
    return output, pair_outputs, weighted


__all__ = ["replay_grouped_mm", "replayable"]
