"""Score rankings: keep the experts with the best per-expert score (the field's baselines)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..collect.statistics import LayerStats
from ..planning.method_registry import Selection, SelectionMethod, register_method


def score_order(scores: torch.Tensor, num_groups: int = 1) -> torch.Tensor:
    """Experts by descending score, ties to the lowest id; with groups (contiguous id blocks), round ``r`` takes the
    ``r``-th best expert of every group, best score first, so every method keeps the same count in each group."""
    scores = torch.nan_to_num(scores.detach().to("cpu", torch.float64), nan=float("-inf"))
    n = scores.numel()
    if n % num_groups:
        raise ValueError(f"{n} experts cannot be split into {num_groups} equal groups.")
    order = torch.sort(scores, descending=True, stable=True).indices
    group = order // (n // num_groups)
    rank_in_group = (torch.nn.functional.one_hot(group, num_groups).cumsum(0) - 1)[torch.arange(n), group]
    return order[torch.sort(rank_in_group, stable=True).indices]


class ScoreRanking(SelectionMethod):
    """Base of methods that rank experts by one score per expert: the ``score_key`` tensor, or :meth:`scores`."""

    score_key: ClassVar[str] = ""

    def scores(self, layers: Sequence[LayerStats]) -> list[torch.Tensor]:
        if not self.score_key:
            raise NotImplementedError
        return [getattr(layer, self.score_key) for layer in layers]

    def select(self, layers: Sequence[LayerStats]) -> list[Selection]:
        return [score_order(s, layer.num_groups) for layer, s in zip(layers, self.scores(layers))]


@register_method
@dataclass
class Frequency(ScoreRanking):
    """most routed calibration tokens"""

    name: ClassVar[str] = "frequency"
    default_allocation: ClassVar[str] = "uniform"  # as REAP's paper runs it and the baselines it compares
    score_key: ClassVar[str] = "token_count"


@register_method
@dataclass
class RoutingMass(ScoreRanking):
    """largest `sum_x g_e(x)`"""

    name: ClassVar[str] = "routing_mass"
    score_key: ClassVar[str] = "routing_mass"


@register_method
@dataclass
class EAN(ScoreRanking):
    """largest expert activation norm `sum_x ||F_e(x)||` over routed tokens"""

    name: ClassVar[str] = "ean"
    default_allocation: ClassVar[str] = "uniform"  # as REAP's paper runs it and the baselines it compares
    score_key: ClassVar[str] = "norm_sum"


def reap_scores(layer: LayerStats) -> torch.Tensor:
    """REAP saliency ``mean_{x routed to e} g_e(x) ||F_e(x)||`` (0 for an expert never routed)."""
    count = layer.token_count.to(torch.float64)
    return torch.where(count > 0, layer.weighted_norm_sum.to(torch.float64) / count.clamp(min=1e-300), 0.0)


@register_method
@dataclass
class REAP(ScoreRanking):
    """largest REAP saliency `mean_{x routed to e} g_e(x) ||F_e(x)||` (Lasby et al., 2025)"""

    name: ClassVar[str] = "reap"
    default_allocation: ClassVar[str] = "uniform"  # as REAP's paper runs it and the baselines it compares

    def scores(self, layers: Sequence[LayerStats]) -> list[torch.Tensor]:
        return [reap_scores(layer) for layer in layers]


@register_method
@dataclass
class Random(ScoreRanking):
    """a seeded random ranking

    I.i.d. uniform scores per expert from ``torch.Generator().manual_seed(seed)``, drawn layer after layer."""

    name: ClassVar[str] = "random"
    seed: int = 0

    def scores(self, layers: Sequence[LayerStats]) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(int(self.seed))
        return [torch.rand(layer.num_experts, generator=generator, dtype=torch.float64) for layer in layers]


@register_method
@dataclass
class StaticEnergy(ScoreRanking):
    """largest `||V_e||^2` (OMP without residual updates)"""

    name: ClassVar[str] = "static_energy"
    score_key: ClassVar[str] = "atom_energy"
