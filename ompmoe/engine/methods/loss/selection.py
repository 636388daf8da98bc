"""Selection and allocation in loss units (:mod:`ompmoe.engine.loss_stats`): removing the experts ``u`` of a layer
changes the loss by about ``dL(u) = -s^T u + 1/2 u^T H u`` nats, the same units in every layer, so the estimates add
up across layers without the paper's normalization (``loss_risk``: ``dL_l(0)`` plays the role of ``||Y_l||^2``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ...collect.statistics import LayerStats
from ...planning.allocation import AllocationProblem, optimal_allocation, register_allocation
from ...planning.method_registry import (
    Selection,
    SelectionMethod,
    kept_masks,
    register_method,
    removed_energy,
    require_statistic,
)
from ...planning.selection import grouped_greedy
from ..omp import GramPursuit


def greedy_quadratic(hessian: torch.Tensor, linear: torch.Tensor, num_groups: int = 1) -> torch.Tensor:
    """Order experts by greedily keeping the one that lowers ``q(u) = -linear^T u + 1/2 u^T H u`` most, from ``u = 1``
    (every expert removed): with ``linear = 0`` and ``H = 2 G``, the greedy binary pursuit on ``G`` (grouped alike)."""
    h = hessian.to(torch.float64)
    b = linear.to(torch.float64)
    half_diagonal = 0.5 * h.diagonal()
    # keeping e lowers q by (H u)_e - H_ee / 2 - linear_e, and H u by H's column e (a row of H^T)
    steps = grouped_greedy(h.t().unsqueeze(0), h.sum(dim=1).unsqueeze(0), lambda hu: hu - half_diagonal - b,
                           num_groups)
    return torch.tensor([int(chosen) for _, _, chosen in steps], dtype=torch.long)


@register_method
@dataclass
class OMPLoss(GramPursuit):
    """greedy pursuit on the rank-1 loss Gram `sum_x a_e(x) a_f(x)`, `a_e(x) = <dL/dY_x, V_e(x)>` (loss-aware statistics)"""

    name: ClassVar[str] = "omp_loss"
    gram_key: ClassVar[str] = "gram_loss"
    statistics: ClassVar[tuple[str, ...]] = ("loss_aware",)


@register_method
@dataclass
class OMPGrad(GramPursuit):
    """greedy pursuit on the Gram weighted per token by `||dL/dY_x||^2` (loss-aware statistics)"""

    name: ClassVar[str] = "omp_grad"
    gram_key: ClassVar[str] = "gram_grad"
    statistics: ClassVar[tuple[str, ...]] = ("loss_aware",)


@register_method
@dataclass
class OMPFisher(GramPursuit):
    """greedy pursuit on the per-token diagonal-Fisher Gram `sum_x sum_i d_{x,i}^2 V_e,i V_f,i` (loss-aware statistics)"""

    name: ClassVar[str] = "omp_fisher"
    gram_key: ClassVar[str] = "gram_fisher"
    statistics: ClassVar[tuple[str, ...]] = ("loss_aware",)


@register_method
@dataclass
class LossNewton(SelectionMethod):
    """greedy minimum of the second-order loss estimate `-s^T u + u^T G_loss u / 2` with its first-order term (loss-aware statistics)"""

    name: ClassVar[str] = "loss_newton"
    statistics: ClassVar[tuple[str, ...]] = ("loss_aware",)

    def select(self, layers: Sequence[LayerStats]) -> list[Selection]:
        require_statistic(layers, "gram_loss", f"Method {self.name!r}")
        require_statistic(layers, "loss_first_order", f"Method {self.name!r}")
        return [greedy_quadratic(layer.gram_loss, layer.loss_first_order, layer.num_groups) for layer in layers]


def trace_normalized(gram: torch.Tensor) -> torch.Tensor:
    """``G / trace(G)`` in float64: two Grams measured in different units weigh by their shape, not their scale."""
    g = gram.to(torch.float64)
    return g / g.diagonal().sum().clamp(min=torch.finfo(torch.float64).tiny)


@register_method
@dataclass
class OMPHybrid(GramPursuit):
    """greedy pursuit on the token-normalized Gram plus `loss_weight` x the `||dL/dY_x||^2`-weighted Gram, each over its trace (loss-aware statistics)"""

    name: ClassVar[str] = "omp_hybrid"
    statistics: ClassVar[tuple[str, ...]] = ("loss_aware",)
    loss_weight: float = 1.0

    def __post_init__(self) -> None:  # refused when the strategy is built, before any calibration
        weight = self.loss_weight
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
            raise ValueError(f"omp_hybrid's loss_weight must be a finite number >= 0 (0 is omp_normalized), "
                             f"got {weight!r}.")

    def gram_keys(self) -> tuple[str, ...]:
        return ("gram_grad", "gram_normalized")

    def pursued_gram(self, layer: LayerStats) -> torch.Tensor:
        return trace_normalized(layer.gram_normalized) + self.loss_weight * trace_normalized(layer.gram_grad)


def loss_estimate(hessian: torch.Tensor, linear: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``dL(u) = -linear^T u + 1/2 u^T H u`` with ``u`` the experts left out, for each row of ``kept``."""
    kept = kept.bool()
    return -((~kept).to(torch.float64) @ linear.to(torch.float64)) + 0.5 * removed_energy(hessian, kept)


def loss_curves(layers: Sequence[LayerStats], selections: Sequence[object], num_tokens: int) -> list[np.ndarray]:
    """Per layer, the estimated per-token loss increase of keeping each count ``k = 0..N`` of ``selections``."""
    require_statistic(layers, "gram_loss", "A loss allocation")
    require_statistic(layers, "loss_first_order", "A loss allocation")
    return [(loss_estimate(layer.gram_loss, layer.loss_first_order, kept_masks(s, layer.num_experts))
             / max(num_tokens, 1)).cpu().numpy() for layer, s in zip(layers, selections)]


def _allocate_in_loss_units(problem: AllocationProblem, allocation: str) -> list[int]:
    """The exact minimum of the loss estimates, plus for ``loss_risk`` the routing risk scaled by the layer's
    whole-layer estimate ``max(dL_l(0), 0)``."""
    assert problem.budget is not None
    if problem.stats is None or problem.selections is None or problem.coverages is None:
        raise ValueError(f"Allocation {allocation!r} needs the statistics and selections (use ompmoe.plan_pruning).")
    costs = loss_curves(problem.stats.layers, problem.selections, problem.stats.num_tokens)
    if allocation == "loss_risk":
        zeta, weight = problem.zeta, problem.risk_weight
        risks = [-np.log(np.clip(c.to(torch.float64).cpu().numpy(), 0.0, None) + zeta) for c in problem.coverages]
        costs = [cost + weight * max(float(cost[0]), 0.0) * risk for cost, risk in zip(costs, risks)]
    return optimal_allocation(costs, problem.choices, problem.budget)


@register_allocation("loss", statistics=("loss_aware",))
def _loss(problem: AllocationProblem) -> list[int]:
    """the exact minimum (dynamic program) of the summed per-token loss estimates `sum_l dL_l(k_l)` under the kept-fraction bounds (loss-aware statistics)"""
    return _allocate_in_loss_units(problem, "loss")


@register_allocation("loss_risk", statistics=("loss_aware",))
def _loss_risk(problem: AllocationProblem) -> list[int]:
    """as `loss`, plus the routing risk `lambda dL_l(0) -log(C_l(k) + zeta)` (the paper's per-layer cost in loss units)"""
    return _allocate_in_loss_units(problem, "loss_risk")
