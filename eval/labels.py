"""Row labels of evaluation results from the model's recorded pruning plan and adaptive epsilon,
so two pruned versions of one model never share the label "model"."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


def model_label(info: Mapping[str, Any]) -> str:
    """``base (method, allocation, -50% experts, OMP-MoE+ ε=0.1)`` from a results file's ``ompmoe.model``."""
    plan, pruning, adaptive = (info.get(key) if isinstance(info.get(key), Mapping) else {}
                               for key in ("plan", "pruning", "adaptive"))
    name = str(plan.get("model_id") or info.get("base_model") or info.get("model") or "model")
    base = os.path.basename(name.rstrip("/")) or name
    parts = [str(plan[key]) for key in ("method", "allocation") if pruning and plan.get(key)]
    if pruning and isinstance(pruning.get("removed_fraction"), (int, float)):
        parts.append(f"-{pruning['removed_fraction']:.0%} experts")
    if isinstance(adaptive.get("epsilon"), (int, float)):
        parts.append(f"OMP-MoE+ ε={adaptive['epsilon']:g}")
    return f"{base} ({', '.join(parts)})" if parts else base
