"""plan_pruning on statistics from tiny models: orderings, curves, allocations, serialization, errors."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest
import torch

from ompmoe import InfeasibleBudgetError, OutputExistsError, PruningPlan, collect_stats, plan_pruning
from ompmoe.engine.planning.allocation import allocation_cost, layer_choices, total_cost
from ompmoe.engine.methods import METHODS
from ompmoe.engine.planning.selection import greedy_pursuit, prefix_residual, routing_coverage
from ompmoe.engine.collect.statistics import LayerStats, MoEStats
from ompmoe.engine.tiny import tiny_model

ALLOCATIONS = ("uniform", "waterfill", "optimal")


def _stats(model_type: str, seed: int = 0, **overrides) -> MoEStats:
    model = tiny_model(model_type, seed=seed, **overrides)
    generator = torch.Generator().manual_seed(seed)
    batches = [torch.randint(3, 256, (2, 24), generator=generator) for _ in range(2)]
    return collect_stats(model, batches, model_id=f"tiny-{model_type}")


@pytest.fixture(scope="module")
def qwen_stats() -> MoEStats:
    # Four decoder layers, the first dense: three MoE layers of 16 experts, top-4.
    return _stats("qwen3_moe", num_hidden_layers=4)


GROUPED = {
    "deepseek_v3": dict(num_hidden_layers=4),
    "glm4_moe": dict(num_hidden_layers=4),
    "deepseek_v2": dict(num_hidden_layers=4, topk_method="group_limited_greedy"),
}


@pytest.fixture(scope="module", params=sorted(GROUPED))
def grouped_stats(request) -> MoEStats:
    return _stats(request.param, **GROUPED[request.param])


def _check_plan(plan: PruningPlan, stats: MoEStats, ratio: float) -> None:
    assert len(plan.layers) == len(stats.layers)
    total = sum(layer.num_experts for layer in stats.layers)
    for layer, source in zip(plan.layers, stats.layers):
        n = source.num_experts
        assert (layer.name, layer.num_experts, layer.top_k, layer.num_groups) == (
            source.name, n, source.top_k, source.num_groups
        )
        assert sorted(layer.order) == list(range(n))
        assert layer.kept == sorted(layer.order[: layer.num_kept])
        assert source.top_k <= layer.num_kept <= n
        assert len(layer.residual) == n + 1 and len(layer.coverage) == n + 1
        assert layer.residual[0] == 1.0
        assert layer.residual[-1] == pytest.approx(0.0, abs=1e-9)
        assert layer.coverage[0] == 0.0
        assert layer.coverage[-1] == pytest.approx(1.0, abs=1e-12)
        assert all(b >= a - 1e-15 for a, b in zip(layer.coverage, layer.coverage[1:]))
    step = max(layer.num_groups for layer in plan.layers)
    # Rounding to whole experts (and whole groups): per layer for uniform, once for the global budget.
    slack = len(plan.layers) * step / 2 if plan.allocation == "uniform" else step / 2 + 0.5
    assert abs(plan.achieved_ratio - ratio) <= slack / total + 1e-12
    assert plan.fingerprint == stats.fingerprint and plan.num_tokens == stats.num_tokens
    assert plan.model_id == stats.model_id


def _recomputed_cost(plan: PruningPlan) -> float:
    return sum(
        layer.residual[layer.num_kept] - plan.risk_weight * math.log(layer.coverage[layer.num_kept] + plan.zeta)
        for layer in plan.layers
    )


# ------------------------------------------------------------------------ plain routers


@pytest.mark.parametrize("allocation", ALLOCATIONS)
@pytest.mark.parametrize("ratio", [0.25, 0.4, 0.5])
def test_plan_structure(qwen_stats, allocation, ratio):
    plan = plan_pruning(qwen_stats, ratio, allocation=allocation)
    _check_plan(plan, qwen_stats, ratio)
    assert (plan.ratio, plan.allocation, plan.method) == (ratio, allocation, "omp")
    assert plan.cost == pytest.approx(_recomputed_cost(plan), abs=1e-12)
    total = sum(layer.num_experts for layer in plan.layers)
    if allocation == "uniform":
        assert plan.is_uniform
        assert all(layer.num_kept == round((1 - ratio) * layer.num_experts) for layer in plan.layers)
    else:
        assert sum(layer.num_kept for layer in plan.layers) == round((1 - ratio) * total)
        for layer in plan.layers:
            assert math.ceil(plan.min_kept_fraction * layer.num_experts) <= layer.num_kept
            assert layer.num_kept <= math.floor(plan.max_kept_fraction * layer.num_experts)


def test_plan_curves_come_from_the_statistics(qwen_stats):
    plan = plan_pruning(qwen_stats, 0.5)
    for layer, source in zip(plan.layers, qwen_stats.layers):
        order = torch.tensor(layer.order)
        assert torch.equal(order, greedy_pursuit(source.gram).order)
        torch.testing.assert_close(torch.tensor(layer.residual, dtype=torch.float64), prefix_residual(source.gram, order))
        torch.testing.assert_close(
            torch.tensor(layer.coverage, dtype=torch.float64), routing_coverage(source.routing_mass, order)
        )
        # r(k) is the energy of the experts left out, relative to the whole routed output.
        gram = source.gram.to(torch.float64)
        for k in (0, 3, layer.num_kept, source.num_experts - 1):
            left_out = order[k:]
            expected = float(gram[left_out][:, left_out].sum() / gram.sum())
            assert layer.residual[k] == pytest.approx(expected, rel=1e-9, abs=1e-12)
        mass = source.routing_mass.to(torch.float64)
        assert layer.coverage[layer.num_kept] == pytest.approx(float(mass[layer.kept].sum() / mass.sum()), rel=1e-12)


@pytest.mark.parametrize("risk_weight", [0.0, 0.5, 3.0, 30.0])
@pytest.mark.parametrize("ratio", [0.25, 0.375, 0.5, 0.6])
def test_optimal_plan_is_never_worse_than_waterfill(qwen_stats, risk_weight, ratio):
    greedy = plan_pruning(qwen_stats, ratio, allocation="waterfill", risk_weight=risk_weight)
    exact = plan_pruning(qwen_stats, ratio, allocation="optimal", risk_weight=risk_weight)
    uniform = plan_pruning(qwen_stats, ratio, allocation="uniform", risk_weight=risk_weight)
    assert exact.cost <= greedy.cost + 1e-12
    if sum(layer.num_kept for layer in uniform.layers) == sum(layer.num_kept for layer in exact.layers):
        assert exact.cost <= uniform.cost + 1e-12  # the uniform counts are then one feasible allocation
    assert [layer.order for layer in exact.layers] == [layer.order for layer in greedy.layers]


def test_optimal_plan_matches_brute_force(qwen_stats):
    ratio, risk_weight = 0.5, 3.0
    plan = plan_pruning(qwen_stats, ratio, allocation="optimal", risk_weight=risk_weight)
    costs = [
        allocation_cost(torch.tensor(layer.residual, dtype=torch.float64), torch.tensor(layer.coverage, dtype=torch.float64), risk_weight, plan.zeta)
        for layer in plan.layers
    ]
    choices = [layer_choices(s.name, s.routing, plan.min_kept_fraction, plan.max_kept_fraction) for s in qwen_stats.layers]
    budget = round((1 - ratio) * sum(s.num_experts for s in qwen_stats.layers))
    best = min(
        total_cost(costs, counts)
        for counts in itertools.product(*[c.counts() for c in choices])
        if sum(counts) == budget
    )
    assert plan.cost == pytest.approx(best, abs=1e-12)


def test_risk_weight_zero_minimises_the_residual(qwen_stats):
    """lambda = 0 picks the counts of least total residual; a huge lambda those of greatest coverage."""
    ratio = 0.5
    choices = [layer_choices(s.name, s.routing, 0.375, 0.875) for s in qwen_stats.layers]
    budget = round((1 - ratio) * sum(s.num_experts for s in qwen_stats.layers))
    feasible = [k for k in itertools.product(*[c.counts() for c in choices]) if sum(k) == budget]
    no_risk = plan_pruning(qwen_stats, ratio, allocation="optimal", risk_weight=0.0)
    risky = plan_pruning(qwen_stats, ratio, allocation="optimal", risk_weight=1e6)

    def residual(plan, counts):
        return sum(layer.residual[k] for layer, k in zip(plan.layers, counts))

    def log_coverage(plan, counts):
        return sum(math.log(layer.coverage[k] + plan.zeta) for layer, k in zip(plan.layers, counts))

    chosen = [layer.num_kept for layer in no_risk.layers]
    assert residual(no_risk, chosen) == pytest.approx(min(residual(no_risk, k) for k in feasible), abs=1e-12)
    chosen_risky = [layer.num_kept for layer in risky.layers]
    assert log_coverage(risky, chosen_risky) >= max(log_coverage(risky, k) for k in feasible) - 3e-6
    assert residual(no_risk, chosen) <= residual(no_risk, chosen_risky)
    assert log_coverage(risky, chosen_risky) >= log_coverage(risky, chosen) - 3e-6


def test_ratio_zero_keeps_everything_when_allowed(qwen_stats):
    for allocation in ALLOCATIONS:
        plan = plan_pruning(qwen_stats, 0.0, allocation=allocation, max_kept_fraction=1.0)
        assert plan.achieved_ratio == 0.0
        assert all(layer.kept == list(range(layer.num_experts)) for layer in plan.layers)
    with pytest.raises(InfeasibleBudgetError, match=r"raise max_kept_fraction to 1\.000 or more to prune less"):
        plan_pruning(qwen_stats, 0.0)


def test_plan_does_not_modify_statistics(qwen_stats):
    before = [{k: v.clone() for k, v in layer.tensors().items()} for layer in qwen_stats.layers]
    plan_pruning(qwen_stats, 0.5, allocation="optimal")
    for saved, layer in zip(before, qwen_stats.layers):
        for key, value in layer.tensors().items():
            assert torch.equal(saved[key], value)


# ----------------------------------------------------------------------- grouped routers


@pytest.mark.parametrize("allocation", ALLOCATIONS)
@pytest.mark.parametrize("ratio", [0.25, 0.375, 0.5])
def test_grouped_routers_keep_equal_counts_per_group(grouped_stats, allocation, ratio):
    assert all(layer.num_groups > 1 for layer in grouped_stats.layers)
    plan = plan_pruning(grouped_stats, ratio, allocation=allocation)
    _check_plan(plan, grouped_stats, ratio)
    for layer, source in zip(plan.layers, grouped_stats.layers):
        groups, size = source.num_groups, source.num_experts // source.num_groups
        per_group = np.bincount(np.array(layer.kept) // size, minlength=groups)
        assert len(set(per_group.tolist())) == 1, (layer.name, per_group)
        kept_per_group = int(per_group[0])
        assert kept_per_group * source.topk_group >= source.top_k
        assert kept_per_group >= source.group_score_topk
        # every prefix of the ordering of whole-group length is balanced too
        for k in range(groups, source.num_experts + 1, groups):
            assert len(set(np.bincount(np.array(layer.order[:k]) // size, minlength=groups).tolist())) == 1
    assert sum(layer.num_kept for layer in plan.layers) % plan.layers[0].num_groups == 0


def test_grouped_optimal_beats_waterfill(grouped_stats):
    for ratio in (0.25, 0.375, 0.5):
        greedy = plan_pruning(grouped_stats, ratio, allocation="waterfill")
        exact = plan_pruning(grouped_stats, ratio, allocation="optimal")
        assert exact.cost <= greedy.cost + 1e-12
        assert exact.cost == pytest.approx(_recomputed_cost(exact), abs=1e-12)


# ----------------------------------------------------------------------- serialization


@pytest.mark.parametrize("allocation", ALLOCATIONS)
def test_save_load_round_trip(qwen_stats, tmp_path, allocation):
    plan = plan_pruning(qwen_stats, 0.5, allocation=allocation)
    plan.extra["note"] = "calibrated on random ids"
    path = plan.save(tmp_path / "plans" / "plan.json")
    assert path == tmp_path / "plans" / "plan.json"
    loaded = PruningPlan.load(path)
    assert loaded == plan
    assert loaded.achieved_ratio == plan.achieved_ratio
    data = json.loads(path.read_text())
    assert data["achieved_ratio"] == plan.achieved_ratio
    assert data["allocation"] == allocation and data["ratio"] == 0.5
    assert isinstance(data["layers"], list) and len(data["layers"]) == len(plan.layers)
    for entry, layer in zip(data["layers"], plan.layers):
        assert {"name", "num_experts", "order", "residual", "coverage", "kept"} <= set(entry)
        assert entry["kept"] == layer.kept and entry["order"] == layer.order
    assert [p.name for p in path.parent.iterdir()] == ["plan.json"]  # no temporary leftovers


def test_save_refuses_to_overwrite(qwen_stats, tmp_path):
    path = tmp_path / "plan.json"
    first = plan_pruning(qwen_stats, 0.5)
    first.save(path)
    second = plan_pruning(qwen_stats, 0.25)
    with pytest.raises(OutputExistsError, match="overwrite=True"):
        second.save(path)
    assert PruningPlan.load(path) == first
    second.save(path, overwrite=True)
    assert PruningPlan.load(path) == second
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_grouped_plan_round_trip(grouped_stats, tmp_path):
    plan = plan_pruning(grouped_stats, 0.375, allocation="optimal")
    assert PruningPlan.load(plan.save(tmp_path / "plan.json")) == plan


# ------------------------------------------------------------------------------ errors


def test_unknown_method_and_allocation(qwen_stats):
    with pytest.raises(ValueError) as info:
        plan_pruning(qwen_stats, 0.5, method="no_such_method")
    assert "omp" in METHODS
    assert str(info.value) == f"Unknown method 'no_such_method'; choose one of {sorted(METHODS)} or register one with ompmoe.register_method."
    with pytest.raises(ValueError) as info:
        plan_pruning(qwen_stats, 0.5, allocation="greedy")
    assert str(info.value) == (
        "Unknown allocation 'greedy'; choose one of ['uniform', 'waterfill', 'optimal', 'loss', 'loss_risk'] or "
        "register one with "
        "ompmoe.register_allocation."
    )


@pytest.mark.parametrize("bounds", [(0.0, 0.5), (0.6, 0.5), (0.375, 1.2)])
def test_bad_ratio_bounds(qwen_stats, bounds):
    with pytest.raises(ValueError, match="Need 0 < min_kept_fraction <= max_kept_fraction <= 1"):
        plan_pruning(qwen_stats, 0.5, min_kept_fraction=bounds[0], max_kept_fraction=bounds[1])


@pytest.mark.parametrize("allocation", ALLOCATIONS)
@pytest.mark.parametrize("ratio", [1.0, 1.2, -0.1])
def test_ratio_outside_unit_interval(qwen_stats, allocation, ratio):
    with pytest.raises(InfeasibleBudgetError, match=r"outside \[0, 1\)"):
        plan_pruning(qwen_stats, ratio, allocation=allocation)


def test_infeasible_ratio_names_the_working_interval(qwen_stats):
    # Three layers of 16 experts: between 3 * 6 and 3 * 14 experts may be kept.
    with pytest.raises(InfeasibleBudgetError) as info:
        plan_pruning(qwen_stats, 0.9)
    assert str(info.value) == (
        "ratio=0.9 keeps 5 of 48 experts, but min_kept_fraction=0.375, max_kept_fraction=0.875 and the routers' top-k allow "
        "keeping 18 to 42: use a ratio in [0.1250, 0.6250]; the routers need at least 12 experts (top-k), so no "
        "min_kept_fraction allows a ratio above 0.7500."  # top-4 of 16 in each of 3 layers: the bounds cannot help
    )
    with pytest.raises(InfeasibleBudgetError) as info:
        plan_pruning(qwen_stats, 0.8, allocation="uniform")
    assert str(info.value) == (
        "Uniform ratio=0.8 keeps 3 of 16 experts in layer model.layers.1.mlp, but its router needs at least 4 "
        "(top_k=4); use a ratio of at most 0.7500."
    )


def test_layer_without_tokens_is_refused(qwen_stats):
    empty = qwen_stats.layers[1]
    zeros = {key: torch.zeros_like(value) for key, value in empty.tensors().items()}
    layers = list(qwen_stats.layers)
    layers[1] = LayerStats(name=empty.name, **empty.routing, **zeros)
    stats = dataclasses.replace(qwen_stats, layers=layers)
    for allocation in ALLOCATIONS:
        with pytest.raises(ValueError, match=r"Layer model\.layers\.2\.mlp saw no routed tokens"):
            plan_pruning(stats, 0.5, allocation=allocation)
