"""Cross-layer budget allocation: how many experts each layer keeps, from the cost curves
``F_l(k) = r_l(k) + lambda * -log(C_l(k) + zeta)`` and the feasible counts of every layer. Allocations live in one
registry (:data:`ALLOCATIONS`, :func:`register_allocation`) read by ``plan_pruning``, strategies, callback and CLI."""

from __future__ import annotations

import heapq
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..names import did_you_mean
from ..registry import Registry


class InfeasibleBudgetError(ValueError):
    """The requested pruning ratio cannot be met under the per-layer constraints."""


@dataclass(frozen=True)
class LayerChoices:
    """Feasible kept-expert counts ``low, low + step, ..., high`` of one layer."""

    name: str
    num_experts: int
    low: int
    high: int
    step: int
    floor: int = 0
    """Fewest experts the router works with (top-k; whole groups on group-limited routers), whatever the bounds."""

    def counts(self) -> range:
        return range(self.low, self.high + 1, self.step)


def allocation_cost(residual: torch.Tensor, coverage: torch.Tensor, risk_weight: float, zeta: float) -> np.ndarray:
    """``F(k)`` for ``k = 0..N`` from the residual and routing-coverage curves."""
    r = residual.to(torch.float64).cpu().numpy()
    c = coverage.to(torch.float64).cpu().numpy()
    return r + risk_weight * -np.log(np.clip(c, 0.0, None) + zeta)


def minimum_kept(num_experts: int, top_k: int, num_groups: int, topk_group: int, group_score_topk: int) -> int:
    """Fewest experts a layer can keep while its native router still works."""
    if num_groups == 1:
        return top_k
    per_group = max(math.ceil(top_k / topk_group), group_score_topk, 1)
    return per_group * num_groups


def _lowest(num_experts: int, step: int, floor: int, min_kept_fraction: float) -> int:
    return step * math.ceil(max(math.ceil(min_kept_fraction * num_experts - 1e-9), floor) / step)


def _highest(num_experts: int, step: int, max_kept_fraction: float) -> int:
    return step * math.floor(min(math.floor(max_kept_fraction * num_experts + 1e-9), num_experts) / step)


def layer_choices(name: str, routing: dict[str, int], min_kept_fraction: float,
                  max_kept_fraction: float) -> LayerChoices:
    """Feasible counts of one layer; ``low > high`` means the bounds leave nothing feasible."""
    n, step, floor = routing["num_experts"], routing["num_groups"], minimum_kept(**routing)
    return LayerChoices(name=name, num_experts=n, low=_lowest(n, step, floor, min_kept_fraction),
                        high=_highest(n, step, max_kept_fraction), step=step, floor=step * math.ceil(floor / step))


def target_kept(num_experts: Sequence[int], ratio: float) -> int:
    """Total experts kept when a fraction ``ratio`` of all routed experts is removed."""
    if not 0.0 <= ratio < 1.0:
        raise InfeasibleBudgetError(f"ratio={ratio} is outside [0, 1): it is the fraction of routed experts removed "
                                    "(0.5 removes half).")
    return round((1.0 - ratio) * sum(num_experts))


def check_feasible(choices: Sequence[LayerChoices], ratio: float, min_kept_fraction: float,
                   max_kept_fraction: float) -> int:
    """Return the kept-expert budget or explain which ratios and bounds would work."""
    total = sum(c.num_experts for c in choices)
    for c in choices:
        if c.low > c.high:
            raise InfeasibleBudgetError(f"Layer {c.name} ({c.num_experts} experts) has no feasible kept count "
                                        f"between min_kept_fraction={min_kept_fraction} and max_kept_fraction="
                                        f"{max_kept_fraction} that its router accepts (needs at least {c.low} "
                                        f"experts in multiples of {c.step}); raise max_kept_fraction to at least "
                                        f"{c.low / c.num_experts:.3f}.")
    step = math.gcd(*[c.step for c in choices])
    budget = step * round(target_kept([c.num_experts for c in choices], ratio) / step)
    low, high = sum(c.low for c in choices), sum(c.high for c in choices)
    if not low <= budget <= high:
        lo_ratio, hi_ratio = 1.0 - high / total, 1.0 - low / total
        hint = _prune_more_hint(choices, budget, total) if budget < low else _prune_less_hint(choices, budget)
        raise InfeasibleBudgetError(f"ratio={ratio} keeps {budget} of {total} experts, but min_kept_fraction="
                                    f"{min_kept_fraction}, max_kept_fraction={max_kept_fraction} and the routers' "
                                    f"top-k allow keeping {low} to {high}: use a ratio in [{lo_ratio:.4f}, "
                                    f"{hi_ratio:.4f}]{hint}.")
    return budget


