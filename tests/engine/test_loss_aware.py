"""Loss-aware selection and allocation (ompmoe.engine.methods.loss) against literal loops and brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from ompmoe import collect_stats, plan_pruning
from ompmoe.engine.planning.allocation import layer_choices
from ompmoe.engine.methods.loss.selection import (
    greedy_quadratic,
    kept_masks,
    loss_curves,
    loss_estimate,
)
from ompmoe.engine.methods import METHODS, get_method
from ompmoe.engine.planning.selection import greedy_pursuit, routing_coverage
from ompmoe.engine.planning.strategy import strategy_for
from ompmoe.engine.tiny import tiny_model


def random_problem(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    atoms = torch.randn(n, 3, generator=generator, dtype=torch.float64)
    return atoms @ atoms.T, torch.randn(n, generator=generator, dtype=torch.float64)


def literal_q(h: torch.Tensor, s: torch.Tensor, removed: list[int]) -> float:
    return -sum(float(s[e]) for e in removed) + 0.5 * sum(float(h[e, f]) for e in removed for f in removed)


def literal_greedy(h: torch.Tensor, s: torch.Tensor, num_groups: int = 1) -> list[int]:
    """Keep, one at a time, the eligible expert whose removal-set shrink lowers q the most (lowest id on ties)."""
    n = h.shape[0]
    size = n // num_groups
    order: list[int] = []
    round_groups: set[int] = set()
    for step in range(n):
        if step % num_groups == 0:
            round_groups = set()
        removed = [e for e in range(n) if e not in order]
        best, best_value = None, None
        for e in removed:
            if num_groups > 1 and e // size in round_groups:
                continue
            value = literal_q(h, s, [f for f in removed if f != e])
            if best_value is None or value < best_value - 1e-12:
                best, best_value = e, value
        order.append(best)
        round_groups.add(best // size)
    return order


@pytest.mark.parametrize("num_groups", [1, 4])
@pytest.mark.parametrize("seed", range(4))
def test_greedy_quadratic_equals_literal_greedy(seed, num_groups):
    h, s = random_problem(8, seed)
    assert greedy_quadratic(h, s, num_groups).tolist() == literal_greedy(h, s, num_groups)


@pytest.mark.parametrize("num_groups", [1, 4])
def test_greedy_quadratic_without_linear_term_is_the_binary_pursuit(num_groups):
    for seed in range(5):
        gram, _ = random_problem(16, seed)
        expected = greedy_pursuit(gram, num_groups=num_groups, with_gains=False).order
        assert torch.equal(greedy_quadratic(2 * gram, torch.zeros(16), num_groups), expected)


def test_loss_estimate_and_kept_masks_match_the_formula():
    h, s = random_problem(6, 9)
    order = torch.tensor([3, 0, 5, 1, 4, 2])
    masks = kept_masks(order, 6)
    assert masks.shape == (7, 6)
    values = loss_estimate(h, s, masks)
    for k in range(7):
        assert sorted(torch.nonzero(masks[k]).flatten().tolist()) == sorted(order[:k].tolist())
        removed = order[k:].tolist()
        assert float(values[k]) == pytest.approx(literal_q(h, s, removed), rel=1e-12, abs=1e-12)
    assert float(values[6]) == 0.0


@pytest.fixture(scope="module")
def stats():
    model = tiny_model("qwen3_moe", num_hidden_layers=3)
    generator = torch.Generator().manual_seed(0)
    return collect_stats(model, [torch.randint(3, 256, (2, 32), generator=generator) for _ in range(2)], loss_aware=True)


@pytest.mark.parametrize("allocation", ["loss", "loss_risk"])
@pytest.mark.parametrize("method", ["omp", "loss_newton", "reap"])
def test_loss_allocation_is_the_brute_force_minimum(stats, method, allocation):
    ratio, risk_weight, zeta = 0.5, 3.0, 1e-6
    plan = plan_pruning(stats, ratio, method=method, allocation=allocation, risk_weight=risk_weight, zeta=zeta)
    selections = get_method(method).select(stats.layers)
    curves = loss_curves(stats.layers, selections, stats.num_tokens)
    if allocation == "loss_risk":
        for i, (layer, order) in enumerate(zip(stats.layers, selections)):
            scale = max(float(curves[i][0]), 0.0)  # the whole-layer loss estimate
            curves[i] = curves[i] - risk_weight * scale * np.log(routing_coverage(layer.routing_mass, order).numpy() + zeta)
    choices = [layer_choices(layer.name, layer.routing, 0.375, 0.875) for layer in stats.layers]
    budget = round(0.5 * sum(layer.num_experts for layer in stats.layers))
    best = min(
        sum(curve[k] for curve, k in zip(curves, counts))
        for counts in itertools.product(*[c.counts() for c in choices])
        if sum(counts) == budget
    )
    counts = [layer.num_kept for layer in plan.layers]
    assert sum(counts) == budget
    assert all(c.low <= k <= c.high for c, k in zip(choices, counts))
    assert sum(curve[k] for curve, k in zip(curves, counts)) == pytest.approx(best, rel=1e-12, abs=1e-15)
    assert plan.allocation == allocation


LOSS_METHODS = ["loss_newton", "omp_fisher", "omp_grad", "omp_hybrid", "omp_loss"]


def test_the_loss_methods_declare_the_loss_aware_statistics():
    assert sorted(name for name, cls in METHODS.items() if "loss_aware" in cls.statistics) == LOSS_METHODS


@pytest.mark.parametrize("method", LOSS_METHODS)
def test_loss_methods_plan_on_tiny_models(stats, method):
    plan = strategy_for(method, ratio=0.5, allocation="waterfill").plan(stats)
    assert plan.method == method
    assert sum(layer.num_kept for layer in plan.layers) == sum(layer.num_experts for layer in stats.layers) // 2
    for layer, planned in zip(stats.layers, plan.layers):
        assert sorted(planned.order) == list(range(layer.num_experts))
    if method in ("omp_loss", "omp_grad", "omp_fisher"):
        key = {"omp_loss": "gram_loss", "omp_grad": "gram_grad", "omp_fisher": "gram_fisher"}[method]
        for layer, planned in zip(stats.layers, plan.layers):
            assert planned.order == greedy_pursuit(getattr(layer, key), with_gains=False).order.tolist()


def test_loss_methods_and_allocations_refuse_plain_statistics():
    model = tiny_model("qwen3_moe", num_hidden_layers=2)
    plain = collect_stats(model, [torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(1))])
    with pytest.raises(ValueError, match=r"Method 'omp_loss' needs loss-aware statistics \('gram_loss'\).*loss_aware=True"):
        plan_pruning(plain, 0.5, method="omp_loss")
    with pytest.raises(ValueError, match=r"A loss allocation needs loss-aware statistics \('gram_loss'\)"):
        plan_pruning(plain, 0.5, method="omp", allocation="loss")


def test_omp_hybrid_is_the_pursuit_on_the_literal_blend(stats):
    """Each Gram over its trace, summed with the weight, then the paper's pursuit (group rounds included)."""
    for weight in (0.0, 1.0, 2.5):
        plan = plan_pruning(stats, 0.5, method="omp_hybrid", method_options={"loss_weight": weight})
        for layer, planned in zip(stats.layers, plan.layers):
            g_norm = layer.gram_normalized.double()
            g_grad = layer.gram_grad.double()
            blend = g_norm / float(torch.trace(g_norm)) + weight * g_grad / float(torch.trace(g_grad))
            assert planned.order == greedy_pursuit(blend, num_groups=layer.num_groups, with_gains=False).order.tolist()
    zero = plan_pruning(stats, 0.5, method="omp_hybrid", method_options={"loss_weight": 0.0})
    normalized = plan_pruning(stats, 0.5, method="omp_normalized")
    assert [p.order for p in zero.layers] == [p.order for p in normalized.layers]


