"""Selection and allocation in loss units, from the loss-aware sums of :mod:`ompmoe.loss_stats`.

Removing the experts ``U`` of a layer (indicator ``u``) changes the calibration loss by about

    dL(u) = -s^T u + 1/2 u^T H u,    s = loss_first_order,  H = gram_loss (or another loss Gram),

in nats summed over the calibration tokens; divided by the token count it is a per-token loss
increase. Unlike the paper's normalized residual ``r_l(k)`` these estimates are in the same
units in every layer, so they add up across layers without normalization, and the budget goes
where the summed estimate is smallest (exact dynamic program under the usual per-layer bounds).

Methods (keys of :data:`LOSS_METHODS`, usable as ``plan_pruning(method=...)``):

- ``omp_loss``: greedy pursuit on ``gram_loss`` (the paper's Algorithm 1 in the loss metric),
- ``omp_grad``: greedy pursuit on ``gram_grad`` (per-token weight ``||d_x||^2``),
- ``omp_fisher``: greedy pursuit on ``gram_fisher`` (per-token diagonal Fisher),
- ``loss_newton``: greedy minimization of ``dL(u)`` with the first-order term.

Allocations (keys of :data:`LOSS_ALLOCATIONS`): ``loss`` (DP over ``sum_l dL_l(k_l) / T``) and
``loss_risk``: the paper's per-layer cost ``r_l(k) + lambda * -log(C_l(k) + zeta)`` measured in loss
units, i.e. ``dL_l(k) + lambda * dL_l(0) * -log(C_l(k) + zeta)`` (``dL_l(0)``, the estimate for
removing the whole layer, plays the role of ``||Y_l||^2``, so each layer weighs by its loss scale).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .selection import greedy_pursuit
from .statistics import LayerStats

LOSS_ALLOCATIONS = ("loss", "loss_risk")


def require_loss_tensors(layers: Sequence[LayerStats], key: str, what: str) -> None:
    """Refuse statistics without the loss-aware sum ``key``, naming the option that collects it."""
    missing = [layer.name for layer in layers if getattr(layer, key) is None]
    if missing:
        raise ValueError(
            f"{what} needs loss-aware statistics ({key!r}), which these statistics lack (layers "
            f"{missing[:3]}{'...' if len(missing) > 3 else ''}). Collect them with "
            "ompmoe.collect_stats(model, batches, loss_aware=True) or OMPMoEPruning(..., loss_aware=True)."
        )


def greedy_quadratic(hessian: torch.Tensor, linear: torch.Tensor, num_groups: int = 1) -> torch.Tensor:
    """Order experts by greedily keeping the one that lowers ``q(u) = -linear^T u + 1/2 u^T H u`` most.

    ``u`` starts at all ones (every expert removed); keeping ``e`` lowers ``q`` by
    ``(H u)_e - H_ee / 2 - linear_e``. With ``linear = 0`` and ``H = 2 G`` this is the greedy
    binary pursuit on ``G``. Group-limited routers (``num_groups > 1``) pick in rounds of one
    expert per group, like :func:`~ompmoe.selection.greedy_pursuit`. Ties go to the lowest id.
    """
    h = hessian.to(torch.float64)
    b = linear.to(torch.float64)
    n = h.shape[0]
    if n % num_groups:
        raise ValueError(f"{n} experts cannot be split into {num_groups} equal groups.")
    group_size = n // num_groups
    hu = h.sum(dim=1)
    half_diagonal = 0.5 * h.diagonal()
    taken = torch.zeros(n, dtype=torch.bool)
    blocked = taken
    order = []
    for step in range(n):
        if num_groups > 1 and step % num_groups == 0:
            blocked = taken.clone()
        drop = (hu - half_diagonal - b).masked_fill(blocked, float("-inf"))
        chosen = int(drop.argmax())  # first maximum: ties go to the lowest id
        order.append(chosen)
        hu = hu - h[:, chosen]
        taken[chosen] = True
        if num_groups > 1:
            blocked[(chosen // group_size) * group_size : (chosen // group_size + 1) * group_size] = True
    return torch.tensor(order, dtype=torch.long)


def _pursuit_on(key: str, method: str):
    def orderings(layers: Sequence[LayerStats]) -> list[torch.Tensor]:
        require_loss_tensors(layers, key, f"Method {method!r}")
        return [greedy_pursuit(getattr(layer, key), num_groups=layer.num_groups, with_gains=False).order for layer in layers]

    orderings.__name__ = f"{method}_orderings"
    orderings.__doc__ = f"Greedy binary pursuit on each layer's ``{key}`` (see :mod:`ompmoe.loss_aware`)."
    return orderings


omp_loss_orderings = _pursuit_on("gram_loss", "omp_loss")
omp_grad_orderings = _pursuit_on("gram_grad", "omp_grad")
omp_fisher_orderings = _pursuit_on("gram_fisher", "omp_fisher")


def loss_newton_orderings(layers: Sequence[LayerStats]) -> list[torch.Tensor]:
    """Greedy minimization of the second-order loss estimate with its first-order term, per layer."""
    require_loss_tensors(layers, "gram_loss", "Method 'loss_newton'")
    require_loss_tensors(layers, "loss_first_order", "Method 'loss_newton'")
    return [greedy_quadratic(layer.gram_loss, layer.loss_first_order, layer.num_groups) for layer in layers]


LOSS_METHODS = {
    "omp_loss": omp_loss_orderings,
    "omp_grad": omp_grad_orderings,
    "omp_fisher": omp_fisher_orderings,
    "loss_newton": loss_newton_orderings,
}
"""Loss-aware expert-selection methods by name (registered in :data:`ompmoe.plan.METHODS`)."""


def kept_masks(selection: torch.Tensor | object, num_experts: int) -> torch.Tensor:
    """``(N + 1, N)`` bool: the experts kept at each count, from an ordering or a ``SubsetSelection``."""
    if isinstance(selection, torch.Tensor):
        ranks = torch.empty(num_experts, dtype=torch.long)
        ranks[selection] = torch.arange(num_experts)
        return ranks.unsqueeze(0) < torch.arange(num_experts + 1).unsqueeze(1)
    return selection.kept.bool()  # SubsetSelection


def loss_estimate(hessian: torch.Tensor, linear: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``dL(u) = -linear^T u + 1/2 u^T H u`` with ``u`` the experts left out, for each row of ``kept``."""
    u = (~kept.bool()).to(torch.float64)
    h = hessian.to(torch.float64)
    return -(u @ linear.to(torch.float64)) + 0.5 * ((u @ h) * u).sum(-1)


