"""Llama 4's blocks, whose routing weights scale the experts' input, against literal computations with the stock
modules: every atom is ``F_e(g x)`` as the stock experts call computes it on a stack holding only that pair's scaled
token (:mod:`ompmoe.engine.input_weighted`). The statistics, the per-layer pruned checkpoint and its reload are in
tests/engine/test_every_moe.py, layer by layer in tests/engine/test_layerwise.py."""

from __future__ import annotations

import copy

import torch

import ompmoe
from ompmoe.engine.apply.adaptive import adaptive_report, disable_adaptive, enable_adaptive
from ompmoe.engine.apply.compensation import compensation_sums
from ompmoe.engine.input_weighted import pair_intermediates, pair_outputs, routed_form
from ompmoe.engine.tiny import tiny_model

from reference import assert_compensation_sums, assert_gram_close, assert_loss_sums, output_gradients, random_ids, router_inputs
from test_reroute import add_removal_products

TOP_K = 3
"""More than one expert per token (Llama 4's releases route to one), so that rerouting and OMP-MoE+ have slots."""


def model_of(**overrides) -> torch.nn.Module:
    return tiny_model("llama4_text", num_experts_per_tok=TOP_K, **overrides)


@torch.no_grad()
def stock_atom(layer, hidden_row: torch.Tensor, expert: int, weight: torch.Tensor) -> torch.Tensor:
    """``F_e(g x)`` from the stock experts forward (no hooks, no routed form) on a stack with the scaled token at
    ``expert`` and zeros elsewhere."""
    stack = torch.zeros(layer.num_experts, hidden_row.shape[-1], dtype=hidden_row.dtype)
    stack[expert] = hidden_row * weight
    return type(layer.experts).forward(layer.experts, stack)[expert].double()