def _prune_more_hint(choices: Sequence[LayerChoices], budget: int, total: int) -> str:
    """What would let ``budget`` experts be kept: a lower min_kept_fraction, unless the routers themselves forbid it."""
    floors = sum(c.floor for c in choices)
    if budget < floors:
        limit = "top-k and group balance" if any(c.step > 1 for c in choices) else "top-k"
        return (f"; the routers need at least {floors} experts ({limit}), so no min_kept_fraction allows a ratio above "
                f"{1.0 - floors / total:.4f}")
    for thousandths in range(999, -1, -1):  # the largest bound that fits, to three decimals
        fraction = thousandths / 1000
        if sum(_lowest(c.num_experts, c.step, c.floor, fraction) for c in choices) <= budget:
            return f" or lower min_kept_fraction to {fraction:.3f} or less to prune more"
    return " or lower min_kept_fraction to prune more"


def _prune_less_hint(choices: Sequence[LayerChoices], budget: int) -> str:
    """The smallest max_kept_fraction (three decimals) under which ``budget`` experts can be kept."""
    for thousandths in range(0, 1001):
        fraction = thousandths / 1000
        if sum(_highest(c.num_experts, c.step, fraction) for c in choices) >= budget:
            return f" or raise max_kept_fraction to {fraction:.3f} or more to prune less"
    return " or raise max_kept_fraction to prune less"


def uniform_allocation(routings: Sequence[tuple[str, dict[str, int]]], ratio: float) -> list[int]:
    """Keep the same fraction ``1 - ratio`` of every layer (rounded to whole router groups)."""
    target_kept([routing["num_experts"] for _, routing in routings], ratio)  # rejects ratios outside [0, 1)
    counts = []
    for name, routing in routings:
        n, step, floor = routing["num_experts"], routing["num_groups"], minimum_kept(**routing)
        keep = step * round((1.0 - ratio) * n / step)
        if keep < floor:
            raise InfeasibleBudgetError(f"Uniform ratio={ratio} keeps {keep} of {n} experts in layer {name}, but its "
                                        f"router needs at least {floor} (top_k={routing['top_k']}); use a ratio of "
                                        f"at most {1.0 - floor / n:.4f}.")
        counts.append(keep)
    return counts


def waterfill_allocation(costs: Sequence[np.ndarray], choices: Sequence[LayerChoices], budget: int) -> list[int]:
    """The paper's discrete water-filling: from every layer's lowest count, give one more expert (one per group)
    to the layer whose cost drops most per expert until the budget is spent."""
    counts = [c.low for c in choices]
    remaining = budget - sum(counts)
    heap: list[tuple[float, int]] = []

    def push(layer: int) -> None:
        c, k = choices[layer], counts[layer]
        if k + c.step <= c.high:
            drop = (costs[layer][k] - costs[layer][k + c.step]) / c.step
            heapq.heappush(heap, (-drop, layer))

    for layer in range(len(choices)):
        push(layer)
    while remaining > 0 and heap:
        _, layer = heapq.heappop(heap)
        if choices[layer].step > remaining:
            continue
        counts[layer] += choices[layer].step
        remaining -= choices[layer].step
        push(layer)
    if remaining:
        raise InfeasibleBudgetError(f"Water-filling could not place {remaining} experts; budget {budget}.")
    return counts


def optimal_allocation(costs: Sequence[np.ndarray], choices: Sequence[LayerChoices], budget: int) -> list[int]:
    """Exact minimum of ``sum_l F_l(k_l)`` with ``sum_l k_l = budget`` by dynamic programming."""
    extra = budget - sum(c.low for c in choices)
    if extra < 0:
        raise InfeasibleBudgetError(f"No allocation reaches exactly {budget} kept experts.")
    best = np.full(extra + 1, np.inf)
    best[0] = 0.0
    picks = []
    for cost, c in zip(costs, choices):
        new = np.full(extra + 1, np.inf)
        pick = np.zeros(extra + 1, dtype=np.int64)
        for offset in range(0, min(c.high - c.low, extra) + 1, c.step):
            candidate = best[: extra + 1 - offset] + cost[c.low + offset]
            better = candidate < new[offset:]
            new[offset:][better] = candidate[better]
            pick[offset:][better] = offset
        best = new
        picks.append(pick)
    if not np.isfinite(best[extra]):
        raise InfeasibleBudgetError(f"No allocation reaches exactly {budget} kept experts.")
    counts, left = [], extra
    for c, pick in zip(reversed(choices), reversed(picks)):
        counts.append(c.low + int(pick[left]))
        left -= int(pick[left])
    return counts[::-1]


