"""The sum-reduced torchmetrics states a statistics pass fills: the core sums and the base class of every
extension's. Apart from the collector and the extensions' registry so that what only reads saved statistics (``ompmoe
prune``, ``ompmoe plot``, planning from Python) never imports torchmetrics, whose package import alone takes about a
second (it loads scipy.signal and its text metrics)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torchmetrics import Metric

from ..adapters import MoELayer
from ..identity_experts import measured_ids
from .errors import CalibrationInputError
from .statistics import PER_EXPERT_SUMS, LayerStats

Update = TypeVar("Update", bound=Callable[..., None])


def outside_autocast(update: Update) -> Update:
    """A metric's ``update`` with autocast off: the hooks run inside the model's forward, which a mixed-precision run
    (Lightning's or Fabric's ``bf16-mixed``) autocasts, and its products would be taken in bfloat16 (a Gram 3e-4 off,
    not even symmetric); the sums are float32 products added in float64 whatever the run's precision."""
    @functools.wraps(update)
    def full_precision(self: Metric, *args: Any, **kwargs: Any) -> None:
        with torch.autocast(device_type=self.device.type, enabled=False):
            update(self, *args, **kwargs)

    return full_precision  # type: ignore[return-value]


CANCELLED_TOKEN = 1e-6
"""A token whose routed output has ``||Y_x||^2 <= CANCELLED_TOKEN * sum_e ||V_e(x)||^2`` (its atoms
cancel to within float32 rounding) gets no weight in the token-normalized Grams."""


class LayerSumsMetric(Metric):
    """Sum-reduced float64 states ``{key}_{layer}`` per MoE layer; ``keys`` maps each to ``"gram"``, ``"vector"`` or
    a row count ``r`` (``(r, N)``: several per-expert sums stacked)."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(self, layers: Sequence[MoELayer], keys: dict[str, str | int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_experts = [layer.num_experts for layer in layers]
        self.keys = dict(keys)
        for i, n in enumerate(self.num_experts):
            for key, shape in self.keys.items():
                size = (n, n) if shape == "gram" else (n,) if shape == "vector" else (shape, n)
                self.add_state(f"{key}_{i}", torch.zeros(size, dtype=torch.float64), dist_reduce_fx="sum")

    def state(self, key: str, index: int) -> torch.Tensor:
        return getattr(self, f"{key}_{index}")

    def update(self, index: int, key: str, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``values`` at the flat ``positions`` of layer ``index``'s ``key`` (``e * N + f`` in a Gram)."""
        state = self.state(key, index)
        values = values.reshape(-1).to(state.device, torch.float64)
        state.view(-1).index_add_(0, positions.reshape(-1).to(state.device), values)

    def compute(self) -> list[dict[str, torch.Tensor]]:
        """Per layer, the summed tensors (over ranks when distributed)."""
        return [{key: self.state(key, i).clone() for key in self.keys} for i in range(len(self.num_experts))]