def test_pair_outputs_and_intermediates_are_the_stock_experts_call_pair_by_pair():
    model = model_of()
    layer = ompmoe.find_moe_layers(model)[0]
    hidden = router_inputs(model, random_ids(seed=1))[0]
    with torch.no_grad():
        scores, logits = layer.router(hidden)
        ids = torch.topk(logits, TOP_K, dim=1).indices
        weights = scores.gather(1, ids)
        atoms = pair_outputs(layer.experts, hidden, ids, weights)
        inner = pair_intermediates(layer.experts, hidden, ids, weights).view(*ids.shape, -1)
    assert atoms.shape == (hidden.shape[0], TOP_K, hidden.shape[1])
    for token in range(hidden.shape[0]):
        for slot in range(TOP_K):
            expert = int(ids[token, slot])
            expected = stock_atom(layer, hidden[token], expert, weights[token, slot])
            torch.testing.assert_close(atoms[token, slot].double(), expected, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close((inner[token, slot] @ layer.experts.down_proj[expert]).double(), expected,
                                       rtol=1e-5, atol=1e-7)


def test_the_routed_form_computes_the_stock_block_and_gives_the_stock_forwards_back():
    model = model_of()
    layers = ompmoe.find_moe_layers(model)
    ids = random_ids(seed=2)
    with torch.no_grad():
        stock = model(ids).logits
        with routed_form(layers):
            assert all("forward" in vars(layer.block) and "forward" in vars(layer.experts) for layer in layers)
            with routed_form(layers):  # nested: the outer one ends it
                pass
            assert all("forward" in vars(layer.block) for layer in layers)
            routed = model(ids).logits
    torch.testing.assert_close(routed, stock, rtol=1e-5, atol=1e-6)
    assert not any("forward" in vars(module) for layer in layers for module in (layer.block, layer.experts))


def by_pruned_router(layer, hidden_row: torch.Tensor, removed: int) -> list[tuple[int, torch.Tensor]]:
    """``(expert, weight)`` pairs the router routes the token to once ``removed`` is sliced out, as ``prune`` does."""
    router = copy.deepcopy(layer.router)
    kept = torch.tensor([e for e in range(layer.num_experts) if e != removed])
    router.weight = torch.nn.Parameter(router.weight.detach()[kept])
    scores, logits = router(hidden_row[None])
    return [(int(kept[j]), scores[0, j]) for j in torch.topk(logits[0], TOP_K).indices.tolist()]


@torch.no_grad()
def test_rerouting_aware_grams_equal_literal_single_removals():
    """Removing one of a token's experts hands its slot to the next by logit, with that expert's own score (Llama 4's
    sigmoid scores are not renormalized): the Grams of ``Y - Y'`` equal the pruned router's, one removal at a time."""
    model = model_of()
    ids = random_ids(seed=3)
    stats = ompmoe.collect_stats(model, [ids], reroute=True, progress=False)
    for layer, layer_stats, hidden in zip(ompmoe.find_moe_layers(model), stats.layers, router_inputs(model, ids)):
        n = layer.num_experts
        gram = torch.zeros(n, n, dtype=torch.float64)
        normalized = torch.zeros(n, n, dtype=torch.float64)
        scores, logits = layer.router(hidden)
        for token in range(hidden.shape[0]):
            experts = torch.topk(logits[token], TOP_K).indices.tolist()
            atoms = [stock_atom(layer, hidden[token], e, scores[token, e]) for e in experts]
            full = sum(atoms)
            deltas = {removed: full - sum(stock_atom(layer, hidden[token], e, g)
                                          for e, g in by_pruned_router(layer, hidden[token], removed))
                      for removed in experts}
            add_removal_products(gram, normalized, atoms, deltas)
        assert_gram_close(layer_stats.gram_reroute, gram, rtol=1e-4)
        assert_gram_close(layer_stats.gram_reroute_normalized, normalized, rtol=1e-4)
        assert not torch.allclose(layer_stats.gram_reroute, layer_stats.gram)


def test_loss_aware_sums_equal_literal_autograd():
    """The loss-aware sums take the gradient at each block's routed output: the stock block's output gradient (the
    shared expert's part adds to it, so its gradient is the routed output's), with the literal atoms."""
    model = model_of()
    ids = random_ids(seed=4)
    stats = ompmoe.collect_stats(model, [ids], loss_aware=True, progress=False)
    layers = ompmoe.find_moe_layers(model)
    gradients = output_gradients(model, ids, [layer.block for layer in layers], output_of=lambda output: output[0])
    for layer, layer_stats, (hidden, grad) in zip(layers, stats.layers, gradients):
        n = layer.num_experts
        token_atoms = []
        with torch.no_grad():
            scores, router_logits = layer.router(hidden)
            for token in range(hidden.shape[0]):
                atoms = torch.zeros(n, hidden.shape[1], dtype=torch.float64)
                for e in torch.topk(router_logits[token], TOP_K).indices.tolist():
                    atoms[e] = stock_atom(layer, hidden[token], e, scores[token, e])
                token_atoms.append(atoms)
        assert_loss_sums(layer_stats, token_atoms, grad)


@torch.no_grad()
def test_compensation_sums_equal_the_literal_pruned_block():
    """The compensation's sums: the kept experts' contributions ``F_e(g' x)`` under the router sliced to them, against
    the unpruned block's routed output, token by token with the stock experts call."""
    model = model_of()
    ids = random_ids(batch=2, seq=16, seed=5)
    stats = ompmoe.collect_stats(model, [ids], progress=False)
    plan = ompmoe.plan_pruning(stats, 0.5, allocation="waterfill")
    sums = compensation_sums(model, plan, ids, granularity="expert")
    for layer, layer_plan, layer_sums, hidden in zip(ompmoe.find_moe_layers(model), plan.layers, sums.layers,
                                                      router_inputs(model, ids)):
        kept = sorted(int(e) for e in layer_plan.kept)
        router = copy.deepcopy(layer.router)
        router.weight = torch.nn.Parameter(router.weight.detach()[kept])
        scores, logits = layer.router(hidden)
        pruned_scores, pruned_logits = router(hidden)
        tokens = []
        for token in range(hidden.shape[0]):
            target = sum(stock_atom(layer, hidden[token], e, scores[token, e])
                         for e in torch.topk(logits[token], TOP_K).indices.tolist())
            contributions = torch.zeros(len(kept), hidden.shape[1], dtype=torch.float64)
            for j in torch.topk(pruned_logits[token], TOP_K).indices.tolist():
                contributions[j] = stock_atom(layer, hidden[token], kept[j], pruned_scores[token, j])
            tokens.append((contributions, target))
        assert_compensation_sums(layer_sums, tokens)


@torch.no_grad()
def test_omp_moe_plus_keeps_the_literal_rules_experts_and_switched_off_is_the_stock_model():
    """OMP-MoE+ ranks a token's experts by ``g^2 alpha_e`` (``alpha_e`` the mean of ``||F_e(g x) / g||^2``) and keeps
    the shortest prefix covering ``1 - epsilon``: the block's routed output is the kept pairs' stock ``F_e(g x)``."""
    from test_adaptive import literal_kept_slots

    model = model_of()
    ids = random_ids(seed=6)
    stock = model(ids).logits
    stats = ompmoe.collect_stats(model, [random_ids(batch=4, seq=32, seed=7)], progress=False)
    epsilon = 0.3
    enable_adaptive(model, stats, epsilon)
    layers = ompmoe.find_moe_layers(model)
    calls = []
    handles = [layer.experts.register_forward_pre_hook(lambda module, args: calls.append([args]), prepend=True)
               for layer in layers]
    handles += [layer.experts.register_forward_hook(lambda module, args, output: calls[-1].append(output))
                for layer in layers]
    try:
        model(ids)
    finally:
        for handle in handles:
            handle.remove()
    skipped = 0
    for layer, ((hidden, index, weights), output) in zip(layers, calls):
        alphas = stats.layer(layer.name).alpha.tolist()
        for token in range(hidden.shape[0]):
            slots = literal_kept_slots(weights[token].double().tolist(), index[token].tolist(), alphas, epsilon)
            skipped += TOP_K - len(slots)
            expected = sum(stock_atom(layer, hidden[token], int(index[token, s]), weights[token, s]) for s in slots)
            torch.testing.assert_close(output[token].double(), expected, rtol=1e-5, atol=1e-6)
        assert adaptive_report(model)[layer.name]["tokens"] == hidden.shape[0]
    assert skipped > 0
    disable_adaptive(model)
    assert not any("forward" in vars(module) for layer in layers for module in (layer.block, layer.experts))
    assert torch.equal(model(ids).logits, stock)


def test_a_block_without_tokens_gives_no_pairs():
    model = model_of()
    layer = ompmoe.find_moe_layers(model)[0]
    empty = torch.zeros(0, model.config.hidden_size)
    ids, weights = torch.zeros(0, TOP_K, dtype=torch.long), torch.zeros(0, TOP_K)
    assert pair_outputs(layer.experts, empty, ids, weights).shape == (0, TOP_K, model.config.hidden_size)


@torch.no_grad()
def test_nested_users_of_the_routed_form_leave_it_to_the_last():
    """Statistics collected while OMP-MoE+ is on, and OMP-MoE+ switched on or off while statistics are collected:
    each holds the routed form until it is done, and the stock forwards come back when the last is."""
    from ompmoe.engine.collect.collector import StatisticsCollector

    model = model_of()
    layers = ompmoe.find_moe_layers(model)
    ids = random_ids(seed=8)
    stock = model(ids).logits
    stats = ompmoe.collect_stats(model, [ids], progress=False)
    collector = StatisticsCollector(model)
    with collector:  # switched on inside: still on after
        enable_adaptive(model, stats, 0.3)
    on = model(ids).logits
    assert not torch.equal(on, stock) and adaptive_report(model)[layers[0].name]["tokens"] == ids.numel()
    with collector:  # switched off inside: the statistics still see this forward, and the context ends cleanly
        disable_adaptive(model)
        collector.forward({"input_ids": ids})
    assert float(collector.result().num_tokens) == ids.numel()
    assert not any("forward" in vars(module) for layer in layers for module in (layer.block, layer.experts))
    assert torch.equal(model(ids).logits, stock)


def test_the_benchmark_runs_the_three_passes_and_the_routed_form_gives_the_stock_logits(tmp_path, capsys):
    """benchmarks/llama4_routed_form.py on a small shape: every pass timed, the table printed, the JSON written."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import llama4_routed_form

    result = llama4_routed_form.main(["--experts", "4", "--layers", "1", "--hidden", "64", "--intermediate", "64",
                                      "--tokens", "64", "--seq_len", "32", "--repeats", "1",
                                      "--output", str(tmp_path / "result.json")])
    assert json.loads((tmp_path / "result.json").read_text()) == result
    run = result["runs"][0]
    assert run["experts"] == 4 and set(run["cpu_s"]) == {"stock", "routed", "stats"}
    assert run["routed_logits_max_abs_difference"] < 1e-5
    assert "| 4 |" in capsys.readouterr().out
