"""Selection methods (ompmoe.engine.methods) against literal implementations, brute force and the plan machinery."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import ompmoe
from ompmoe import MoEStats, collect_stats, plan_pruning
from ompmoe.engine.methods import (
    METHODS,
    SubsetSelection,
    get_method,
    TooManySubsetsError,
    exact_subsets,
    score_order,
    swap_refine,
)
from ompmoe.engine.collect.sums import CANCELLED_TOKEN
from ompmoe.engine.planning.selection import greedy_pursuit
from ompmoe.engine.collect.statistics import LayerStats
from ompmoe.engine.planning.strategy import PruningStrategy, strategy_for
from ompmoe.engine.tiny import tiny_model

from reference import assert_gram_close, make_model, random_ids

ALLOCATIONS = ("uniform", "waterfill", "optimal")
BUILT_IN = ("omp", "omp_normalized", "frequency", "routing_mass", "ean", "reap", "random", "static_energy", "exact", "omp_swap")
SCORE_METHODS = ("frequency", "routing_mass", "ean", "reap", "static_energy")


def _stats(model_type: str, seed: int = 0, **overrides) -> MoEStats:
    model = tiny_model(model_type, seed=seed, num_hidden_layers=4, **overrides)
    generator = torch.Generator().manual_seed(seed)
    return collect_stats(model, [torch.randint(3, 256, (2, 32), generator=generator) for _ in range(2)])


@pytest.fixture(scope="module")
def qwen_stats() -> MoEStats:
    return _stats("qwen3_moe")  # three MoE layers, 16 experts, top-4


@pytest.fixture(scope="module")
def deepseek_stats() -> MoEStats:
    return _stats("deepseek_v3")  # three MoE layers, 16 experts in 4 groups


def random_gram(n: int, rank: int, seed: int) -> torch.Tensor:
    """A low-rank Gram of correlated atoms with uneven norms: greedy is often not optimal on it."""
    generator = torch.Generator().manual_seed(seed)
    atoms = torch.randn(n, rank, generator=generator, dtype=torch.float64)
    atoms *= torch.rand(n, 1, generator=generator, dtype=torch.float64) + 0.2
    return atoms @ atoms.T


def energy(gram: torch.Tensor, kept: set[int] | list[int]) -> float:
    """||Y - sum_{e in kept} V_e||^2 written out: the Gram entries of the experts left out."""
    out = [e for e in range(gram.shape[0]) if e not in set(kept)]
    return sum(float(gram[e, f]) for e in out for f in out)


def omp_prefix_sets(gram: torch.Tensor, num_groups: int = 1) -> list[list[int]]:
    order = greedy_pursuit(gram, num_groups).order.tolist()
    return [order[:k] for k in range(gram.shape[0] + 1)]


def balanced(kept, n: int, num_groups: int) -> bool:
    counts = [sum(1 for e in kept if e // (n // num_groups) == g) for g in range(num_groups)]
    return max(counts) - min(counts) <= 1


# ------------------------------------------------------------------------ score rankings
def literal_ranking(scores: list[float]) -> list[int]:
    return sorted(range(len(scores)), key=lambda e: (-scores[e], e))


def literal_grouped_ranking(scores: list[float], num_groups: int) -> list[int]:
    """Step by step: best score among experts of groups not yet picked in this round; lowest id on ties."""
    n, size = len(scores), len(scores) // num_groups
    order: list[int] = []
    picked_groups: set[int] = set()
    for step in range(n):
        if step % num_groups == 0:
            picked_groups = set()
        eligible = [e for e in range(n) if e not in order and e // size not in picked_groups]
        best = min(eligible, key=lambda e: (-scores[e], e))
        order.append(best)
        picked_groups.add(best // size)
    return order


def literal_scores(layer: LayerStats, method: str) -> list[float]:
    n = layer.num_experts
    if method == "frequency":
        return [float(layer.token_count[e]) for e in range(n)]
    if method == "routing_mass":
        return [float(layer.routing_mass[e]) for e in range(n)]
    if method == "ean":
        return [float(layer.norm_sum[e]) for e in range(n)]
    if method == "reap":
        count = layer.token_count
        return [float(layer.weighted_norm_sum[e] / count[e]) if count[e] > 0 else 0.0 for e in range(n)]
    if method == "static_energy":
        return [float(layer.gram[e, e]) for e in range(n)]
    raise AssertionError(method)


@pytest.mark.parametrize("method", SCORE_METHODS)
def test_score_rankings_equal_literal_sorts(method, qwen_stats, deepseek_stats):
    for layer, order in zip(qwen_stats.layers, get_method(method).select(qwen_stats.layers)):
        assert order.tolist() == literal_ranking(literal_scores(layer, method))
    for layer, order in zip(deepseek_stats.layers, get_method(method).select(deepseek_stats.layers)):
        assert layer.num_groups == 4
        assert order.tolist() == literal_grouped_ranking(literal_scores(layer, method), layer.num_groups)
    # Through plan_pruning: a uniform plan keeps the literal top of the ranking.
    plan = plan_pruning(qwen_stats, 0.5, method=method, allocation="uniform")
    for layer, planned in zip(qwen_stats.layers, plan.layers):
        assert planned.kept == sorted(literal_ranking(literal_scores(layer, method))[:8])


def test_score_order_ties_go_to_the_lowest_id():
    generator = torch.Generator().manual_seed(0)
    for trial in range(20):
        scores = torch.randint(0, 3, (12,), generator=generator).to(torch.float64)  # many ties
        for num_groups in (1, 2, 3, 4):
            expected = (literal_ranking if num_groups == 1 else
                        lambda s: literal_grouped_ranking(s, num_groups))(scores.tolist())
            assert score_order(scores, num_groups).tolist() == expected, (trial, num_groups)
    assert score_order(torch.zeros(6)).tolist() == list(range(6))


def test_reap_is_the_mean_gate_weighted_norm_over_routed_tokens(collected):
    """REAP from the statistics equals mean over routed tokens of g ||F|| from the literal atoms."""
    from ompmoe.engine.methods import reap_scores

    for layer, literal in zip(collected.stats.layers, collected.literal):
        routed = literal.token_count > 0
        expected = torch.zeros_like(literal.token_count)
        expected[routed] = literal.weighted_norm_sum[routed] / literal.token_count[routed]
        torch.testing.assert_close(reap_scores(layer), expected, rtol=1e-5, atol=1e-7)


def test_random_is_seeded_and_reproducible(qwen_stats, deepseek_stats):
    for stats in (qwen_stats, deepseek_stats):
        first = PruningStrategy(ratio=0.5, method="random", method_options={"seed": 3}).plan(stats)
        again = PruningStrategy(ratio=0.5, method="random", method_options={"seed": 3}).plan(stats)
        other = PruningStrategy(ratio=0.5, method="random", method_options={"seed": 4}).plan(stats)
        assert first == again
        assert first.extra == {"method_options": {"seed": 3}}
        assert [layer.order for layer in first.layers] != [layer.order for layer in other.layers]
        # The documented draw: uniform scores per layer from one generator, in layer order.
        generator = torch.Generator().manual_seed(3)
        for layer, planned in zip(stats.layers, first.layers):
            scores = torch.rand(layer.num_experts, generator=generator, dtype=torch.float64).tolist()
            expected = (literal_ranking(scores) if layer.num_groups == 1
                        else literal_grouped_ranking(scores, layer.num_groups))
            assert planned.order == expected
    # The registered default is seed 0.
    default = plan_pruning(qwen_stats, 0.5, method="random")
    assert default.layers == plan_pruning(qwen_stats, 0.5, method="random", method_options={"seed": 0}).layers
    assert default.layers == PruningStrategy(ratio=0.5, method="random").plan(qwen_stats).layers


# ------------------------------------------------------------------------- exact optimum
def brute_force(gram: torch.Tensor, num_groups: int = 1) -> list[tuple[float, list[list[int]]]]:
    """Per count: the minimum energy over all (group-balanced) subsets and every set attaining it."""
    n = gram.shape[0]
    result = []
    for k in range(n + 1):
        values = {subset: energy(gram, subset) for subset in itertools.combinations(range(n), k)
                  if balanced(subset, n, num_groups)}
        best = min(values.values())
        scale = float(gram.diagonal().sum())
        result.append((best, [list(s) for s, v in values.items() if v <= best + 1e-9 * scale]))
    return result


@pytest.mark.parametrize("num_groups", [1, 2])
def test_exact_equals_brute_force_and_is_never_worse_than_omp(num_groups):
    strictly_better = 0
    for seed in range(4):
        gram = random_gram(10, 3, seed)
        kept = exact_subsets(gram, num_groups)
        assert kept.shape == (11, 10)
        greedy = omp_prefix_sets(gram, num_groups)
        for k, (best, argmins) in enumerate(brute_force(gram, num_groups)):
            chosen = torch.nonzero(kept[k]).flatten().tolist()
            assert len(chosen) == k
            assert chosen in argmins
            assert energy(gram, chosen) == pytest.approx(best, rel=1e-9, abs=1e-12)
            assert energy(gram, chosen) <= energy(gram, greedy[k]) + 1e-9
            strictly_better += energy(gram, chosen) < energy(gram, greedy[k]) - 1e-6
    assert strictly_better > 0  # the Grams are hard enough for greedy to miss the optimum


def test_exact_ties_go_to_the_lexicographically_smallest_set():
    gram = torch.diag(torch.tensor([3.0, 1.0, 1.0, 1.0, 2.0], dtype=torch.float64))
    kept = exact_subsets(gram)
    assert [torch.nonzero(row).flatten().tolist() for row in kept] == [
        [], [0], [0, 4], [0, 1, 4], [0, 1, 2, 4], [0, 1, 2, 3, 4]
    ]


def test_exact_refuses_large_layers(qwen_stats):
    big = random_gram(22, 4, 0)
    with pytest.raises(TooManySubsetsError) as info:
        exact_subsets(big, name="model.layers.7.mlp")
    assert str(info.value) == (
        "Method 'exact' would enumerate 2^22 = 4,194,304 expert subsets in layer model.layers.7.mlp, more than "
        "max_subsets=2,000,000. Raise max_subsets (time and memory grow as 2^N) or use method 'omp_swap' "
        "(local search from the greedy set)."
    )
    # A lower limit refuses the 16-expert tiny layers, in planning and before calibration.
    routings = [(layer.name, layer.routing) for layer in qwen_stats.layers]
    with pytest.raises(TooManySubsetsError, match=r"2\^16 = 65,536 expert subsets in layer model\.layers\.1\.mlp"):
        PruningStrategy(ratio=0.5, method="exact", method_options={"max_subsets": 1000}).validate(routings)
    with pytest.raises(TooManySubsetsError, match="max_subsets=1,000"):
        plan_pruning(qwen_stats, 0.5, method="exact", method_options={"max_subsets": 1000})
    PruningStrategy(ratio=0.5, method="exact").validate(routings)


# ----------------------------------------------------------------------- swap refinement
def test_swap_refinement_is_never_worse_than_omp_and_one_swap_optimal():
    improved = 0
    for seed, num_groups in itertools.product(range(4), (1, 2, 3)):
        gram = random_gram(12, 3, seed)
        n = 12
        greedy = omp_prefix_sets(gram, num_groups)
        start = torch.zeros(n + 1, n, dtype=torch.bool)
        for k, subset in enumerate(greedy):
            start[k, subset] = True
        refined = swap_refine(gram, start, num_groups)
        scale = float(gram.diagonal().sum())
        for k in range(n + 1):
            kept = torch.nonzero(refined[k]).flatten().tolist()
            assert len(kept) == k
            # Group counts are those of the greedy prefix (swaps stay inside a group).
            size = n // num_groups
            assert [sum(e // size == g for e in kept) for g in range(num_groups)] == [
                sum(e // size == g for e in greedy[k]) for g in range(num_groups)
            ]
            value = energy(gram, kept)
            assert value <= energy(gram, greedy[k]) + 1e-12 * scale
            improved += value < energy(gram, greedy[k]) - 1e-6
            # No single swap (same group) lowers the energy.
            for i in kept:
                for j in set(range(n)) - set(kept):
                    if i // size == j // size:
                        swapped = (set(kept) - {i}) | {j}
                        assert energy(gram, swapped) >= value - 1e-9 * scale, (seed, num_groups, k, i, j)
    assert improved > 0


@pytest.mark.parametrize("stats_name", ["qwen_stats", "deepseek_stats"])
def test_set_methods_on_tiny_model_stats(stats_name, request):
    stats = request.getfixturevalue(stats_name)
    omp = get_method("omp").select(stats.layers)
    exact = get_method("exact").select(stats.layers)
    swap = get_method("omp_swap").select(stats.layers)
    for layer, order, ex, sw in zip(stats.layers, omp, exact, swap):
        assert isinstance(ex, SubsetSelection) and isinstance(sw, SubsetSelection)
        assert torch.equal(ex.reference, order) and torch.equal(sw.reference, order)
        from ompmoe.engine.planning.selection import prefix_residual

        greedy = prefix_residual(layer.gram, order)
        r_exact, r_swap = ex.residual(layer.gram), sw.residual(layer.gram)
        assert (r_exact <= r_swap + 1e-12).all() and (r_swap <= greedy + 1e-12).all()
        for k in range(0, layer.num_experts + 1, layer.num_groups):
            assert ex.kept[k].sum() == k and sw.kept[k].sum() == k
            assert balanced(ex.kept_ids(k), layer.num_experts, layer.num_groups)
            per_group = ex.kept[k].reshape(layer.num_groups, -1).sum(1)
            assert (per_group == k // layer.num_groups).all()
            assert sorted(ex.order_at(k)[:k].tolist()) == ex.kept_ids(k)
            assert r_exact[k] == pytest.approx(energy(layer.gram, ex.kept_ids(k)) / layer.signal_energy, abs=1e-12)


# ------------------------------------------------------------------ token-normalized OMP
def test_token_normalized_gram_equals_literal_per_token_computation(collected):
    for layer_stats, literal in zip(collected.stats.layers, collected.literal):
        atoms = literal.atoms  # (N, tokens, d)
        expected = torch.zeros_like(literal.gram)
        for t in range(atoms.shape[1]):
            token_atoms = atoms[:, t, :]
            y = token_atoms.sum(dim=0)
            output_energy = float(y @ y)
            atom_energy = float(token_atoms.square().sum())
            if output_energy > CANCELLED_TOKEN * atom_energy:
                expected += token_atoms @ token_atoms.T / output_energy
        assert layer_stats.gram_normalized is not None
        assert_gram_close(layer_stats.gram_normalized, expected, rtol=1e-4)
        # Every token's routed output carries unit energy in the normalized objective.
        assert float(layer_stats.gram_normalized.sum()) == pytest.approx(32.0, rel=1e-4)
        assert float(expected.sum()) == pytest.approx(32.0, rel=1e-9)


def test_token_normalized_omp_is_omp_on_the_normalized_gram(qwen_stats, deepseek_stats):
    for stats in (qwen_stats, deepseek_stats):
        orders = get_method("omp_normalized").select(stats.layers)
        for layer, order in zip(stats.layers, orders):
            assert order.tolist() == greedy_pursuit(layer.gram_normalized, layer.num_groups).order.tolist()


def test_token_normalized_gram_skips_padding_and_merges_exactly():
    model = make_model("olmoe")
    ids = random_ids(seed=9)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    padded = collect_stats(model, [{"input_ids": ids, "attention_mask": mask}])
    separate = collect_stats(model, [ids[0:1], ids[1:2, :10]])
    first, second = collect_stats(model, [ids[0:1]]), collect_stats(model, [ids[1:2, :10]])
    merged = first.merge(second)
    for a, b, m in zip(padded.layers, separate.layers, merged.layers):
        assert_gram_close(a.gram_normalized, b.gram_normalized, rtol=1e-5)
        torch.testing.assert_close(m.gram_normalized, b.gram_normalized, rtol=1e-12, atol=1e-12)


def test_statistics_without_the_normalized_gram_still_load_and_plan(qwen_stats, tmp_path):
    old = dataclasses.replace(
        qwen_stats, layers=[dataclasses.replace(layer, gram_normalized=None) for layer in qwen_stats.layers]
    )
    path = old.save(tmp_path / "old.safetensors")
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        assert not any("gram_normalized" in key for key in handle.keys())
    loaded = MoEStats.load(path)
    assert all(layer.gram_normalized is None for layer in loaded.layers)
    assert plan_pruning(loaded, 0.5) == plan_pruning(qwen_stats, 0.5)
    with pytest.raises(ValueError, match=r"Method 'omp_normalized' needs current statistics \('gram_normalized'\), which "
                       r"these statistics lack .*Collect them with this ompmoe \(they were written by an older one\)"):
        plan_pruning(loaded, 0.5, method="omp_normalized")
    # Merging with new statistics keeps the sums exact and drops what only one side has.
    merged = loaded.merge(qwen_stats)
    assert all(layer.gram_normalized is None for layer in merged.layers)
    assert torch.equal(merged.layers[0].gram, 2 * qwen_stats.layers[0].gram)
    # New files carry it.
    new = MoEStats.load(qwen_stats.save(tmp_path / "new.safetensors"))
    for a, b in zip(new.layers, qwen_stats.layers):
        assert torch.equal(a.gram_normalized, b.gram_normalized)


# --------------------------------------------------------------- every method, every plan
@pytest.mark.parametrize("stats_name", ["qwen_stats", "deepseek_stats"])
def test_every_method_plans_with_every_allocation(stats_name, request):
    stats = request.getfixturevalue(stats_name)
    assert set(BUILT_IN) <= set(METHODS)
    for method in BUILT_IN:
        costs = {}
        for allocation in ALLOCATIONS:
            plan = strategy_for(method, ratio=0.5, allocation=allocation).plan(stats)
            assert plan == plan_pruning(stats, 0.5, method=method, allocation=allocation,
                                        method_options=strategy_for(method).method_options or None)
            assert plan.method == method and plan.allocation == allocation
            assert sum(layer.num_kept for layer in plan.layers) == 24
            for layer, planned in zip(stats.layers, plan.layers):
                n, k = layer.num_experts, planned.num_kept
                assert sorted(planned.order) == list(range(n))
                assert planned.kept == sorted(planned.order[:k]) and len(planned.kept) == k
                # Equal count in every router group (group-limited routers).
                size = n // layer.num_groups
                assert [sum(e // size == g for e in planned.kept) for g in range(layer.num_groups)] == [
                    k // layer.num_groups
                ] * layer.num_groups
                # The curves at the kept count describe the kept set.
                assert planned.residual[k] == pytest.approx(energy(layer.gram, planned.kept) / layer.signal_energy,
                                                            abs=1e-9)
                share = layer.routing_mass / layer.routing_mass.sum()
                assert planned.coverage[k] == pytest.approx(float(share[planned.kept].sum()), abs=1e-12)
            costs[allocation] = plan.cost
        assert costs["optimal"] <= costs["waterfill"] + 1e-9
        assert costs["optimal"] <= costs["uniform"] + 1e-9


def test_exact_and_swap_plans_are_never_worse_than_omp_at_the_same_counts(qwen_stats):
    omp = plan_pruning(qwen_stats, 0.5, method="omp", allocation="uniform")
    for method in ("exact", "omp_swap"):
        plan = plan_pruning(qwen_stats, 0.5, method=method, allocation="uniform")
        for a, b in zip(plan.layers, omp.layers):
            assert a.num_kept == b.num_kept
            assert a.residual[a.num_kept] <= b.residual[b.num_kept] + 1e-12


def test_baseline_strategies_in_the_callback_interface(qwen_stats):
    import lightning  # noqa: F401  (the callback's extra_ratios use dataclasses.replace)

    strategy = ompmoe.PruningStrategy(ratio=0.5, method="reap", allocation="optimal")
    assert isinstance(strategy, ompmoe.Strategy)
    assert dataclasses.replace(strategy, ratio=0.25).plan(qwen_stats).method == "reap"
    assert strategy_for("exact", max_subsets=10**6).method_options == {"max_subsets": 10**6}
    with pytest.raises(ValueError, match="Unknown method 'magnitude'"):
        strategy_for("magnitude")


def test_group_balance_for_grouped_routers_of_other_architectures():
    for model_type, overrides in (("glm4_moe", {}), ("deepseek_v2", {"topk_method": "group_limited_greedy"})):
        stats = _stats(model_type, **overrides)
        assert all(layer.num_groups > 1 for layer in stats.layers)
        for method in BUILT_IN:
            plan = plan_pruning(stats, 0.5, method=method, allocation="optimal")
            for layer, planned in zip(stats.layers, plan.layers):
                size = layer.num_experts // layer.num_groups
                counts = [sum(e // size == g for e in planned.kept) for g in range(layer.num_groups)]
                assert len(set(counts)) == 1, (model_type, method, counts)
