"""One-line summaries of a plan that cannot be misread: counts are always "kept x/y"."""

from __future__ import annotations

from .plan import PruningPlan


def kept_summary(plan: PruningPlan) -> str:
    """``kept 48/96 routed experts (removed 0.500); per layer kept: model.layers.0.mlp 6/16, ...``."""
    kept = sum(layer.num_kept for layer in plan.layers)
    total = sum(layer.num_experts for layer in plan.layers)
    per_layer = ", ".join(f"{layer.name} {layer.num_kept}/{layer.num_experts}" for layer in plan.layers)
    return f"kept {kept}/{total} routed experts (removed {plan.achieved_ratio:.3f}); per layer kept: {per_layer}"


def settings_summary(plan: PruningPlan) -> str:
    """The settings a plan was made with, then the method's options: ``method omp, allocation waterfill,
    risk_weight 3, min_kept_fraction 0.375, max_kept_fraction 0.875, zeta 1e-06``."""
    options = plan.extra.get("method_options") or {}
    return ", ".join([
        f"method {plan.method}", f"allocation {plan.allocation}", f"risk_weight {plan.risk_weight:g}",
        f"min_kept_fraction {plan.min_kept_fraction:g}", f"max_kept_fraction {plan.max_kept_fraction:g}",
        f"zeta {plan.zeta:g}", *(f"{name} {value!r}" for name, value in options.items()),
    ])


__all__ = ["kept_summary", "settings_summary"]
