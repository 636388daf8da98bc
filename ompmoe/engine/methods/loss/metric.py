"""The loss-aware sums as torchmetrics states, apart from the extension (statistics.py) so that registering it
(which every planning command does) does not import torchmetrics (:mod:`ompmoe.engine.collect.sums`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...adapters import MoELayer
from ...identity_experts import measured_ids
from ...collect.sums import LayerSumsMetric, outside_autocast


class LossStatsMetric(LayerSumsMetric):
    """Sum-reduced loss-aware states of every MoE layer (merge exactly across batches and ranks)."""

    def __init__(self, layers: list[MoELayer], tensors: Sequence[str], **kwargs: Any) -> None:
        shapes = {key: "vector" if key == "loss_first_order" else "gram" for key in tensors}
        super().__init__(layers, shapes, **kwargs)
        self.add_state("loss_sum", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    @outside_autocast
    def update(self, index: int, top_k_index: torch.Tensor, atoms: torch.Tensor, grad: torch.Tensor,
               token_weight: torch.Tensor | None) -> None:
        """Add one layer's batch: ``atoms`` ``(T, k, d)`` = ``g F``, ``grad`` ``(T, d)`` = ``d_x``."""
        n = self.num_experts[index]
        device = self.loss_sum.device
        atoms = atoms.detach().to(device, torch.float32)
        grad = grad.detach().to(device, torch.float32)
        ids = measured_ids(top_k_index.to(device), n)[0]  # LongCat's identity pairs: zero atoms
        weight = None
        if token_weight is not None:
            keep = token_weight.to(device) > 0
            atoms, grad, ids = atoms[keep], grad[keep], ids[keep]
            weight = token_weight.to(device, torch.float64)[keep]
        # Three batched products on the (T, k, d) atoms as they are (no concatenated copies).
        grad_sq = grad.square()
        atoms_t = atoms.transpose(1, 2)
        gram = torch.bmm(atoms, atoms_t).to(torch.float64)  # <V_e, V_f>
        fisher = torch.bmm(atoms * grad_sq.unsqueeze(1), atoms_t).to(torch.float64)  # sum_i d_i^2 V_e,i V_f,i
        projection = torch.bmm(atoms, grad.unsqueeze(-1)).squeeze(-1).to(torch.float64)  # a_e(x) = <V_e(x), d_x>
        grad_energy = grad_sq.sum(-1).to(torch.float64)
        per_pair = torch.stack([
            gram * grad_energy.view(-1, 1, 1),  # gram_grad
            projection.unsqueeze(-1) * projection.unsqueeze(-2),  # gram_loss
            fisher,  # gram_fisher
        ])  # (3, T, k, k)
        if weight is not None:
            per_pair = per_pair * weight.view(1, -1, 1, 1)
            projection = projection * weight.view(-1, 1)
        flat_gram_index = (ids.unsqueeze(-1) * n + ids.unsqueeze(-2)).reshape(-1)
        sums = per_pair.new_zeros(3, n * n).index_add_(1, flat_gram_index, per_pair.reshape(3, -1))
        for key, value in zip(("gram_grad", "gram_loss", "gram_fisher"), sums):
            self.state(key, index).view(-1).add_(value)
        super().update(index, "loss_first_order", ids, projection)


__all__ = ["LossStatsMetric"]