@pytest.mark.parametrize("weight", [-1.0, float("nan"), float("inf")])
def test_omp_hybrid_refuses_a_bad_loss_weight(weight):
    with pytest.raises(ValueError, match=r"omp_hybrid's loss_weight must be a finite number >= 0 \(0 is omp_normalized\)"):
        get_method("omp_hybrid", {"loss_weight": weight})


def test_missing_optional_statistics_message_names_layers_and_the_fix():
    from types import SimpleNamespace

    from ompmoe.engine.planning.method_registry import require_layer_tensor

    layers = [SimpleNamespace(name=f"model.layers.{i}.mlp", gram_loss=None) for i in range(4)]
    with pytest.raises(ValueError) as error:
        require_layer_tensor(layers, "gram_loss", "Method 'omp_loss'", "loss-aware", "collect_stats(..., loss_aware=True)")
    assert str(error.value) == (
        "Method 'omp_loss' needs loss-aware statistics ('gram_loss'), which these statistics lack (layers "
        "['model.layers.0.mlp', 'model.layers.1.mlp', 'model.layers.2.mlp']...). Collect them with "
        "collect_stats(..., loss_aware=True)."
    )
    require_layer_tensor([SimpleNamespace(name="a", gram_loss=1)], "gram_loss", "x", "loss-aware", "y")  # present: no error