class MoEStatsMetric(LayerSumsMetric):
    """Sum-reduced torchmetrics states for every MoE layer, so DDP/FSDP ranks merge exactly.

    ``token_weight`` (per token, 0 for padding or samples a distributed sampler duplicated) scales every sum.
    """

    def __init__(self, layers: list[MoELayer], **kwargs: Any) -> None:
        # Per-expert sums stacked in PER_EXPERT_SUMS order: one index_add_ per batch.
        super().__init__(layers, {"gram": "gram", "gram_normalized": "gram", "expert_sums": len(PER_EXPERT_SUMS)},
                         **kwargs)
        self.routing = [(layer.name, layer.routing) for layer in layers]
        self.add_state("num_tokens", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.token_weight: torch.Tensor | None = None

    def set_token_weight(self, weight: torch.Tensor | None, num_tokens: int) -> None:
        """Per-token weights (a 0/1 mask, flattened batch-major) for the next forward; ``None`` counts all tokens."""
        if weight is not None:
            weight = weight.reshape(-1).to(self.num_tokens.device, torch.float64)
            if not bool(((weight == 0) | (weight == 1)).all()):
                odd = weight[(weight != 0) & (weight != 1)][0].item()
                raise CalibrationInputError(f"Token weights (attention_mask) must be 0 or 1; found {odd}. Pass the "
                                            "tokenizer's 0/1 mask (a weighted mask would scale every statistic).")
        self.token_weight = weight
        self.num_tokens += num_tokens if weight is None else weight.sum()

    @outside_autocast
    def update(self, index: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, outputs: torch.Tensor,
               atoms: torch.Tensor | None = None) -> None:
        """Add one layer's batch: ``outputs`` holds the unweighted ``F_e(x)`` per routed pair, token-major.

        ``atoms`` (``g * F`` as the experts computed them) are used only when they are the float32 atoms formed here.
        """
        num_tokens, top_k = top_k_index.shape
        n = self.routing[index][1]["num_experts"]
        gram = getattr(self, f"gram_{index}")
        device = gram.device
        expert_out = outputs.detach().view(num_tokens, top_k, -1).to(device, torch.float32)
        gates = top_k_weights.detach().to(device, torch.float32)
        exact = atoms is not None and outputs.dtype == top_k_weights.dtype == atoms.dtype == torch.float32
        atoms = atoms.detach().view(num_tokens, top_k, -1).to(device) if exact else None
        ids, measured = measured_ids(top_k_index.to(device), n)  # LongCat's identity pairs: zeros, not counted
        weight = self.token_weight
        if weight is not None:
            if weight.numel() != num_tokens:
                raise ValueError(f"attention_mask covers {weight.numel()} tokens but layer {self.routing[index][0]} "
                                 f"routed {num_tokens}; pass masks shaped like input_ids.")
            # Drop padding outright (its hidden states may be non-finite); weights are 0/1, so the rest weigh 1.
            keep = weight.to(device) > 0
            if not bool(keep.all()):
                expert_out, gates, ids, measured = expert_out[keep], gates[keep], ids[keep], measured[keep]
                atoms = atoms[keep] if atoms is not None else None
        if atoms is None:
            atoms = expert_out * gates.unsqueeze(-1)  # V = g * F, alive for this batch only
        pair_products = torch.bmm(atoms, atoms.transpose(1, 2)).to(torch.float64)  # (T, k, k)
        # Token-normalized Gram: each token's products over ||Y_x||^2 = sum of its products.
        output_energy = pair_products.sum(dim=(1, 2))
        atom_energy = pair_products.diagonal(dim1=1, dim2=2).sum(-1)
        valid = output_energy > CANCELLED_TOKEN * atom_energy
        inverse_energy = torch.where(valid, 1.0 / torch.where(valid, output_energy, 1.0), 0.0)
        sq_norm = expert_out.square().sum(-1).to(torch.float64)  # ||F||^2 per pair
        norm = sq_norm.sqrt()
        gates64 = gates.to(torch.float64)
        flat_gram_index = (ids.unsqueeze(-1) * n + ids.unsqueeze(-2)).reshape(-1)
        gram.view(-1).index_add_(0, flat_gram_index, pair_products.reshape(-1))
        normalized = (pair_products * inverse_energy.view(-1, 1, 1)).reshape(-1)
        getattr(self, f"gram_normalized_{index}").view(-1).index_add_(0, flat_gram_index, normalized)
        sums = {"routing_mass": gates64, "token_count": measured.to(torch.float64), "sq_norm_sum": sq_norm,
                "norm_sum": norm, "weighted_norm_sum": gates64 * norm}
        stacked = torch.stack([sums[key] for key in PER_EXPERT_SUMS]).reshape(len(PER_EXPERT_SUMS), -1)
        getattr(self, f"expert_sums_{index}").index_add_(1, ids.reshape(-1), stacked)

    def compute(self) -> tuple[list[LayerStats], int]:
        """Per-layer statistics and the token count, summed over ranks when distributed."""
        layers = []
        for i, (name, routing) in enumerate(self.routing):
            sums = getattr(self, f"expert_sums_{i}")
            layers.append(LayerStats(name=name, **routing, gram=getattr(self, f"gram_{i}").clone(),
                                     **{key: sums[row].clone() for row, key in enumerate(PER_EXPERT_SUMS)},
                                     gram_normalized=getattr(self, f"gram_normalized_{i}").clone()))
        return layers, int(round(float(self.num_tokens)))


__all__ = ["CANCELLED_TOKEN", "LayerSumsMetric", "MoEStatsMetric"]