def loss_curves(layers: Sequence[LayerStats], selections: Sequence[object], num_tokens: int) -> list[np.ndarray]:
    """Per layer, the estimated per-token loss increase of keeping each count ``k = 0..N`` of ``selections``."""
    require_loss_tensors(layers, "gram_loss", "A loss allocation")
    require_loss_tensors(layers, "loss_first_order", "A loss allocation")
    return [
        (loss_estimate(layer.gram_loss, layer.loss_first_order, kept_masks(s, layer.num_experts)) / max(num_tokens, 1))
        .cpu()
        .numpy()
        for layer, s in zip(layers, selections)
    ]


def loss_allocation_costs(
    layers: Sequence[LayerStats],
    selections: Sequence[object],
    coverages: Sequence[torch.Tensor],
    num_tokens: int,
    allocation: str,
    risk_weight: float,
    zeta: float,
) -> list[np.ndarray]:
    """Cost curves of a loss allocation: the loss estimate, plus for ``loss_risk`` the routing risk
    scaled by the layer's whole-layer estimate ``max(dL_l(0), 0)``.

    The allocation itself is the exact dynamic program of
    :func:`~ompmoe.allocation.optimal_allocation` over these curves.
    """
    if allocation not in LOSS_ALLOCATIONS:
        raise ValueError(f"Unknown loss allocation {allocation!r}; choose one of {list(LOSS_ALLOCATIONS)}.")
    curves = loss_curves(layers, selections, num_tokens)
    if allocation == "loss":
        return curves
    risks = [-np.log(np.clip(c.to(torch.float64).cpu().numpy(), 0.0, None) + zeta) for c in coverages]
    return [curve + risk_weight * max(float(curve[0]), 0.0) * risk for curve, risk in zip(curves, risks)]
