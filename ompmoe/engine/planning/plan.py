"""From statistics to a pruning plan: per-layer orderings, curves, allocation and kept experts."""

from __future__ import annotations

import json
import math
import numbers
import os
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from ..collect.input_kinds import check_input_kind
from ..collect.statistics import MoEStats
from ..io import atomic_path
from .allocation import (
    AllocationProblem,
    LayerChoices,
    allocation_cost,
    check_feasible,
    get_allocation,
    layer_choices,
    total_cost,
    uniform_allocation,
)
from .method_registry import SelectionMethod, SubsetSelection, get_method
from .selection import prefix_residual, routing_coverage


class PlanMismatchError(ValueError):
    """A pruning plan (or a saved pruning record) does not fit the model it is applied to."""


def real_number(name: str, value: Any) -> float:
    """``value`` as a finite float: Python/NumPy reals and 0-d tensors pass; str, bool, NaN and inf do not."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must be a real number; got a tensor of shape {tuple(value.shape)} "
                            f"({value.dtype}).")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number (e.g. 0.5); got {type(value).__name__} {value!r}.")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number; got {value}.")
    return value


def _plain(value: Any) -> Any:
    """JSON-safe copy: NumPy/torch scalars become Python numbers (so plans always save)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


@dataclass
class LayerPlan:
    """What one MoE layer keeps, and the curves the decision was made from."""

    name: str
    num_experts: int
    order: list[int]
    residual: list[float]
    coverage: list[float]
    kept: list[int]
    """Original expert ids kept, ascending (the router's new id ``i`` is ``kept[i]``)."""
    top_k: int = 0
    num_groups: int = 1

    @property
    def num_kept(self) -> int:
        return len(self.kept)


@dataclass
class PruningPlan:
    """A complete, serializable pruning decision for one model."""

    layers: list[LayerPlan]
    ratio: float
    method: str
    allocation: str
    risk_weight: float
    min_kept_fraction: float
    """Fewest experts a layer may keep, as a fraction of its experts (``waterfill``/``optimal``)."""
    max_kept_fraction: float
    """Most experts a layer may keep, as a fraction of its experts."""
    zeta: float
    fingerprint: str
    model_id: str | None = None
    num_tokens: int = 0
    cost: float = 0.0
    library_version: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def achieved_ratio(self) -> float:
        """Fraction of routed experts actually removed (group rounding may move it off ``ratio``)."""
        total = sum(layer.num_experts for layer in self.layers)
        return 1.0 - sum(layer.num_kept for layer in self.layers) / total

    @property
    def is_uniform(self) -> bool:
        return len({layer.num_kept for layer in self.layers}) == 1

    def kept_by_layer(self) -> dict[str, list[int]]:
        return {layer.name: layer.kept for layer in self.layers}

    def to_dict(self) -> dict[str, Any]:
        data = _plain(asdict(self))
        data["achieved_ratio"] = float(self.achieved_ratio)
        return data

    def save(self, path: str | os.PathLike, overwrite: bool = False) -> Path:
        with atomic_path(path, overwrite=overwrite) as tmp:
            tmp.write_text(json.dumps(self.to_dict(), indent=1))
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> PruningPlan:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"No plan file at {path}; create one with ompmoe.plan_pruning(...).save(path).")
        check_input_kind(path, "plan")  # statistics or results given as a plan
        fix = "Re-create it with ompmoe.plan_pruning(stats, ratio).save(path)."
        try:
            data = json.loads(path.read_text())
            data.pop("achieved_ratio", None)
            unknown = _drop_unknown(data, cls)
            unknown |= {key for layer in data["layers"] for key in _drop_unknown(layer, LayerPlan)}
            data["layers"] = [LayerPlan(**layer) for layer in data["layers"]]
            plan = cls(**data)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
            raise PlanMismatchError(
                f"{path} is not a valid ompmoe plan ({type(error).__name__}: {error}). {fix}"
            ) from None
        for layer in plan.layers:
            if problem := _layer_problem(layer):
                raise PlanMismatchError(f"{path}: layer {layer.name!r} {problem}. {fix}")
        if unknown:
            warnings.warn(f"{path} has keys this ompmoe does not know, ignored: {', '.join(sorted(unknown))} "
                          f"(written by ompmoe {plan.library_version or 'of another version'}).", stacklevel=2)
        return plan


def _drop_unknown(data: Any, cls: type) -> set[str]:
    """Remove from the dict ``data`` the keys that are no field of ``cls`` (a newer ompmoe's); return them."""
    if not isinstance(data, dict):
        return set()
    unknown = set(data) - {f.name for f in fields(cls)}
    for key in unknown:
        del data[key]
    return unknown


def _layer_problem(layer: LayerPlan) -> str | None:
    """What makes a loaded layer plan inconsistent (the curves have one value per count 0..N), or None."""
    count = layer.num_experts
    if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
        return f"has num_experts {count!r}"
    for name in ("residual", "coverage"):
        values = getattr(layer, name)
        if not isinstance(values, list) or len(values) != count + 1:
            found = len(values) if isinstance(values, list) else "no"
            return f"has {found} {name} values; it needs {count + 1} (k = 0..{count})"
        if not all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in values):
            return f"has a {name} value that is not a number"
    for name in ("order", "kept"):
        ids = getattr(layer, name)
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < count
                                                for i in ids):
            return f"has {name} ids outside 0..{count - 1}"
    return None


