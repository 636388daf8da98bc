"""Rerouting-aware statistics and ``omp_reroute`` against literal per-token implementations."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from ompmoe import MoEStats, collect_stats, find_moe_layers, plan_pruning
from ompmoe.engine.collect.sums import CANCELLED_TOKEN
from ompmoe.engine.methods import get_method
from ompmoe.engine.methods.reroute import REROUTE_TENSORS, RerouteError, check_reroutable
from ompmoe.engine.planning.selection import greedy_pursuit

from reference import assert_gram_close, capture_block_inputs, make_model, random_ids


def pruned_router(layer, removed: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """A copy of the layer's router without expert ``removed``, sliced as ``ompmoe.prune`` slices it."""
    router = copy.deepcopy(layer.router)
    kept = torch.tensor([e for e in range(layer.num_experts) if e != removed])
    for name, tensor in list(router.named_parameters(recurse=False)):
        if tensor.shape[0] == layer.num_experts:
            setattr(router, name, torch.nn.Parameter(tensor.detach().index_select(0, kept)))
    for attr in ("num_experts", "n_routed_experts", "num_local_experts"):
        if getattr(router, attr, None) == layer.num_experts:
            setattr(router, attr, layer.num_experts - 1)
    return router, kept


def expert_output(layer, hidden_row: torch.Tensor, expert: int) -> torch.Tensor:
    out = layer.experts(hidden_row[None], torch.tensor([[expert]]), torch.ones(1, 1, dtype=hidden_row.dtype))
    return out[0].to(torch.float64)


@torch.no_grad()
def literal_reroute_grams(layer, hidden: torch.Tensor, rerouted) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_x D D^T`` and ``sum_x D D^T / ||Y_x||^2``, one token and one removed expert at a time.

    ``rerouted(layer, hidden_row, removed)`` gives the ``(weights, expert ids)`` the router uses
    for the token once ``removed`` is gone.
    """
    n = layer.num_experts
    gram = torch.zeros(n, n, dtype=torch.float64)
    normalized = torch.zeros(n, n, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        _, weights, index = layer.router(hidden[t : t + 1])
        experts = index[0].tolist()
        atoms = [float(g) * expert_output(layer, hidden[t], e) for g, e in zip(weights[0], experts)]
        y = sum(atoms)
        deltas = {}
        for removed in experts:
            new_weights, new_ids = rerouted(layer, hidden[t], removed)
            y_new = sum(float(g) * expert_output(layer, hidden[t], e) for g, e in zip(new_weights, new_ids))
            deltas[removed] = y - y_new
        add_removal_products(gram, normalized, atoms, deltas)
    return gram, normalized


def add_removal_products(gram: torch.Tensor, normalized: torch.Tensor, atoms: list[torch.Tensor],
                         deltas: dict[int, torch.Tensor]) -> None:
    """Add one token's ``D_e D_f`` (``deltas`` by removed expert, its routed experts) to ``gram`` and, over
    ``||Y_x||^2`` (``Y_x`` the sum of ``atoms``; 0 for a cancelled token), to ``normalized``."""
    y = sum(atoms)
    energy = float(y @ y)
    valid = energy > CANCELLED_TOKEN * sum(float(a @ a) for a in atoms)
    for e in deltas:
        for f in deltas:
            product = float(deltas[e] @ deltas[f])
            gram[e, f] += product
            normalized[e, f] += product / energy if valid else 0.0


def by_pruned_router(layer, hidden_row: torch.Tensor, removed: int) -> tuple[list[float], list[int]]:
    """What ``ompmoe.prune`` really gives: the router with expert ``removed`` sliced out."""
    router, kept = pruned_router(layer, removed)
    _, weights, index = router(hidden_row[None])
    return weights[0].tolist(), kept[index[0]].tolist()


@torch.no_grad()
def by_unrenormalized_softmax(layer, hidden_row: torch.Tensor, removed: int) -> tuple[list[float], list[int]]:
    """The documented approximation for routers that do not renormalize: the native softmax weights,
    the removed expert's slot taken by the best expert outside the native top-k."""
    probs = torch.softmax(hidden_row.float() @ layer.router.weight.float().T, dim=-1)
    top = torch.topk(probs, layer.top_k).indices.tolist()
    outside = [e for e in probs.argsort(descending=True).tolist() if e not in top]
    ids = [e for e in top if e != removed] + [outside[0]]
    return [float(probs[e]) for e in ids], ids


def collect_with_inputs(case: str, batches, **kwargs):
    model = make_model(case)
    layers = find_moe_layers(model)
    with capture_block_inputs(layers) as captured:
        stats = collect_stats(model, batches, reroute=True, **kwargs)
    return layers, stats, [torch.cat(inputs) for inputs in captured]


