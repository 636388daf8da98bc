"""Pruning strategies: the decision step between statistics and a pruned model. The callback and the CLI only talk to
the :class:`Strategy` protocol; :class:`PruningStrategy` covers every registered method and allocation."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..adapters import ARCHITECTURES, spec_for_model_type
from ..collect.statistics import MoEStats
from .method_registry import METHODS, default_allocation, get_method
from .plan import PruningPlan, check_plan_arguments, plan_pruning, validate_budget


@runtime_checkable
class Strategy(Protocol):
    """What the callback and CLI need from a strategy (implement it to plug in your own decision)."""

    def validate(self, routings: Sequence[tuple[str, dict[str, int]]]) -> None:
        """Raise before any expensive work if the strategy cannot be applied to these layers."""

    def plan(self, stats: MoEStats) -> PruningPlan:
        """Decide which experts each layer keeps."""


AUTO = "auto"
"""``method`` value: the settings of the model's layout (``ArchitectureSpec.auto``), chosen among by
:mod:`ompmoe.engine.apply.plan_choice` (without held-out blocks, the first). ``allocation`` value: the same beside ``method
auto``; beside a method named outright, that method's own (``SelectionMethod.default_allocation``: REAP's
``uniform``, the paper's ``waterfill``), so a named method runs as published wherever it is named."""


def auto_settings(model_type: str | None) -> tuple[tuple[str, str], ...]:
    """``(method, allocation)`` settings ``auto`` tries for ``model_type``, the one it takes without held-out blocks
    first."""
    spec = spec_for_model_type(model_type)
    if spec is None:
        raise ValueError(
            f"method/allocation 'auto' picks the setting recommended for the model's architecture, but the "
            f"statistics name {'no architecture' if model_type is None else f'model_type {model_type!r}'}; name "
            f"them instead, e.g. method='omp_normalized', allocation='loss' "
            f"(supported: {', '.join(sorted(ARCHITECTURES))}).")
    return spec.auto


def recommended_setting(model_type: str | None) -> tuple[str, str]:
    """The ``(method, allocation)`` ``auto`` takes for ``model_type`` when it cannot try its settings."""
    return auto_settings(model_type)[0]


@dataclass
class PruningStrategy:
    """Remove a fraction of routed experts with a registered method and allocation.

    Args:
        ratio: Fraction of routed experts removed over all MoE layers (0.5 removes half).
        method: A method of :data:`ompmoe.METHODS` (``omp`` is the paper's), or ``auto``: the setting measured best
            for the model's layout (where several, the one with the lowest held-out calibration loss; :meth:`plan`
            alone, with no model to try plans on, takes the first).
        allocation: An allocation of :data:`ompmoe.ALLOCATIONS` (``waterfill`` is the paper's), or ``auto``: with
            ``method="auto"`` tried with it; with a method named outright, that method's own (REAP's ``uniform``,
            ``waterfill`` for the rest).
        risk_weight: Lambda of the routing-risk term ``-log(C(k) + zeta)``.
        min_kept_fraction: Fewest experts a layer may keep, as a fraction of its experts.
        max_kept_fraction: Most experts a layer may keep, as a fraction of its experts.
        zeta: Stabilizer inside the routing-risk logarithm.
        method_options: Options of the method, e.g. ``{"seed": 3}`` for ``random``.
    """

    ratio: float = 0.5
    method: str = "omp"
    allocation: str = "waterfill"
    risk_weight: float = 3.0
    min_kept_fraction: float = 0.375
    max_kept_fraction: float = 0.875
    zeta: float = 1e-6
    method_options: dict[str, Any] = field(default_factory=dict)

    def resolved(self, model_type: str | None) -> PruningStrategy:
        """This strategy with ``auto`` replaced by the setting recommended for ``model_type`` (else itself)."""
        if AUTO not in (self.method, self.allocation):
            return self
        method, allocation = self.settings(model_type)[0]
        return dataclasses.replace(self, method=method, allocation=allocation)

    def settings(self, model_type: str | None) -> list[tuple[str, str]]:
        """The ``(method, allocation)`` settings tried for ``model_type``: with ``method="auto"``, each of
        :func:`auto_settings` with a named allocation kept, duplicates dropped; else ``[(method, allocation)]``, an
        ``auto`` allocation being the method's own."""
        if self.method != AUTO:
            return [(self.method, default_allocation(self.method) if self.allocation == AUTO else self.allocation)]
        filled = [(method, allocation if self.allocation == AUTO else self.allocation)
                  for method, allocation in auto_settings(model_type)]
        return list(dict.fromkeys(filled))

    def candidates(self, stats: MoEStats) -> list[PruningPlan]:
        """One plan per setting of :meth:`settings`, from the same statistics (:func:`~ompmoe.choose_plan` picks)."""
        return [dataclasses.replace(self, method=method, allocation=allocation).plan(stats)
                for method, allocation in self.settings(stats.model_type)]

    def validate(self, routings: Sequence[tuple[str, dict[str, int]]]) -> None:
        """Refuse bad arguments and infeasible budgets (an ``auto`` method is checked once resolved)."""
        check_plan_arguments(self.ratio, self.risk_weight, self.zeta, self.min_kept_fraction, self.max_kept_fraction)
        if self.method != AUTO:
            allocation = self.settings(None)[0][1]
        else:  # every recommendation is bounded
            allocation = "waterfill" if self.allocation == AUTO else self.allocation
        validate_budget(routings, self.ratio, allocation, self.min_kept_fraction, self.max_kept_fraction)
        if self.method != AUTO:
            get_method(self.method, self.method_options).validate(routings)

    def plan(self, stats: MoEStats) -> PruningPlan:
        if AUTO in (self.method, self.allocation):
            return self.resolved(stats.model_type).plan(stats)
        return plan_pruning(stats, self.ratio, method=self.method, allocation=self.allocation,
                            risk_weight=self.risk_weight, min_kept_fraction=self.min_kept_fraction,
                            max_kept_fraction=self.max_kept_fraction, zeta=self.zeta,
                            method_options=self.method_options or None)


def tries_candidates(strategy: Strategy, model_type: str | None) -> bool:
    """Whether ``strategy`` is ``auto`` with several settings to try for ``model_type`` (a user's own class: no)."""
    return (AUTO in (getattr(strategy, "method", None), getattr(strategy, "allocation", None))
            and callable(getattr(strategy, "settings", None))
            and len(strategy.settings(model_type)) > 1)  # type: ignore[attr-defined]


def strategy_for(method: str, **kwargs: Any) -> PruningStrategy:
    """``PruningStrategy(method=method, ...)``; method options may be passed directly (``seed=3``)."""
    cls = METHODS.get(method) if isinstance(method, str) else None
    option_names = {f.name for f in dataclasses.fields(cls)} if cls is not None else set()
    options = dict(kwargs.pop("method_options", None) or {})
    options.update({key: kwargs.pop(key) for key in list(kwargs) if key in option_names})
    get_method(method, options)  # unknown method or option: a clear error now
    return PruningStrategy(method=method, method_options=options, **kwargs)
