"""Pruning strategies: the decision step between statistics and a pruned model, as one object.

A strategy checks a ratio against a model's routing before calibration (``validate``) and turns
statistics into a :class:`PruningPlan` (``plan``). The Lightning callback and the CLI only talk
to the :class:`Strategy` protocol. :class:`PruningStrategy` covers every registered method and
allocation (``PruningStrategy(ratio=0.5, method="reap", allocation="optimal")``), so a new method
needs no strategy class of its own.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from .methods import METHODS, get_method
from .plan import PruningPlan, check_plan_arguments, plan_pruning, renamed_bounds, validate_budget
from .statistics import MoEStats


@runtime_checkable
class Strategy(Protocol):
    """What the callback and CLI need from a strategy (implement it to plug in your own decision)."""

    def validate(self, routings: Sequence[tuple[str, dict[str, int]]]) -> None:
        """Raise before any expensive work if the strategy cannot be applied to these layers."""

    def plan(self, stats: MoEStats) -> PruningPlan:
        """Decide which experts each layer keeps."""


@dataclass
class PruningStrategy:
    """Remove a fraction of routed experts with a registered method and allocation.

    Args:
        ratio: Fraction of routed experts removed over all MoE layers (0.5 removes half).
        method: A method of :data:`ompmoe.METHODS` (``omp`` is the paper's greedy pursuit).
        allocation: An allocation of :data:`ompmoe.ALLOCATIONS`: ``uniform``, ``waterfill`` (the
            paper's greedy) or ``optimal``.
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

    def validate(self, routings: Sequence[tuple[str, dict[str, int]]]) -> None:
        method = get_method(self.method, self.method_options)
        check_plan_arguments(self.ratio, self.risk_weight, self.zeta, self.min_kept_fraction, self.max_kept_fraction)
        validate_budget(routings, self.ratio, self.allocation, self.min_kept_fraction, self.max_kept_fraction)
        method.validate(routings)

    def plan(self, stats: MoEStats) -> PruningPlan:
        return plan_pruning(
            stats,
            self.ratio,
            method=self.method,
            allocation=self.allocation,
            risk_weight=self.risk_weight,
            min_kept_fraction=self.min_kept_fraction,
            max_kept_fraction=self.max_kept_fraction,
            zeta=self.zeta,
            method_options=self.method_options or None,
        )


def strategy_for(method: str, **kwargs: Any) -> PruningStrategy:
    """``PruningStrategy(method=method, ...)``; method options may be passed directly (``seed=3``)."""
    cls = METHODS.get(method) if isinstance(method, str) else None
    option_names = {f.name for f in dataclasses.fields(cls)} if cls is not None else set()
    options = dict(kwargs.pop("method_options", None) or {})
    options.update({key: kwargs.pop(key) for key in list(kwargs) if key in option_names})
    get_method(method, options)  # unknown method or option: a clear error now
    return PruningStrategy(method=method, method_options=options, **_renamed(kwargs))


def _renamed(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Map deprecated ``min_ratio``/``max_ratio`` keyword arguments to the kept-fraction names."""
    if "min_ratio" in kwargs or "max_ratio" in kwargs:
        low, high = renamed_bounds(
            kwargs.pop("min_kept_fraction", 0.375), kwargs.pop("max_kept_fraction", 0.875),
            kwargs.pop("min_ratio", None), kwargs.pop("max_ratio", None),
        )
        kwargs.update(min_kept_fraction=low, max_kept_fraction=high)
    return kwargs


# ------------------------------------------------------------------ deprecated strategy classes
class _DeprecatedStrategy(PruningStrategy):
    """``XStrategy(ratio=..., min_ratio=..., seed=...)`` of earlier versions: a PruningStrategy of one method."""

    fixed_method: ClassVar[str] = "omp"
    option_fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, ratio: float = 0.5, allocation: str = "waterfill", risk_weight: float = 3.0,
                 min_ratio: float | None = None, max_ratio: float | None = None, zeta: float = 1e-6,
                 min_kept_fraction: float = 0.375, max_kept_fraction: float = 0.875, method: str | None = None,
                 method_options: dict[str, Any] | None = None, **options: Any) -> None:
        warnings.warn(
            f"{type(self).__name__} is deprecated: use ompmoe.PruningStrategy(method={self.fixed_method!r}, ...)"
            + (f" with method_options={{{', '.join(repr(k) + ': ...' for k in self.option_fields)}}}" if self.option_fields else "")
            + ".",
            DeprecationWarning,
            stacklevel=2,
        )
        if method not in (None, self.fixed_method):
            raise TypeError(f"{type(self).__name__} always uses method {self.fixed_method!r}; got method={method!r}.")
        options = {**(method_options or {}), **options}  # dataclasses.replace passes method_options back
        unknown = sorted(set(options) - set(self.option_fields))
        if unknown:
            raise TypeError(f"{type(self).__name__} got unexpected argument(s) {unknown}.")
        low, high = renamed_bounds(min_kept_fraction, max_kept_fraction, min_ratio, max_ratio)
        super().__init__(ratio=ratio, method=self.fixed_method, allocation=allocation, risk_weight=risk_weight,
                         min_kept_fraction=low, max_kept_fraction=high, zeta=zeta, method_options=options)


def _deprecated(class_name: str, method: str, *options: str) -> type[PruningStrategy]:
    return type(class_name, (_DeprecatedStrategy,), {
        "fixed_method": method, "option_fields": options,
        "__doc__": f"Deprecated: ``PruningStrategy(method={method!r}, ...)``.", "__module__": __name__,
    })


OMPStrategy = _deprecated("OMPStrategy", "omp")
FrequencyStrategy = _deprecated("FrequencyStrategy", "frequency")
RoutingMassStrategy = _deprecated("RoutingMassStrategy", "routing_mass")
EANStrategy = _deprecated("EANStrategy", "ean")
REAPStrategy = _deprecated("REAPStrategy", "reap")
RandomStrategy = _deprecated("RandomStrategy", "random", "seed")
StaticEnergyStrategy = _deprecated("StaticEnergyStrategy", "static_energy")
ExactStrategy = _deprecated("ExactStrategy", "exact", "max_subsets")
OMPSwapStrategy = _deprecated("OMPSwapStrategy", "omp_swap")
TokenNormalizedOMPStrategy = _deprecated("TokenNormalizedOMPStrategy", "omp_normalized")

STRATEGIES: dict[str, type[PruningStrategy]] = {
    cls.fixed_method: cls
    for cls in (OMPStrategy, FrequencyStrategy, RoutingMassStrategy, EANStrategy, REAPStrategy, RandomStrategy,
                StaticEnergyStrategy, ExactStrategy, OMPSwapStrategy, TokenNormalizedOMPStrategy)
}
"""Deprecated: the strategy class per built-in method (use ``PruningStrategy(method=...)``)."""