@pytest.mark.parametrize(
    "case, rerouted",
    [
        ("qwen3_moe", by_pruned_router),  # softmax, renormalized top-k
        ("mixtral", by_pruned_router),  # softmax over the top-k
        ("gpt_oss", by_pruned_router),  # softmax over the top-k logits, router bias
        ("qwen2_moe", by_unrenormalized_softmax),
        ("olmoe", by_unrenormalized_softmax),
    ],
)
def test_reroute_grams_equal_literal_single_removals(case, rerouted):
    layers, stats, inputs = collect_with_inputs(case, [random_ids(seed=3)])
    for layer, layer_stats, hidden in zip(layers, stats.layers, inputs):
        gram, normalized = literal_reroute_grams(layer, hidden, rerouted)
        assert_gram_close(layer_stats.gram_reroute, gram, rtol=1e-4)
        assert_gram_close(layer_stats.gram_reroute_normalized, normalized, rtol=1e-4)
        assert not torch.allclose(layer_stats.gram_reroute, layer_stats.gram)  # rerouting changes the Gram


def test_unrenormalized_approximation_differs_from_the_pruned_router_only_by_the_softmax_denominator():
    """The documented approximation for qwen2_moe: the pruned router scales the weights by 1 / (1 - p_removed)."""
    layers, _, inputs = collect_with_inputs("qwen2_moe", [random_ids(seed=3)])
    layer, hidden = layers[0], inputs[0]
    for t in range(3):
        removed = int(layer.router(hidden[t : t + 1])[2][0, 0])
        true_weights, true_ids = by_pruned_router(layer, hidden[t], removed)
        approx_weights, approx_ids = by_unrenormalized_softmax(layer, hidden[t], removed)
        p_removed = float(torch.softmax(hidden[t].float() @ layer.router.weight.float().T, -1)[removed])
        assert sorted(true_ids) == sorted(approx_ids)
        order = [approx_ids.index(e) for e in true_ids]
        expected = [approx_weights[i] / (1 - p_removed) for i in order]
        assert true_weights == pytest.approx(expected, rel=1e-5)


def test_reroute_statistics_leave_the_other_statistics_unchanged_and_merge_exactly():
    model = make_model("deepseek_v3")
    ids = random_ids(seed=5)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    plain = collect_stats(model, [{"input_ids": ids, "attention_mask": mask}])
    padded = collect_stats(model, [{"input_ids": ids, "attention_mask": mask}], reroute=True)
    first, second = collect_stats(model, [ids[0:1]], reroute=True), collect_stats(model, [ids[1:2, :9]], reroute=True)
    merged = first.merge(second)
    for p, a, m in zip(plain.layers, padded.layers, merged.layers):
        for key, value in p.tensors().items():
            assert torch.equal(a.tensors()[key], value), key
        for key in REROUTE_TENSORS:
            assert p.tensors().get(key) is None
            assert_gram_close(getattr(m, key), getattr(a, key), rtol=1e-5)


def test_reroute_statistics_round_trip_and_old_files_still_load(tmp_path):
    stats = collect_stats(make_model("qwen3_moe"), [random_ids(seed=2)], reroute=True)
    loaded = MoEStats.load(stats.save(tmp_path / "new.safetensors"))
    for a, b in zip(loaded.layers, stats.layers):
        for key in REROUTE_TENSORS:
            assert torch.equal(getattr(a, key), getattr(b, key))
    old = dataclasses.replace(stats, layers=[dataclasses.replace(layer, extra={}) for layer in stats.layers])
    old_loaded = MoEStats.load(old.save(tmp_path / "old.safetensors"))
    assert all(layer.gram_reroute is None and layer.gram_reroute_normalized is None for layer in old_loaded.layers)
    assert plan_pruning(old_loaded, 0.5) == plan_pruning(stats, 0.5)
    with pytest.raises(ValueError, match=r"Method 'omp_reroute' needs rerouting-aware statistics \('gram_reroute_normalized'\)"
                       r", which these statistics lack \(layers \['model.layers.1.mlp', 'model.layers.2.mlp'\]\)\. "
                       r"Collect them with ompmoe.collect_stats\(model, batches, reroute=True\) or ExpertPruning\(\.\.\., reroute=True\)\."):
        plan_pruning(old_loaded, 0.5, method="omp_reroute")


@pytest.mark.parametrize("case", ["qwen3_moe", "glm4_moe"])
def test_omp_reroute_is_the_pursuit_on_the_rerouting_aware_gram(case):
    stats = collect_stats(make_model(case), [random_ids(seed=4)], reroute=True)
    normalized = get_method("omp_reroute").select(stats.layers)
    plain = get_method("omp_reroute", {"token_normalized": False}).select(stats.layers)
    for layer, a, b in zip(stats.layers, normalized, plain):
        assert a.tolist() == greedy_pursuit(layer.gram_reroute_normalized, layer.num_groups).order.tolist()
        assert b.tolist() == greedy_pursuit(layer.gram_reroute, layer.num_groups).order.tolist()
    plan = plan_pruning(stats, 0.5, method="omp_reroute")
    assert plan.method == "omp_reroute" and plan.achieved_ratio == pytest.approx(0.5)


def test_reroute_refuses_a_router_without_top_k():
    model = make_model("qwen3_moe")
    layers = find_moe_layers(model)
    del layers[0].router.top_k
    with pytest.raises(RerouteError, match=r"reroute=True needs a router with an integer `top_k` attribute; the router of "
                       r"model.layers.1.mlp \(Qwen3MoeTopKRouter\) has none\. Collect without reroute\."):
        check_reroutable(layers)
