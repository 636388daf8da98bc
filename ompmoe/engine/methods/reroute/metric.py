"""The rerouting-aware sums as torchmetrics states, apart from the extension (statistics.py) so that registering it
(which every planning command does) does not import torchmetrics (:mod:`ompmoe.engine.collect.sums`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...adapters import MoELayer
from ...collect.sums import CANCELLED_TOKEN, LayerSumsMetric, outside_autocast


class RerouteStatsMetric(LayerSumsMetric):
    """Sum-reduced rerouting-aware Grams of every MoE layer (merge exactly across batches and ranks)."""

    def __init__(self, layers: list[MoELayer], tensors: Sequence[str], **kwargs: Any) -> None:
        super().__init__(layers, dict.fromkeys(tensors, "gram"), **kwargs)

    @outside_autocast
    def update(self, index: int, ids: torch.Tensor, deltas: torch.Tensor, atoms: torch.Tensor,
               token_weight: torch.Tensor | None) -> None:
        """Add one layer's batch: ``deltas`` from :func:`removal_deltas`, ``atoms`` ``(T, k, d)`` = ``g F``; tokens
        whose atoms cancel get no weight in the normalized Gram (as in the core token-normalized Gram)."""
        n = self.num_experts[index]
        device = self.state("gram_reroute", index).device
        deltas, atoms, ids = deltas.to(device, torch.float32), atoms.to(device, torch.float32), ids.to(device)
        products = torch.bmm(deltas, deltas.transpose(1, 2)).to(torch.float64)  # (T, k, k)
        energy = atoms.sum(1).square().sum(-1).to(torch.float64)
        atom_energy = atoms.square().sum((1, 2)).to(torch.float64)
        valid = energy > CANCELLED_TOKEN * atom_energy
        inverse = torch.where(valid, 1.0 / torch.where(valid, energy, 1.0), 0.0)
        if token_weight is not None:
            products = products * token_weight.to(device, torch.float64).view(-1, 1, 1)
        flat = (ids.unsqueeze(-1) * n + ids.unsqueeze(-2)).reshape(-1)
        super().update(index, "gram_reroute", flat, products)
        super().update(index, "gram_reroute_normalized", flat, products * inverse.view(-1, 1, 1))


__all__ = ["RerouteStatsMetric"]
