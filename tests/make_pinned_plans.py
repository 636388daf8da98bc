"""Write ``tests/data/pinned_plans.json``: plans made by the engine as it was before the redesign (issue 10).

``tests/test_pinned_plans.py`` recomputes every plan from the same seeded statistics and requires
the same kept experts and orderings, and curves and cost to 1e-6 relative. Run this script only to re-pin
deliberately (and say why in the commit).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ompmoe import collect_stats, plan_pruning
from ompmoe.engine.tiny import tiny_model

PINNED = Path(__file__).parent / "data" / "pinned_plans.json"
CASES = {  # name -> (model_type, overrides)
    "qwen3_moe": ("qwen3_moe", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v2_grouped": ("deepseek_v2", {"topk_method": "group_limited_greedy"}),
    "gpt_oss": ("gpt_oss", {}),
}
METHODS = {  # method -> options
    "omp": {}, "frequency": {}, "routing_mass": {}, "ean": {}, "reap": {}, "random": {"seed": 3},
    "static_energy": {}, "omp_swap": {}, "omp_normalized": {}, "exact": {},
}
ALLOCATIONS = ("uniform", "waterfill", "optimal")
RATIO = 0.5


def pinned_stats(case: str):
    """Statistics of the seeded tiny model of ``case`` on seeded token ids (equal to float32 rounding on every CPU)."""
    model_type, overrides = CASES[case]
    model = tiny_model(model_type, seed=0, **overrides)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, 256, (2, 24), generator=generator) for _ in range(3)]
    return collect_stats(model, batches)


def plan_record(stats, method: str, allocation: str) -> dict:
    plan = plan_pruning(stats, RATIO, method=method, allocation=allocation, method_options=METHODS[method] or None)
    return {
        "cost": plan.cost,
        "layers": [
            {"name": layer.name, "kept": layer.kept, "order": layer.order, "residual": layer.residual,
             "coverage": layer.coverage}
            for layer in plan.layers
        ],
    }


def main() -> None:
    torch.set_num_threads(1)
    pinned = {}
    for case in CASES:
        stats = pinned_stats(case)
        for method in METHODS:
            for allocation in ALLOCATIONS:
                pinned[f"{case}/{method}/{allocation}"] = plan_record(stats, method, allocation)
    PINNED.parent.mkdir(exist_ok=True)
    PINNED.write_text(json.dumps(pinned, indent=0, sort_keys=True) + "\n")
    print(f"{len(pinned)} plans -> {PINNED}")


if __name__ == "__main__":
    main()
