"""Greedy binary pursuit from Grams against the literal Algorithm 1 on atoms."""

from __future__ import annotations

import pytest
import torch

from ompmoe import greedy_pursuit
from ompmoe.engine.planning.selection import prefix_residual, routing_coverage
from literal_pursuit import pursuit_on_atoms


def random_atoms(n: int, seed: int, tokens: int = 12, d: int = 5) -> torch.Tensor:
    """Atoms with uneven scales, some correlated, so orders are far from arbitrary."""
    generator = torch.Generator().manual_seed(seed)
    atoms = torch.randn(n, tokens, d, generator=generator, dtype=torch.float64)
    atoms *= torch.rand(n, 1, 1, generator=generator, dtype=torch.float64) * 2 + 0.1
    atoms[1::3] += 0.7 * atoms[0::3][: len(atoms[1::3])]
    return atoms


def gram_of(atoms: torch.Tensor) -> torch.Tensor:
    flat = atoms.reshape(atoms.shape[0], -1)
    return flat @ flat.T


def literal_group_pursuit(atoms: torch.Tensor, num_groups: int) -> tuple[list[int], list[float]]:
    """Algorithm 1 where each step may only pick from the groups picked least so far."""
    n = atoms.shape[0]
    size = n // num_groups
    residual = atoms.sum(dim=0)
    signal = float(residual.square().sum())
    counts = [0] * num_groups
    remaining = list(range(n))
    order, curve = [], [1.0]
    for _ in range(n):
        least = min(counts)
        allowed = [e for e in remaining if counts[e // size] == least]
        gains = [float(2 * (residual * atoms[e]).sum() - atoms[e].square().sum()) for e in allowed]
        best = allowed[max(range(len(allowed)), key=lambda i: (gains[i], -allowed[i]))]
        residual = residual - atoms[best]
        remaining.remove(best)
        counts[best // size] += 1
        order.append(best)
        curve.append(float(residual.square().sum()) / signal)
    return order, curve


# ------------------------------------------------------------- on the collected statistics
def test_greedy_on_collected_gram_matches_literal_pursuit(collected):
    for layer_stats, literal in zip(collected.stats.layers, collected.literal, strict=True):
        result = greedy_pursuit(layer_stats.gram)
        order, curve = pursuit_on_atoms(literal.atoms)
        assert result.order.tolist() == order
        assert sorted(order) == list(range(layer_stats.num_experts))
        torch.testing.assert_close(result.residual, torch.tensor(curve, dtype=torch.float64), rtol=0, atol=1e-5)
        assert result.residual[0] == 1.0
        assert abs(float(result.residual[-1])) < 1e-9
        assert abs(curve[-1]) < 1e-12


def test_group_constrained_pursuit_on_collected_gram(collected):
    grouped = [(s, lit) for s, lit in zip(collected.stats.layers, collected.literal) if s.num_groups > 1]
    assert bool(grouped) == (collected.case in ("deepseek_v2_grouped", "deepseek_v3", "glm4_moe"))
    for layer_stats, literal in grouped:
        result = greedy_pursuit(layer_stats.gram, num_groups=layer_stats.num_groups)
        order, curve = literal_group_pursuit(literal.atoms, layer_stats.num_groups)
        assert result.order.tolist() == order
        torch.testing.assert_close(result.residual, torch.tensor(curve, dtype=torch.float64), rtol=0, atol=1e-5)


# ------------------------------------------------------------------------ random atoms
@pytest.mark.parametrize("seed", range(4))
def test_gains_are_the_literal_residual_drops(seed):
    atoms = random_atoms(9, seed)
    result = greedy_pursuit(gram_of(atoms))
    signal = float(atoms.sum(0).square().sum())
    residual = atoms.sum(dim=0)
    chosen: set[int] = set()
    for t, best in enumerate(result.order.tolist()):
        energy = float(residual.square().sum())
        for e in range(9):
            if e in chosen:
                assert result.gains[t, e] == float("-inf")
            else:
                drop = energy - float((residual - atoms[e]).square().sum())
                assert float(result.gains[t, e]) == pytest.approx(drop, rel=1e-9, abs=1e-9)
        next_residual = residual - atoms[best]
        drop = energy - float(next_residual.square().sum())
        assert float(result.gains[t, best]) == pytest.approx(drop, rel=1e-9, abs=1e-9)
        assert float(result.gains[t, best]) == max(float(result.gains[t, e]) for e in range(9))
        assert float(result.residual[t] - result.residual[t + 1]) * signal == pytest.approx(drop, rel=1e-9, abs=1e-9)
        residual = next_residual
        chosen.add(best)
    order, curve = pursuit_on_atoms(atoms)
    assert result.order.tolist() == order
    torch.testing.assert_close(result.residual, torch.tensor(curve, dtype=torch.float64), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("num_groups", [1, 2, 4])
def test_batched_call_equals_per_layer_calls(num_groups):
    grams = torch.stack([gram_of(random_atoms(8, seed)) for seed in range(3)])
    batched = greedy_pursuit(grams, num_groups=num_groups)
    assert batched.order.shape == (3, 8)
    assert batched.residual.shape == (3, 9)
    assert batched.gains.shape == (3, 8, 8)
    for i in range(3):
        single = greedy_pursuit(grams[i], num_groups=num_groups)
        assert torch.equal(batched.order[i], single.order)
        torch.testing.assert_close(batched.residual[i], single.residual, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(batched.gains[i], single.gains, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("n,num_groups", [(8, 2), (12, 3), (12, 4), (16, 4), (16, 8)])
def test_group_constrained_pursuit_equals_literal(n, num_groups):
    size = n // num_groups
    differs_from_unconstrained = False
    for seed in range(6):
        atoms = random_atoms(n, 100 + seed)
        gram = gram_of(atoms)
        result = greedy_pursuit(gram, num_groups=num_groups)
        order, curve = literal_group_pursuit(atoms, num_groups)
        assert result.order.tolist() == order
        torch.testing.assert_close(result.residual, torch.tensor(curve, dtype=torch.float64), rtol=1e-9, atol=1e-12)
        for k in range(num_groups, n + 1, num_groups):
            counts = torch.bincount(result.order[:k] // size, minlength=num_groups)
            assert counts.tolist() == [k // num_groups] * num_groups
        differs_from_unconstrained |= result.order.tolist() != greedy_pursuit(gram).order.tolist()
    assert differs_from_unconstrained  # the constraint is really exercised


@pytest.mark.parametrize("num_groups", [1, 2])
def test_without_gains_gives_the_same_ordering(num_groups):
    grams = torch.stack([gram_of(random_atoms(8, seed)) for seed in range(2)])
    full = greedy_pursuit(grams, num_groups=num_groups)
    lean = greedy_pursuit(grams, num_groups=num_groups, with_gains=False)
    assert lean.gains is None
    assert torch.equal(lean.order, full.order)
    assert torch.equal(lean.residual, full.residual)


def test_group_count_must_divide_experts():
    with pytest.raises(ValueError, match="^10 experts cannot be split into 3 equal groups.$"):
        greedy_pursuit(torch.eye(10), num_groups=3)


def test_ties_go_to_lowest_id_and_zero_signal_is_finite():
    atoms = random_atoms(6, 7)
    atoms[[1, 4]] = 0.0  # never-routed experts: zero atoms, equal gains of 0
    result = greedy_pursuit(gram_of(atoms))
    order, _ = pursuit_on_atoms(atoms)
    assert result.order.tolist() == order
    assert result.order.tolist().index(1) < result.order.tolist().index(4)

    empty = greedy_pursuit(torch.zeros(4, 4, dtype=torch.float64))
    assert empty.order.tolist() == [0, 1, 2, 3]
    assert torch.equal(empty.residual, torch.zeros(5, dtype=torch.float64))


def test_greedy_first_pick_is_best_single_expert():
    atoms = random_atoms(10, 11)
    y = atoms.sum(0)
    errors = [float((y - atoms[e]).square().sum()) for e in range(10)]
    result = greedy_pursuit(gram_of(atoms))
    assert int(result.order[0]) == min(range(10), key=errors.__getitem__)
    assert float(result.residual[1]) == pytest.approx(min(errors) / float(y.square().sum()), rel=1e-12)


# ------------------------------------------------------------------ prefix and coverage
@pytest.mark.parametrize("seed", range(3))
def test_prefix_residual_equals_literal(seed):
    atoms = random_atoms(10, 200 + seed)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(10, generator=generator)
    y = atoms.sum(0)
    literal = [float((y - atoms[order[:k]].sum(0)).square().sum()) / float(y.square().sum()) for k in range(11)]
    got = prefix_residual(gram_of(atoms), order)
    assert got.shape == (11,)
    torch.testing.assert_close(got, torch.tensor(literal, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    # For the greedy order it reproduces the pursuit's own residual curve.
    result = greedy_pursuit(gram_of(atoms))
    torch.testing.assert_close(prefix_residual(gram_of(atoms), result.order), result.residual, rtol=1e-9, atol=1e-12)


def test_routing_coverage_equals_literal_cumulative_share():
    generator = torch.Generator().manual_seed(3)
    mass = torch.rand(12, generator=generator) * 5
    order = torch.randperm(12, generator=generator)
    total = float(mass.double().sum())
    literal = [sum(float(mass[int(e)]) for e in order[:k]) / total for k in range(13)]
    got = routing_coverage(mass, order)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(literal, dtype=torch.float64), rtol=1e-6, atol=1e-7)
    assert float(got[0]) == 0.0 and float(got[-1]) == pytest.approx(1.0, abs=1e-12)
