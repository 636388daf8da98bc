"""Pruning strategies: the pluggable decision step between statistics and a pruned model.

A strategy checks a ratio against a model's routing before calibration (``validate``) and
turns statistics into a :class:`PruningPlan` (``plan``). The Lightning callback and the CLI
only talk to this interface, so baselines plug in the same way as OMP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .baselines import EXACT_MAX_SUBSETS, check_exact_size
from .plan import PruningPlan, check_plan_arguments, plan_pruning, validate_budget
from .statistics import MoEStats


@runtime_checkable
class PruningStrategy(Protocol):
    def validate(self, routings: Sequence[tuple[str, dict[str, int]]]) -> None:
        """Raise before any expensive work if the strategy cannot be applied to these layers."""

    def plan(self, stats: MoEStats) -> PruningPlan:
        """Decide which experts each layer keeps."""


@dataclass
class OMPStrategy:
    """OMP-MoE: greedy binary pursuit per layer, risk-aware allocation across layers.

    Args:
        ratio: Fraction of routed experts removed over all MoE layers (0.5 removes half).
        allocation: ``uniform``, ``waterfill`` (the paper's greedy) or ``optimal``.
        risk_weight: Lambda of the routing-risk term ``-log(C(k) + zeta)``.
        min_ratio: Fewest experts a layer may keep, as a fraction of its experts.
        max_ratio: Most experts a layer may keep, as a fraction of its experts.
        zeta: Stabilizer inside the routing-risk logarithm.
    """

    ratio: float = 0.5
    allocation: str = "waterfill"
    risk_weight: float = 3.0
    min_ratio: float = 0.375
    max_ratio: float = 0.875
    zeta: float = 1e-6

    method = "omp"
    """Name in :data:`ompmoe.engine.plan.METHODS`; the baseline strategies below only change this."""

    def method_options(self) -> dict[str, Any]:
        """Extra arguments of the method (recorded in ``plan.extra``)."""
        return {}

    def validate(self, routings: Sequence[tuple[str, dict[str, int]]]) -> None:
        check_plan_arguments(self.ratio, self.risk_weight, self.zeta, self.min_ratio, self.max_ratio)
        validate_budget(routings, self.ratio, self.allocation, self.min_ratio, self.max_ratio)

    def plan(self, stats: MoEStats) -> PruningPlan:
        return plan_pruning(
            stats,
            self.ratio,
            method=self.method,
            allocation=self.allocation,
            risk_weight=self.risk_weight,
            min_ratio=self.min_ratio,
            max_ratio=self.max_ratio,
            zeta=self.zeta,
            method_options=self.method_options() or None,
        )


# Baselines (ompmoe.engine.baselines): the same fields, statistics and allocations as OMPStrategy.
@dataclass
class FrequencyStrategy(OMPStrategy):
    """Baseline: keep the experts routed the most calibration tokens (fields as :class:`OMPStrategy`)."""

    method = "frequency"


@dataclass
class RoutingMassStrategy(OMPStrategy):
    """Baseline: keep the experts with the largest summed router weight ``sum_x g_e(x)``."""

    method = "routing_mass"


@dataclass
class EANStrategy(OMPStrategy):
    """Baseline EAN: keep the experts with the largest ``sum_x ||F_e(x)||`` over routed tokens."""

    method = "ean"


@dataclass
class REAPStrategy(OMPStrategy):
    """Baseline REAP: keep the experts with the largest mean ``g_e(x) ||F_e(x)||`` over routed tokens."""

    method = "reap"


@dataclass
class RandomStrategy(OMPStrategy):
    """Baseline: a seeded random ranking (``seed`` makes it reproducible)."""

    seed: int = 0

    method = "random"

    def method_options(self) -> dict[str, Any]:
        return {"seed": self.seed}


@dataclass
class StaticEnergyStrategy(OMPStrategy):
    """Baseline: rank by ``||V_e||^2`` once (OMP without residual updates)."""

    method = "static_energy"


@dataclass
class ExactStrategy(OMPStrategy):
    """The exact optimum of the reconstruction objective at every count, by enumerating all
    ``2^N`` subsets of each layer; refused (before calibration) above ``max_subsets``."""

    max_subsets: int = EXACT_MAX_SUBSETS

    method = "exact"

    def method_options(self) -> dict[str, Any]:
        return {"max_subsets": self.max_subsets}

    def validate(self, routings: Sequence[tuple[str, dict[str, int]]]) -> None:
        super().validate(routings)
        for name, routing in routings:
            check_exact_size(name, routing["num_experts"], self.max_subsets)


@dataclass
class OMPSwapStrategy(OMPStrategy):
    """OMP followed by 1-swap local search on the same objective (never worse than OMP)."""

    method = "omp_swap"


@dataclass
class TokenNormalizedOMPStrategy(OMPStrategy):
    """OMP on the token-normalized Gram: every token's routed output weighs the same."""

    method = "omp_normalized"


STRATEGIES: dict[str, type[OMPStrategy]] = {
    cls.method: cls
    for cls in (
        OMPStrategy, FrequencyStrategy, RoutingMassStrategy, EANStrategy, REAPStrategy, RandomStrategy,
        StaticEnergyStrategy, ExactStrategy, OMPSwapStrategy, TokenNormalizedOMPStrategy,
    )
}
"""Strategy class per method name of :data:`ompmoe.engine.plan.METHODS`."""


def strategy_for(method: str, **kwargs: Any) -> OMPStrategy:
    """The strategy of ``method`` (a key of :data:`STRATEGIES`) with ``kwargs`` as its fields."""
    if method not in STRATEGIES:
        raise ValueError(f"Unknown method {method!r}; choose one of {sorted(STRATEGIES)}.")
    return STRATEGIES[method](**kwargs)