def total_cost(costs: Sequence[np.ndarray], counts: Sequence[int]) -> float:
    return float(sum(cost[k] for cost, k in zip(costs, counts)))


@dataclass(frozen=True)
class AllocationProblem:
    """What an allocation chooses from: one entry per MoE layer, in model order."""

    routings: Sequence[tuple[str, dict[str, int]]]
    """``(layer name, routing facts)`` (:attr:`ompmoe.MoELayer.routing`)."""
    ratio: float
    """Fraction of all routed experts to remove."""
    costs: Sequence[np.ndarray]
    """``F_l(k)``, ``k = 0..N_l``: residual plus weighted routing risk of the method's choice at each count."""
    choices: Sequence[LayerChoices]
    """Feasible counts per layer under the kept-fraction bounds and the routers' minimum."""
    budget: int | None
    """Total kept experts (``None`` for allocations that ignore the bounds, such as ``uniform``)."""
    stats: Any = None
    """The :class:`~ompmoe.MoEStats` planned from (allocations in other units, e.g. ``loss``, read them)."""
    selections: Sequence[Any] | None = None
    """The method's selection per layer (ordering or kept set per count)."""
    coverages: Sequence[torch.Tensor] | None = None
    """Routing coverage ``C_l(k)`` of each layer's selection."""
    risk_weight: float = 3.0
    zeta: float = 1e-6


@dataclass(frozen=True)
class Allocation:
    """A registered allocation: ``allocate(problem)`` returns the kept count of every layer."""

    name: str
    allocate: Callable[[AllocationProblem], list[int]]
    bounded: bool = True
    """Whether the per-layer kept-fraction bounds and the global budget apply (``uniform``: no)."""
    statistics: tuple[str, ...] = ()
    """Optional statistics it needs (names of :data:`ompmoe.engine.collect.extensions.STATISTICS`)."""

    @property
    def summary(self) -> str:
        return inspect.cleandoc(self.allocate.__doc__ or "").split("\n", 1)[0].rstrip(".")


ALLOCATIONS: Registry[Allocation] = Registry()
"""Registered allocations by name (the built-ins of :mod:`ompmoe.engine.methods` load on the first read)."""


def register_allocation(
    name: str, *, bounded: bool = True, statistics: tuple[str, ...] = ()
) -> Callable[[Callable[[AllocationProblem], list[int]]], Callable[[AllocationProblem], list[int]]]:
    """Decorator: register ``allocate(problem) -> counts`` under ``name`` (the options: see :class:`Allocation`)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"Allocation names must be identifier-like; got {name!r}.")

    def decorate(allocate: Callable[[AllocationProblem], list[int]]) -> Callable[[AllocationProblem], list[int]]:
        existing = ALLOCATIONS.registered(name)
        if existing is not None and existing.allocate.__qualname__ != allocate.__qualname__:
            raise ValueError(f"An allocation named {name!r} is already registered ({existing.allocate.__qualname__}).")
        ALLOCATIONS[name] = Allocation(name, allocate, bounded, tuple(statistics))
        return allocate

    return decorate


def get_allocation(name: str) -> Allocation:
    """The registered allocation ``name``, or an error listing the registered names."""
    if not isinstance(name, str) or name not in ALLOCATIONS:
        raise ValueError(f"Unknown allocation {name!r}{did_you_mean(name, ALLOCATIONS)}; choose one of "
                         f"{list(ALLOCATIONS)} or register one with ompmoe.register_allocation.")
    return ALLOCATIONS[name]


@register_allocation("uniform", bounded=False)
def _uniform(problem: AllocationProblem) -> list[int]:
    """the same fraction `1 - ratio` kept in every layer (rounded to whole router groups)"""
    return uniform_allocation(problem.routings, problem.ratio)


@register_allocation("waterfill")
def _waterfill(problem: AllocationProblem) -> list[int]:
    """the paper's greedy water-filling of `F_l(k)` under the kept-fraction bounds"""
    assert problem.budget is not None
    return waterfill_allocation(problem.costs, problem.choices, problem.budget)


@register_allocation("optimal")
def _optimal(problem: AllocationProblem) -> list[int]:
    """the exact minimum of `sum_l F_l(k_l)` under the same bounds, by dynamic programming (never worse than `waterfill`)"""
    assert problem.budget is not None
    return optimal_allocation(problem.costs, problem.choices, problem.budget)
