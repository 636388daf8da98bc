"""One-line summaries of a plan that cannot be misread: counts are always "kept x/y"."""

from __future__ import annotations

from collections.abc import Mapping

from .apply.plan_choice import PlanChoice
from .planning.method_registry import default_allocation
from .planning.plan import PruningPlan
from .planning.strategy import AUTO, Strategy


def kept_summary(plan: PruningPlan) -> str:
    """``kept 48/96 routed experts (removed 0.500); per layer kept: model.layers.0.mlp 6/16, ...``."""
    kept = sum(layer.num_kept for layer in plan.layers)
    total = sum(layer.num_experts for layer in plan.layers)
    per_layer = ", ".join(f"{layer.name} {layer.num_kept}/{layer.num_experts}" for layer in plan.layers)
    return f"kept {kept}/{total} routed experts (removed {plan.achieved_ratio:.3f}); per layer kept: {per_layer}"


def settings_summary(plan: PruningPlan, compensation: str | None = None, sources: Mapping[str, str] | None = None
                     ) -> str:
    """The settings a plan was made with (and ``compensation``, the run's), then the method's options: ``method omp,
    allocation waterfill, compensation off, risk_weight 3, min_kept_fraction 0.375, max_kept_fraction 0.875, zeta
    1e-06``; ``sources``: where a setting came from, said after it (``allocation uniform (reap's own)``)."""
    options = plan.extra.get("method_options") or {}
    sources = sources or {}

    def setting(name: str, value: str) -> str:
        return f"{name} {value}" + (f" ({sources[name]})" if name in sources else "")

    return ", ".join([
        setting("method", plan.method), setting("allocation", plan.allocation),
        *([setting("compensation", compensation)] if compensation is not None else []),
        f"risk_weight {plan.risk_weight:g}",
        f"min_kept_fraction {plan.min_kept_fraction:g}", f"max_kept_fraction {plan.max_kept_fraction:g}",
        f"zeta {plan.zeta:g}", *(f"{name} {value!r}" for name, value in options.items()),
    ])


def auto_note(strategy: Strategy, model_type: str | None, choice: PlanChoice | None = None) -> str:
    """What ``auto`` did, for the settings line (``""`` when the strategy's method is not ``auto``: an ``auto``
    allocation beside a named method is that method's own, said by :func:`named_method_sources`)."""
    auto = [name for name in ("method", "allocation") if getattr(strategy, name, None) == AUTO]
    if getattr(strategy, "method", None) != AUTO:
        return ""
    why = choice.summary() if choice is not None else f"recommended for {model_type}, docs/quality/intervals.md"
    return f" ({' and '.join(auto)} 'auto': {why})"


def own_allocation_note(method: str, allocation: str) -> str | None:
    """``"reap's own is uniform"`` when a named ``method`` runs with an ``allocation`` other than the one its authors
    publish it with, so a comparison run from a config that names another allocation says it is not the published
    method; ``None`` when it is (or the method is unknown: refused later, by name)."""
    if method in (None, AUTO) or allocation in (None, AUTO):
        return None
    try:
        own = default_allocation(method)
    except ValueError:  # method_class's "not registered", "cannot be imported", "unknown method"
        return None
    return f"{method}'s own is {own}" if own != allocation else None


def named_method_sources(strategy: Strategy, compensation_mode: str | None) -> dict[str, str]:
    """Where a named method's allocation and compensation came from when the options left them to it (``auto``): its
    own allocation, and none of the compensation ``auto`` gives the ``auto`` method; an allocation given that is not
    the method's own says so (:func:`own_allocation_note`)."""
    method = getattr(strategy, "method", None)
    if method in (None, AUTO):
        return {}
    allocation = getattr(strategy, "allocation", None)
    note = own_allocation_note(method, allocation)
    sources = ({"allocation": f"{method}'s own"} if allocation == AUTO else
               {"allocation": f"as given; {note}"} if note else {})
    if compensation_mode == AUTO:
        sources["compensation"] = "none for a named method"
    return sources


def plan_metrics(plan: PruningPlan) -> dict[str, float]:
    """What a run logs about its plan: achieved ratio, cost, and per layer the kept count, residual and coverage."""
    metrics: dict[str, float] = {"ompmoe/achieved_ratio": plan.achieved_ratio, "ompmoe/cost": plan.cost}
    for layer in plan.layers:
        metrics[f"ompmoe/{layer.name}/kept"] = float(layer.num_kept)
        metrics[f"ompmoe/{layer.name}/residual"] = float(layer.residual[layer.num_kept])
        metrics[f"ompmoe/{layer.name}/coverage"] = float(layer.coverage[layer.num_kept])
    return metrics


__all__ = ["auto_note", "kept_summary", "named_method_sources", "own_allocation_note", "plan_metrics", "settings_summary"]
