"""Cross-layer budget allocation: exactness of the DP, the paper's greedy, budgets and errors."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from ompmoe.engine.planning.allocation import (
    InfeasibleBudgetError,
    LayerChoices,
    allocation_cost,
    check_feasible,
    layer_choices,
    minimum_kept,
    optimal_allocation,
    target_kept,
    total_cost,
    uniform_allocation,
    waterfill_allocation,
)


def routing(num_experts: int, top_k: int, num_groups: int = 1, topk_group: int = 1, group_score_topk: int = 1) -> dict:
    return {
        "num_experts": num_experts,
        "top_k": top_k,
        "num_groups": num_groups,
        "topk_group": topk_group if num_groups > 1 else 1,
        "group_score_topk": group_score_topk if num_groups > 1 else 1,
    }


def brute_force(costs, choices, budget):
    """Every feasible count vector, cheapest first: ``(cost, counts)`` or ``None`` when none exists."""
    best = None
    for counts in itertools.product(*[c.counts() for c in choices]):
        if sum(counts) != budget:
            continue
        cost = total_cost(costs, counts)
        if best is None or cost < best[0]:
            best = (cost, list(counts))
    return best


def paper_waterfill(costs, lows, highs, budget):
    """Literal water-filling of the paper: start at the lows, add one expert at a time to the layer
    whose cost drops most (ties to the first layer)."""
    counts = list(lows)
    for _ in range(budget - sum(counts)):
        drops = [
            costs[layer][k] - costs[layer][k + 1] if k < highs[layer] else -math.inf
            for layer, k in enumerate(counts)
        ]
        counts[int(np.argmax(drops))] += 1
    return counts


def random_problem(rng: np.random.Generator, num_layers: int, same_step: bool = False, max_experts: int = 12):
    """Random non-convex costs and random bounds/steps; returns a feasible budget too."""
    step_all = int(rng.choice([1, 2, 4]))
    choices, costs = [], []
    for layer in range(num_layers):
        step = step_all if same_step else int(rng.choice([1, 2, 4]))
        groups = int(rng.integers(1, max_experts // step + 1))
        n = step * groups
        low = step * int(rng.integers(0, groups + 1))
        high = step * int(rng.integers(low // step, groups + 1))
        choices.append(LayerChoices(name=f"l{layer}", num_experts=n, low=low, high=high, step=step))
        costs.append(rng.normal(size=n + 1) * rng.uniform(0.1, 3.0))
    feasible = [int(rng.choice(list(c.counts()))) for c in choices]
    return costs, choices, sum(feasible)


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("seed", range(60))
def test_optimal_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    costs, choices, budget = random_problem(rng, num_layers=int(rng.integers(3, 5)))
    expected = brute_force(costs, choices, budget)
    counts = optimal_allocation(costs, choices, budget)
    assert sum(counts) == budget
    for k, c in zip(counts, choices):
        assert k in c.counts()
    assert total_cost(costs, counts) == pytest.approx(expected[0], abs=1e-12)
    assert counts == expected[1]  # continuous random costs: the minimiser is unique


def test_optimal_equals_brute_force_at_every_budget():
    rng = np.random.default_rng(123)
    costs, choices, _ = random_problem(rng, num_layers=4)
    lows, highs = sum(c.low for c in choices), sum(c.high for c in choices)
    for budget in range(lows, highs + 1):
        expected = brute_force(costs, choices, budget)
        if expected is None:
            with pytest.raises(InfeasibleBudgetError, match=f"No allocation reaches exactly {budget} kept experts"):
                optimal_allocation(costs, choices, budget)
            continue
        counts = optimal_allocation(costs, choices, budget)
        assert total_cost(costs, counts) == pytest.approx(expected[0], abs=1e-12)


def test_unreachable_budget_raises():
    choices = [LayerChoices("a", 8, 0, 8, 4), LayerChoices("b", 8, 0, 8, 4)]
    costs = [np.zeros(9), np.zeros(9)]
    with pytest.raises(InfeasibleBudgetError, match="No allocation reaches exactly 6 kept experts"):
        optimal_allocation(costs, choices, 6)
    with pytest.raises(InfeasibleBudgetError, match="could not place 2 experts"):
        waterfill_allocation(costs, choices, 6)


def test_budget_below_the_lows_raises():
    choices = [LayerChoices("a", 8, 4, 8, 1), LayerChoices("b", 8, 4, 8, 1)]
    costs = [np.zeros(9), np.zeros(9)]
    with pytest.raises(InfeasibleBudgetError):
        optimal_allocation(costs, choices, 7)
    with pytest.raises(InfeasibleBudgetError):
        waterfill_allocation(costs, choices, 7)


def test_optimal_never_worse_than_waterfill():
    rng = np.random.default_rng(7)
    strictly_better = 0
    for _ in range(400):
        costs, choices, budget = random_problem(rng, num_layers=int(rng.integers(2, 9)), same_step=True, max_experts=16)
        greedy = waterfill_allocation(costs, choices, budget)
        exact = optimal_allocation(costs, choices, budget)
        for counts in (greedy, exact):
            assert sum(counts) == budget
            assert all(k in c.counts() for k, c in zip(counts, choices))
        greedy_cost, exact_cost = total_cost(costs, greedy), total_cost(costs, exact)
        assert exact_cost <= greedy_cost + 1e-12
        strictly_better += exact_cost < greedy_cost - 1e-9
    # The random costs are non-convex, so the greedy really is suboptimal on some of them.
    assert strictly_better > 20


def test_optimal_never_worse_than_waterfill_on_pursuit_like_curves():
    """Residual-plus-risk costs (decreasing, mostly convex, with kinks), 48 layers of 128 experts."""
    rng = np.random.default_rng(3)
    for trial in range(5):
        costs, choices = [], []
        for layer in range(48):
            gains = np.sort(rng.gamma(0.5, size=128))[::-1] * rng.uniform(0.5, 2.0, size=128)
            residual = torch.tensor(np.concatenate([[1.0], 1.0 - np.cumsum(gains) / gains.sum()]))
            mass = rng.dirichlet(np.full(128, 0.3))
            coverage = torch.tensor(np.concatenate([[0.0], np.cumsum(mass)]))
            costs.append(allocation_cost(residual, coverage, risk_weight=float(trial), zeta=1e-6))
            choices.append(layer_choices(f"l{layer}", routing(128, 8), 0.375, 0.875))
        for ratio in (0.25, 0.5, 0.6):
            budget = check_feasible(choices, ratio, 0.375, 0.875)
            greedy = waterfill_allocation(costs, choices, budget)
            exact = optimal_allocation(costs, choices, budget)
            assert sum(exact) == sum(greedy) == budget
            assert total_cost(costs, exact) <= total_cost(costs, greedy) + 1e-12


@pytest.mark.parametrize("seed", range(20))
def test_waterfill_is_the_papers_greedy_and_optimal_on_convex_costs(seed):
    rng = np.random.default_rng(seed)
    num_layers = int(rng.integers(2, 7))
    costs, choices = [], []
    for layer in range(num_layers):
        n = int(rng.integers(4, 20))
        drops = np.sort(rng.exponential(size=n))[::-1]  # decreasing marginal gains: convex cost
        costs.append(rng.normal() + drops.sum() - np.concatenate([[0.0], np.cumsum(drops)]))
        low = int(rng.integers(0, n // 2 + 1))
        high = int(rng.integers(max(low, n // 2), n + 1))
        choices.append(LayerChoices(f"l{layer}", n, low, high, 1))
    lows, highs = [c.low for c in choices], [c.high for c in choices]
    for budget in range(sum(lows), sum(highs) + 1):
        greedy = waterfill_allocation(costs, choices, budget)
        assert greedy == paper_waterfill(costs, lows, highs, budget)
        exact = optimal_allocation(costs, choices, budget)
        assert total_cost(costs, greedy) == pytest.approx(total_cost(costs, exact), abs=1e-12)
        assert greedy == exact


def test_waterfill_matches_the_paper_on_a_hand_example():
    # Layer a gains 0.5, 0.1; layer b gains 0.3, 0.2; starting at one expert each, three more experts
    # go to a (0.5), b (0.3), b (0.2).
    costs = [np.array([9.0, 1.0, 0.5, 0.4]), np.array([9.0, 1.0, 0.7, 0.5])]
    choices = [LayerChoices("a", 3, 1, 3, 1), LayerChoices("b", 3, 1, 3, 1)]
    assert waterfill_allocation(costs, choices, 5) == [2, 3]
    assert optimal_allocation(costs, choices, 5) == [2, 3]
    assert waterfill_allocation(costs, choices, 2) == [1, 1]


def test_waterfill_grouped_steps_are_whole_groups():
    rng = np.random.default_rng(5)
    costs = [np.cumsum(-np.sort(rng.exponential(size=33))[::-1]) for _ in range(5)]
    costs = [np.concatenate([[0.0], c])[:33] for c in costs]
    choices = [LayerChoices(f"l{i}", 32, 8, 28, 4) for i in range(5)]
    for budget in range(40, 141, 4):
        greedy = waterfill_allocation(costs, choices, budget)
        assert sum(greedy) == budget
        assert all(k % 4 == 0 and 8 <= k <= 28 for k in greedy)
        assert total_cost(costs, optimal_allocation(costs, choices, budget)) <= total_cost(costs, greedy) + 1e-12


# ---------------------------------------------------------------------------- feasibility


def test_layer_choices_plain_router():
    c = layer_choices("l", routing(16, 4), 0.375, 0.875)
    assert (c.low, c.high, c.step) == (6, 14, 1)
    assert layer_choices("l", routing(16, 8), 0.375, 0.875).low == 8  # top_k wins over min_kept_fraction
    assert layer_choices("l", routing(128, 8), 0.25, 0.5).counts() == range(32, 65)
    # ratio bounds that land exactly on an integer are not rounded away by float error
    c = layer_choices("l", routing(10, 1), 0.3, 0.7)
    assert (c.low, c.high) == (3, 7)


def test_layer_choices_group_limited_router():
    # DeepSeek-V3: 256 experts in 8 groups, 4 groups per token, top-8, groups scored by their top-2.
    v3 = routing(256, 8, 8, 4, 2)
    assert minimum_kept(256, 8, 8, 4, 2) == 16
    c = layer_choices("l", v3, 0.375, 0.875)
    assert (c.low, c.high, c.step) == (96, 224, 8)
    c = layer_choices("l", v3, 0.01, 0.2)  # rounded inwards to whole groups, floor 2 per group
    assert (c.low, c.high) == (16, 48)
    # GLM-4.5-like tiny router: 2 groups, 1 group per token, top-4: 4 per group.
    assert minimum_kept(16, 4, 2, 1, 2) == 8
    assert layer_choices("l", routing(16, 4, 2, 1, 2), 0.1, 0.9).counts() == range(8, 15, 2)
    # DeepSeek-V2 group-limited greedy: 16 experts, 4 groups, 2 per token, top-6: 3 per group.
    assert minimum_kept(16, 6, 4, 2, 1) == 12


@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.2, 0.25, 0.3, 0.375, 0.45, 0.5, 0.55, 0.6])
@pytest.mark.parametrize("allocate", [waterfill_allocation, optimal_allocation])
def test_budget_is_met_within_bounds(ratio, allocate):
    rng = np.random.default_rng(int(ratio * 100))
    routings = [routing(int(n), 4) for n in rng.choice([16, 32, 64], size=6)]
    choices = [layer_choices(f"l{i}", r, 0.375, 1.0) for i, r in enumerate(routings)]
    costs = [rng.normal(size=r["num_experts"] + 1) for r in routings]
    budget = check_feasible(choices, ratio, 0.375, 1.0)
    total = sum(r["num_experts"] for r in routings)
    assert budget == target_kept([r["num_experts"] for r in routings], ratio) == round((1 - ratio) * total)
    counts = allocate(costs, choices, budget)
    assert sum(counts) == budget
    for k, r in zip(counts, routings):
        assert math.ceil(0.375 * r["num_experts"]) <= k <= r["num_experts"]
        assert k >= r["top_k"]


@pytest.mark.parametrize("ratio", [0.2, 0.25, 0.3, 0.4, 0.5, 0.55])
@pytest.mark.parametrize("allocate", [waterfill_allocation, optimal_allocation])
def test_grouped_budget_is_whole_groups(ratio, allocate):
    rng = np.random.default_rng(11)
    r = routing(64, 8, 8, 4, 2)
    choices = [layer_choices(f"l{i}", r, 0.375, 0.875) for i in range(7)]
    costs = [rng.normal(size=65) for _ in range(7)]
    budget = check_feasible(choices, ratio, 0.375, 0.875)
    assert budget % 8 == 0
    assert abs(budget - round((1 - ratio) * 7 * 64)) <= 4
    counts = allocate(costs, choices, budget)
    assert sum(counts) == budget
    assert all(k % 8 == 0 and 24 <= k <= 56 for k in counts)


def test_uniform_allocation():
    routings = [("a", routing(16, 4)), ("b", routing(64, 8)), ("c", routing(256, 8, 8, 4, 2))]
    assert uniform_allocation(routings, 0.5) == [8, 32, 128]
    assert uniform_allocation(routings, 0.0) == [16, 64, 256]
    # 0.7 * 256 = 179.2 experts rounds to the nearest whole group count: 22 groups of 8.
    assert uniform_allocation(routings, 0.3) == [11, 45, 176]


# ------------------------------------------------------------------------------- errors


def test_infeasible_ratio_message_gives_the_working_interval():
    choices = [layer_choices(name, routing(16, 4), 0.375, 0.875) for name in ("a", "b")]
    with pytest.raises(InfeasibleBudgetError) as info:
        check_feasible(choices, 0.9, 0.375, 0.875)
    assert str(info.value) == (
        "ratio=0.9 keeps 3 of 32 experts, but min_kept_fraction=0.375, max_kept_fraction=0.875 and the routers' top-k allow "
        "keeping 12 to 28: use a ratio in [0.1250, 0.6250]; the routers need at least 8 experts (top-k), so no "
        "min_kept_fraction allows a ratio above 0.7500."
    )
    with pytest.raises(InfeasibleBudgetError) as info:
        check_feasible(choices, 0.7, 0.375, 0.875)  # keeps 10: a lower bound helps, down to 5/16 per layer
    assert str(info.value).endswith("use a ratio in [0.1250, 0.6250] or lower min_kept_fraction to 0.312 or less to "
                                    "prune more.")
    with pytest.raises(InfeasibleBudgetError) as info:
        check_feasible(choices, 0.05, 0.375, 0.875)  # keeps 30 of 32: 15 per layer
    assert str(info.value).endswith("use a ratio in [0.1250, 0.6250] or raise max_kept_fraction to 0.938 or more to "
                                    "prune less.")


def test_the_reported_interval_works():
    rng = np.random.default_rng(0)
    routings = [routing(int(n), int(k)) for n, k in zip(rng.choice([16, 32, 64], 5), rng.choice([2, 4, 8], 5))]
    choices = [layer_choices(f"l{i}", r, 0.3, 0.8) for i, r in enumerate(routings)]
    with pytest.raises(InfeasibleBudgetError) as info:
        check_feasible(choices, 0.95, 0.3, 0.8)
    lo, hi = (float(x) for x in str(info.value).split("use a ratio in [")[1].split("]")[0].split(", "))
    total = sum(r["num_experts"] for r in routings)
    for ratio in np.linspace(lo + 1e-4, hi - 1e-4, 25):
        budget = check_feasible(choices, float(ratio), 0.3, 0.8)
        costs = [rng.normal(size=r["num_experts"] + 1) for r in routings]
        assert sum(optimal_allocation(costs, choices, budget)) == budget
    for ratio in (lo - 1.0 / total, hi + 1.0 / total):
        with pytest.raises(InfeasibleBudgetError):
            check_feasible(choices, float(ratio), 0.3, 0.8)


def test_layer_without_feasible_count():
    choices = [layer_choices("model.layers.1.mlp", routing(16, 8), 0.1, 0.4)]
    with pytest.raises(InfeasibleBudgetError) as info:
        check_feasible(choices, 0.7, 0.1, 0.4)
    assert str(info.value) == (
        "Layer model.layers.1.mlp (16 experts) has no feasible kept count between min_kept_fraction=0.1 and "
        "max_kept_fraction=0.4 that its router accepts (needs at least 8 experts in multiples of 1); raise max_kept_fraction "
        "to at least 0.500."
    )


def test_uniform_rejects_more_pruning_than_top_k_allows():
    routings = [("model.layers.1.mlp", routing(16, 4)), ("model.layers.2.mlp", routing(16, 4))]
    with pytest.raises(InfeasibleBudgetError) as info:
        uniform_allocation(routings, 0.8)
    assert str(info.value) == (
        "Uniform ratio=0.8 keeps 3 of 16 experts in layer model.layers.1.mlp, but its router needs at least 4 "
        "(top_k=4); use a ratio of at most 0.7500."
    )
    assert uniform_allocation(routings, 0.75) == [4, 4]


@pytest.mark.parametrize("ratio", [1.0, 1.5, -0.1, -1.0, float("nan")])
def test_ratio_outside_unit_interval_raises(ratio):
    choices = [layer_choices("a", routing(16, 4), 0.1, 1.0)]
    with pytest.raises(InfeasibleBudgetError, match=r"is outside \[0, 1\)"):
        target_kept([16], ratio)
    with pytest.raises(InfeasibleBudgetError):
        check_feasible(choices, ratio, 0.1, 1.0)
    with pytest.raises(InfeasibleBudgetError):
        uniform_allocation([("a", routing(16, 4))], ratio)


# ----------------------------------------------------------------------- risk weight


def _curves(rng, num_layers, n):
    residuals, coverages = [], []
    for _ in range(num_layers):
        gains = rng.dirichlet(np.full(n, 0.5))
        residuals.append(torch.tensor(np.concatenate([[1.0], 1.0 - np.cumsum(gains)])))
        mass = rng.dirichlet(np.full(n, 0.5))
        coverages.append(torch.tensor(np.concatenate([[0.0], np.cumsum(mass)])))
    return residuals, coverages


@pytest.mark.parametrize("seed", range(10))
def test_risk_weight_zero_minimises_residual_and_large_weight_maximises_coverage(seed):
    rng = np.random.default_rng(seed)
    residuals, coverages = _curves(rng, 3, 8)
    choices = [layer_choices(f"l{i}", routing(8, 2), 0.25, 1.0) for i in range(3)]
    budget = check_feasible(choices, 0.5, 0.25, 1.0)
    feasible = [k for k in itertools.product(*[c.counts() for c in choices]) if sum(k) == budget]

    def residual_sum(counts):
        return sum(float(r[k]) for r, k in zip(residuals, counts))

    def log_coverage(counts):
        return sum(math.log(float(c[k]) + 1e-6) for c, k in zip(coverages, counts))

    no_risk = optimal_allocation([allocation_cost(r, c, 0.0, 1e-6) for r, c in zip(residuals, coverages)], choices, budget)
    assert residual_sum(no_risk) == pytest.approx(min(residual_sum(k) for k in feasible), abs=1e-12)
    weight = 1e6
    risky = optimal_allocation([allocation_cost(r, c, weight, 1e-6) for r, c in zip(residuals, coverages)], choices, budget)
    # With a huge lambda only the routing risk matters (up to the residual, worth < 3 / lambda here).
    assert log_coverage(risky) >= max(log_coverage(k) for k in feasible) - 3.0 / weight
    assert residual_sum(risky) >= residual_sum(no_risk)
    assert log_coverage(risky) >= log_coverage(no_risk)


def test_allocation_cost_formula():
    residual = torch.tensor([1.0, 0.4, 0.1, 0.0])
    coverage = torch.tensor([0.0, 0.5, 0.9, 1.0])
    cost = allocation_cost(residual, coverage, 2.0, 1e-3)
    expected = residual.numpy().astype(np.float64) - 2.0 * np.log(coverage.numpy().astype(np.float64) + 1e-3)
    np.testing.assert_allclose(cost, expected, rtol=0, atol=1e-12)
    assert cost.dtype == np.float64
    # float rounding can leave a coverage a hair below zero; it is clipped rather than turned into NaN
    assert np.isfinite(allocation_cost(residual, torch.tensor([-1e-17, 0.5, 0.9, 1.0]), 1.0, 1e-6)).all()
