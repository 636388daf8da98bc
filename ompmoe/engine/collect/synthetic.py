"""Synthetic statistics of any shape, for plots and benchmarks at real scale without a real model.

Per layer a PSD Gram ``A A^T + D`` with log-normally spread atom energies (real experts differ by orders of
magnitude), routing counts loosely following them, and every ``dominant_every``-th layer one dominant expert.
"""

from __future__ import annotations

import torch

from .statistics import LayerStats, MoEStats


def synthetic_stats(num_layers: int = 48, num_experts: int = 128, top_k: int = 8, *, rank: int = 96,
                    dominant_every: int = 12, seed: int = 0) -> MoEStats:
    """Statistics of ``num_layers`` MoE layers of ``num_experts`` experts (top-``top_k``), seeded."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=generator, dtype=torch.float64)

    layers = []
    for index in range(num_layers):
        scale = torch.exp(1.2 * torch.randn(num_experts, 1, generator=generator, dtype=torch.float64))
        if dominant_every and index % dominant_every == dominant_every - 1:
            scale[int(rand(1) * num_experts)] *= 10.0 * num_experts ** 0.5
        atoms = torch.randn(num_experts, rank, generator=generator, dtype=torch.float64) * scale
        atoms += 0.3 * atoms.mean(dim=0, keepdim=True)  # shared direction: atoms overlap, as real ones do
        spread = scale.squeeze(1)
        gram = atoms @ atoms.T + torch.diag(0.05 * spread ** 2)
        tokens = (1e4 * (0.2 + rand(num_experts)) * spread.sqrt()).round()
        weights = tokens * (0.1 + 0.3 * rand(num_experts))
        layers.append(LayerStats(
            name=f"model.layers.{index}.mlp", num_experts=num_experts, top_k=top_k, num_groups=1, topk_group=1,
            group_score_topk=1, gram=gram, routing_mass=weights, token_count=tokens,
            sq_norm_sum=gram.diagonal() / weights.clamp(min=1.0) ** 2 * tokens * 4.0,
            norm_sum=tokens * spread, weighted_norm_sum=weights * spread))
    return MoEStats(layers=layers, num_tokens=int(sum(layers[0].token_count) // top_k),
                    fingerprint=f"synthetic-{num_layers}x{num_experts}-{seed}")


__all__ = ["synthetic_stats"]
