"""One-line summaries of a plan that cannot be misread: counts are always "kept x/y"."""

from __future__ import annotations

from .plan import PruningPlan


def kept_summary(plan: PruningPlan) -> str:
    """``kept 48/96 routed experts (removed 0.500); per layer kept: model.layers.0.mlp 6/16, ...``."""
    kept = sum(layer.num_kept for layer in plan.layers)
    total = sum(layer.num_experts for layer in plan.layers)
    per_layer = ", ".join(f"{layer.name} {layer.num_kept}/{layer.num_experts}" for layer in plan.layers)
    return f"kept {kept}/{total} routed experts (removed {plan.achieved_ratio:.3f}); per layer kept: {per_layer}"


__all__ = ["kept_summary"]
