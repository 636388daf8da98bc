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
    implementation = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    supported = (implementation == "grouped_mm" and _grouped_linear is not None
                 and not getattr(experts, "_is_expert_parallel", False)
                 and all(hasattr(experts, a) for a in REQUIRED_ATTRS))
    return replay_grouped_mm if supported else None


def replay_grouped_mm(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(module output, F, g * F)`` with expert outputs ``(tokens * top_k, d)`` token-major, mirroring
    ``transformers.integrations.moe.grouped_mm_experts_forward`` step by step (without expert parallelism)."""
    num_tokens, num_top_k = top_k_index.shape
    projected, _, _, inverse = sorted_expert_outputs(experts, hidden_states, top_k_index.reshape(-1), num_top_k)
    pair_outputs = projected[inverse]  # token-major F, (tokens * top_k, d)
    del projected
    weighted = pair_outputs * top_k_weights.reshape(-1).unsqueeze(-1)
    output = weighted.view(num_tokens, num_top_k, hidden_states.size(-1)).sum(dim=1).to(hidden_states.dtype)
    return output, pair_outputs, weighted


def sorted_expert_outputs(experts: nn.Module, hidden_states: torch.Tensor, expert_ids: torch.Tensor,
                          num_top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(F sorted by expert, sorted ids, perm, inverse perm)``: the native forward's steps before the routing
    weights. Ids equal to ``num_experts`` sort after every real group and are left out of the group sizes, so the
    grouped GEMMs never compute their rows (left as the kernel left them)."""
    device = hidden_states.device
    num_experts = experts.num_experts
    expert_ids_g, perm = torch.sort(expert_ids)
    selected = hidden_states[perm // num_top_k]
    histc_input = expert_ids_g.float() if device.type in ("cpu", "mps") else expert_ids_g.int()
    tokens_per_expert = torch.histc(histc_input, bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    bias_ids = expert_ids_g.clamp(max=num_experts - 1) if experts.has_bias else None
    up = "gate_up_proj" if experts.has_gate else "up_proj"
    bias = getattr(experts, f"{up}_bias")[bias_ids] if experts.has_bias else None
    projected = _grouped_linear(selected, getattr(experts, up), offsets, bias=bias,
                                is_transposed=experts.is_transposed)
    del selected
    projected = experts._apply_gate(projected) if experts.has_gate else experts.act_fn(projected)
    down_bias = experts.down_proj_bias[bias_ids] if experts.has_bias else None
    projected = _grouped_linear(projected, experts.down_proj, offsets, bias=down_bias,
                                is_transposed=experts.is_transposed)
    if getattr(experts, "has_post_expert_norm", False):
        projected = experts.post_expert_norm(projected)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0), device=device)
    return projected, expert_ids_g, perm, inverse


__all__ = ["replay_grouped_mm", "replayable", "sorted_expert_outputs"]