def validate_budget(routings: Sequence[tuple[str, dict[str, int]]], ratio: float, allocation: str = "waterfill",
                    min_kept_fraction: float = 0.375,
                    max_kept_fraction: float = 0.875) -> tuple[list[LayerChoices], int | None]:
    """Check a ratio against the layers' routing (``(name, MoELayer.routing or LayerStats.routing)``) before any
    expensive work: the feasible counts per layer and the kept-expert budget (``None`` for ``uniform``), or an
    :class:`InfeasibleBudgetError` naming the values that would work."""
    spec = get_allocation(allocation)
    if not 0.0 < min_kept_fraction <= max_kept_fraction <= 1.0:
        raise ValueError("Need 0 < min_kept_fraction <= max_kept_fraction <= 1; got "
                         f"min_kept_fraction={min_kept_fraction}, max_kept_fraction={max_kept_fraction}.")
    choices = [layer_choices(name, routing, min_kept_fraction, max_kept_fraction) for name, routing in routings]
    if not spec.bounded:
        uniform_allocation(routings, ratio)  # the same checks: ratio in [0, 1), every layer keeps its router's minimum
        return choices, None
    return choices, check_feasible(choices, ratio, min_kept_fraction, max_kept_fraction)


def check_plan_arguments(ratio: Any, risk_weight: Any = 3.0, zeta: Any = 1e-6, min_kept_fraction: Any = 0.375,
                         max_kept_fraction: Any = 0.875) -> tuple[float, float, float, float, float]:
    """Plain floats for the planning knobs, refused before any work if one would give a NaN plan (``zeta`` must be > 0:
    with ``zeta = 0`` keeping no expert costs ``-log 0 = inf``, and ``0 * inf`` is NaN)."""
    ratio = real_number("ratio", ratio)
    # The range [0, 1) is checked by validate_budget (InfeasibleBudgetError); 0 keeps every expert.
    risk_weight = real_number("risk_weight", risk_weight)
    if risk_weight < 0:
        raise ValueError(f"risk_weight={risk_weight} must be >= 0 (0 ignores routing risk; the paper uses 3).")
    zeta = real_number("zeta", zeta)
    if zeta <= 0:
        raise ValueError(f"zeta={zeta} must be > 0 (the stabilizer inside log(C(k) + zeta); the paper uses 1e-6).")
    min_kept_fraction = real_number("min_kept_fraction", min_kept_fraction)
    max_kept_fraction = real_number("max_kept_fraction", max_kept_fraction)
    return ratio, risk_weight, zeta, min_kept_fraction, max_kept_fraction


def plan_pruning(stats: MoEStats, ratio: float, method: str | SelectionMethod = "omp", allocation: str = "waterfill",
                 risk_weight: float = 3.0, min_kept_fraction: float = 0.375, max_kept_fraction: float = 0.875,
                 zeta: float = 1e-6, method_options: dict[str, Any] | None = None) -> PruningPlan:
    """Decide which experts every layer keeps so that a fraction ``ratio`` of routed experts is removed, with a method
    of :data:`ompmoe.METHODS` (or an instance; options recorded in ``plan.extra``) and an allocation of
    :data:`ompmoe.ALLOCATIONS` (the kept-fraction bounds apply to bounded ones)."""
    selection_method = get_method(method, method_options)
    ratio, risk_weight, zeta, min_kept_fraction, max_kept_fraction = check_plan_arguments(
        ratio, risk_weight, zeta, min_kept_fraction, max_kept_fraction)
    routings = [(layer.name, layer.routing) for layer in stats.layers]
    choices, budget = validate_budget(routings, ratio, allocation, min_kept_fraction, max_kept_fraction)
    selection_method.validate(routings)
    for layer in stats.layers:
        if layer.signal_energy <= 0.0:
            raise ValueError(f"Layer {layer.name} saw no routed tokens; calibrate on more text.")

    selections = selection_method.select(stats.layers)
    residuals, coverages = [], []
    for layer, s in zip(stats.layers, selections):
        subset = isinstance(s, SubsetSelection)
        residuals.append(s.residual(layer.gram) if subset else prefix_residual(layer.gram, s))
        coverages.append(s.coverage(layer.routing_mass) if subset else routing_coverage(layer.routing_mass, s))
    costs = [allocation_cost(r, c, risk_weight, zeta) for r, c in zip(residuals, coverages)]
    counts = get_allocation(allocation).allocate(
        AllocationProblem(routings, ratio, costs, choices, budget, stats, selections, coverages, risk_weight, zeta))

    # A per-count selection lists its kept set first, so ``kept == sorted(order[:count])`` always.
    orders = [s.order_at(k) if isinstance(s, SubsetSelection) else s for s, k in zip(selections, counts)]
    layers = [LayerPlan(name=layer.name, num_experts=layer.num_experts, order=order.tolist(),
                        residual=residual.tolist(), coverage=coverage.tolist(), kept=sorted(order[:count].tolist()),
                        top_k=layer.top_k, num_groups=layer.num_groups)
              for layer, order, residual, coverage, count in zip(stats.layers, orders, residuals, coverages, counts)]
    options = selection_method.options()
    return PruningPlan(
        layers=layers, ratio=ratio, method=selection_method.name, allocation=allocation, risk_weight=risk_weight,
        min_kept_fraction=min_kept_fraction, max_kept_fraction=max_kept_fraction, zeta=zeta,
        fingerprint=stats.fingerprint, model_id=stats.model_id, num_tokens=stats.num_tokens,
        cost=total_cost(costs, counts), library_version=stats.library_version,
        extra={"method_options": options} if options else {})
