"""Pruning strategies: the pluggable decision step between statistics and a pruned model.

A strategy checks a ratio against a model's routing before calibration (``validate``) and
turns statistics into a :class:`PruningPlan` (``plan``). The Lightning callback and the CLI
only talk to this interface, so baselines plug in the same way as OMP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .plan import PruningPlan, plan_pruning, validate_budget
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

    def validate(self, routings: Sequence[tuple[str, dict[str, int]]]) -> None:
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
        )
