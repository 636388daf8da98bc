"""LongCat-Flash's zero-computation (identity) experts against literal computations: router ids past the routed
experts whose "expert" returns its input are never measured nor pruned, like shared experts
(:mod:`ompmoe.engine.identity_experts`). Each routed pair's output is computed here from the fused weights as LongCat's
forward computes it; the matrix (tests/engine/test_every_moe.py) and layer by layer (tests/engine/test_layerwise.py)
cover the type as every other."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import ompmoe
from ompmoe.engine.apply.adaptive import adaptive_report, enable_adaptive
from ompmoe.engine.apply.compensation import compensation_sums
from ompmoe.engine.apply.trial import pruned_view
from ompmoe.engine.export.plots import high_contribution_experts
from ompmoe.engine.methods.reroute.statistics import RerouteError
from ompmoe.engine.tiny import tiny_model

from reference import assert_compensation_sums, assert_gram_close, assert_loss_sums, output_gradients, random_ids, router_inputs
from test_adaptive import literal_kept_slots
from test_every_moe import STOCK_LOAD

MODEL_TYPE = "longcat_flash"


def model_of() -> torch.nn.Module:
    return tiny_model(MODEL_TYPE)


@torch.no_grad()
def literal_output(layer, token: torch.Tensor, expert: int) -> torch.Tensor:
    """``F_e(x)`` from the fused weights (``act(gate) * up`` of ``gate_up_proj``'s halves, then ``down_proj``), or
    ``x`` itself for an identity expert; float64."""
    if expert >= layer.num_experts:
        return token.double()
    experts = layer.experts
    gate, up = (token @ experts.gate_up_proj[expert].T).chunk(2, dim=-1)
    return ((experts.act_fn(gate) * up) @ experts.down_proj[expert].T).double()


def sliced_router(layer, kept: list[int]):
    """The stock router with its classifier and correction-bias rows cut to ``kept``, then the identity experts' rows,
    as pruning must leave it."""
    router = copy.deepcopy(layer.router)
    rows = torch.tensor([*kept, *range(layer.num_experts, layer.num_experts + layer.identity_experts)])
    router.classifier.weight = torch.nn.Parameter(router.classifier.weight.detach()[rows])
    router.e_score_correction_bias = router.e_score_correction_bias[rows]
    router.n_routed_experts = len(rows)
    return router


@torch.no_grad()
def test_statistics_measure_the_routed_experts_pairs_and_leave_the_identity_pairs_out():
    """Gram, routing mass, routed-token counts and ``||F||^2`` sums over the routed experts' pairs only; the block's
    output while measured is the stock one (the next layer's sums start from the stock inputs)."""
    model = model_of()
    ids = random_ids(batch=2, seq=16, seed=1)
    stats = ompmoe.collect_stats(model, [ids], progress=False)
    identity_pairs = 0
    for layer, layer_stats, hidden in zip(ompmoe.find_moe_layers(model), stats.layers, router_inputs(model, ids)):
        assert layer.identity_experts == 2 and layer_stats.num_experts == layer.num_experts == 8
        _, weights, index = layer.router(hidden)
        n = layer.num_experts
        atoms = torch.zeros(n, hidden.shape[0], hidden.shape[1], dtype=torch.float64)
        mass, count, energy = (torch.zeros(n, dtype=torch.float64) for _ in range(3))
        for token in range(hidden.shape[0]):
            for slot in range(index.shape[1]):
                expert, weight = int(index[token, slot]), float(weights[token, slot])
                if expert >= n:
                    identity_pairs += 1
                    continue
                output = literal_output(layer, hidden[token], expert)
                atoms[expert, token] = weight * output
                mass[expert] += weight
                count[expert] += 1
                energy[expert] += float(output @ output)
        flat = atoms.reshape(n, -1)
        assert_gram_close(layer_stats.gram, flat @ flat.T, rtol=1e-4)
        torch.testing.assert_close(layer_stats.routing_mass, mass, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(layer_stats.token_count, count, rtol=0, atol=0)
        torch.testing.assert_close(layer_stats.sq_norm_sum, energy, rtol=1e-4, atol=1e-6)
    assert identity_pairs > 0 and stats.num_tokens == ids.numel()
    rows = high_contribution_experts(stats, threshold=1.1)  # every layer: the share of tokens of its first expert
    assert [row.token_share for row in rows] == [
        float(stats.layer(row.layer).token_count[row.expert]) / stats.num_tokens for row in rows] and len(rows) == 2


def test_loss_aware_sums_equal_literal_autograd_over_the_routed_experts_atoms():
    model = model_of()
    ids = random_ids(seed=4)
    stats = ompmoe.collect_stats(model, [ids], loss_aware=True, progress=False)
    layers = ompmoe.find_moe_layers(model)
    for layer, layer_stats, (hidden, grad) in zip(layers, stats.layers,
                                                  output_gradients(model, ids, [layer.experts for layer in layers])):
        n = layer.num_experts
        token_atoms = []
        with torch.no_grad():
            _, weights, index = layer.router(hidden)
            for token in range(hidden.shape[0]):
                atoms = torch.zeros(n, hidden.shape[1], dtype=torch.float64)
                for slot, expert in enumerate(index[token].tolist()):
                    if expert < n:
                        atoms[expert] = float(weights[token, slot]) * literal_output(layer, hidden[token], expert)
                token_atoms.append(atoms)
        assert_loss_sums(layer_stats, token_atoms, grad)


@torch.no_grad()
def test_pruning_keeps_the_identity_experts_rows_after_the_kept_ones_and_routes_as_the_literal_sliced_router():
    model = model_of()
    ids = random_ids(batch=2, seq=16, seed=2)
    stats = ompmoe.collect_stats(model, [ids], progress=False)
    plan = ompmoe.plan_pruning(stats, 0.5, allocation="waterfill", min_kept_fraction=0.125, max_kept_fraction=1.0)
    assert len({len(kept) for kept in plan.kept_by_layer().values()}) > 1  # per-layer counts
    originals = ompmoe.find_moe_layers(model)
    with pruned_view(model, plan):
        viewed = model(ids).logits
    pruned = ompmoe.prune(model_of(), plan)
    torch.testing.assert_close(pruned(ids).logits, viewed, rtol=0, atol=0)
    outputs: list[torch.Tensor] = []
    handles = [layer.experts.register_forward_hook(lambda module, args, output: outputs.append(output))
               for layer in ompmoe.find_moe_layers(pruned)]
    try:
        pruned(ids)
    finally:
        for handle in handles:
            handle.remove()
    for layer, original, layer_plan, output, layer_inputs in zip(ompmoe.find_moe_layers(pruned), originals,
                                                                  plan.layers, outputs, router_inputs(pruned, ids)):
        kept = sorted(int(e) for e in layer_plan.kept)
        k, z = len(kept), original.identity_experts
        assert (layer.num_experts, layer.identity_experts, layer.experts.total_experts) == (k, z, k + z)
        assert layer.router.n_routed_experts == k + z and layer.router.classifier.weight.shape[0] == k + z
        rows = [*kept, *range(original.num_experts, original.num_experts + z)]
        assert torch.equal(layer.experts.gate_up_proj, original.experts.gate_up_proj[rows])
        assert torch.equal(layer.experts.down_proj, original.experts.down_proj[kept])
        assert torch.equal(layer.router.e_score_correction_bias, original.router.e_score_correction_bias[rows])
        # the pruned block's output, token by token from the stock router sliced by hand; its inputs are the pruned
        # model's own (the layers before changed them)
        _, weights, index = sliced_router(original, kept)(layer_inputs)
        for token in range(layer_inputs.shape[0]):
            expected = sum(float(weights[token, s]) * literal_output(
                original, layer_inputs[token], rows[int(index[token, s])]) for s in range(index.shape[1]))
            torch.testing.assert_close(output[token].double(), expected, rtol=1e-4, atol=1e-5)
    assert pruned.config.n_routed_experts == max(len(kept) for kept in plan.kept_by_layer().values())
    assert pruned.config.zero_expert_num == 2


def test_a_pruned_checkpoint_loads_in_stock_transformers_in_a_fresh_process(tmp_path):
    """Uniform (the stock class) and per-layer counts (its remote code) with the logits ompmoe's model had; six of
    eight kept leave eight rows in ``gate_up_proj`` (six and the two identity experts'), as many as the original
    routed experts: the layer-by-layer writer writes it as the resident one."""
    from ompmoe.engine.export.streamed import save_pruned_from_files
    from test_layerwise import assert_same_checkpoint

    model = model_of()
    ids = random_ids(batch=2, seq=16, seed=3)
    model.save_pretrained(tmp_path / "source")
    stats = ompmoe.collect_stats(model, [ids], model_id=str(tmp_path / "source"), progress=False)
    plans = {"uniform": ompmoe.plan_pruning(stats, 0.25, allocation="uniform"),
             "waterfill": ompmoe.plan_pruning(stats, 0.25, allocation="waterfill", min_kept_fraction=0.125,
                                              max_kept_fraction=1.0)}
    assert [len(kept) for kept in plans["uniform"].kept_by_layer().values()] == [6, 6]
    expected = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, plan in plans.items():
            pruned = ompmoe.prune(model_of(), plan)
            ompmoe.save_pruned(pruned, tmp_path / name)
            with torch.no_grad():
                expected[name] = pruned(ids).logits
        save_pruned_from_files(tmp_path / "source", plans["uniform"], tmp_path / "streamed")
    assert_same_checkpoint(tmp_path / "uniform", tmp_path / "streamed")
    torch.save(ids, tmp_path / "ids.pt")
    (tmp_path / "script.py").write_text(STOCK_LOAD)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               PARENT_TORCH_THREADS=str(torch.get_num_threads()))
    done = subprocess.run([sys.executable, "-I", "script.py", str(tmp_path), "AutoModelForCausalLM",
                           str(tmp_path / "ids.pt"), str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["ompmoe"] is False
    assert results["uniform"] == "LongcatFlashForCausalLM"
    assert results["waterfill"] == "OmpmoePrunedLongcatFlashForCausalLM" and "waterfill-refused" in results
    for name in plans:
        torch.testing.assert_close(torch.load(tmp_path / f"{name}.pt"), expected[name], rtol=0, atol=0)


@torch.no_grad()
def test_compensation_sums_leave_the_identity_part_of_the_pruned_routing_fixed():
    """The kept experts' contributions ``g' F`` under the sliced router against the unpruned block's output less
    what the pruned routing's identity pairs add (``g' x``, which no down projection corrects)."""
    model = model_of()
    ids = random_ids(batch=2, seq=16, seed=5)
    stats = ompmoe.collect_stats(model, [ids], progress=False)
    plan = ompmoe.plan_pruning(stats, 0.5, allocation="waterfill")
    sums = compensation_sums(model, plan, ids, granularity="expert")
    fixed_somewhere = False
    for layer, layer_plan, layer_sums, hidden in zip(ompmoe.find_moe_layers(model), plan.layers, sums.layers,
                                                      router_inputs(model, ids)):
        kept = sorted(int(e) for e in layer_plan.kept)
        _, weights, index = layer.router(hidden)
        _, pruned_weights, pruned_index = sliced_router(layer, kept)(hidden)
        k = len(kept)
        tokens = []
        for token in range(hidden.shape[0]):
            target = sum(float(weights[token, s]) * literal_output(layer, hidden[token], int(index[token, s]))
                         for s in range(index.shape[1]))
            contributions = torch.zeros(k, hidden.shape[1], dtype=torch.float64)
            for slot, j in enumerate(pruned_index[token].tolist()):
                weight = float(pruned_weights[token, slot])
                if j >= k:
                    target = target - weight * hidden[token].double()
                    fixed_somewhere = True
                else:
                    contributions[j] = weight * literal_output(layer, hidden[token], kept[j])
            tokens.append((contributions, target))
        assert_compensation_sums(layer_sums, tokens)
    assert fixed_somewhere


@torch.no_grad()
def test_omp_moe_plus_runs_every_identity_pair_and_the_literal_rule_over_the_routed_experts_pairs():
    model = model_of()
    stats = ompmoe.collect_stats(model, [random_ids(batch=4, seq=32, seed=7)], progress=False)
    epsilon = 0.3
    enable_adaptive(model, stats, epsilon)
    layers = ompmoe.find_moe_layers(model)
    calls: list[list] = []
    handles = [layer.experts.register_forward_pre_hook(lambda module, args: calls.append([args]), prepend=True)
               for layer in layers]
    handles += [layer.experts.register_forward_hook(lambda module, args, output: calls[-1].append(output))
                for layer in layers]
    try:
        model(random_ids(seed=6))
    finally:
        for handle in handles:
            handle.remove()
    skipped = identity_kept = 0
    report = adaptive_report(model)
    for layer, ((hidden, index, weights), output) in zip(layers, calls):
        alphas = stats.layer(layer.name).alpha.tolist()
        n = layer.num_experts
        kept_pairs = native_pairs = 0
        per_token = []
        for token in range(hidden.shape[0]):
            routed = [s for s in range(index.shape[1]) if int(index[token, s]) < n]
            identity = [s for s in range(index.shape[1]) if int(index[token, s]) >= n]
            kept = [routed[j] for j in literal_kept_slots([float(weights[token, s]) for s in routed],
                                                          [int(index[token, s]) for s in routed], alphas, epsilon)
                    ] if routed else []
            skipped += len(routed) - len(kept)
            identity_kept += len(identity)
            kept_pairs += len(kept)
            native_pairs += len(routed)
            per_token.append(len(kept))
            expected = sum((float(weights[token, s]) * literal_output(layer, hidden[token], int(index[token, s]))
                            for s in [*kept, *identity]), torch.zeros(hidden.shape[1], dtype=torch.float64))
            torch.testing.assert_close(output[token].double(), expected, rtol=1e-5, atol=1e-6)
        # the counters count the routed experts' pairs: identity pairs cost nothing, kept or native
        counts = report[layer.name]
        assert (counts["kept_pairs"], counts["native_pairs"], counts["tokens"]) == (kept_pairs, native_pairs,
                                                                                   hidden.shape[0])
        assert counts["flops_ratio"] == pytest.approx(kept_pairs / native_pairs)
        assert counts["histogram"] == torch.bincount(torch.tensor(per_token), minlength=layer.top_k + 1).tolist()
    assert skipped > 0 and identity_kept > 0


def test_rerouting_aware_statistics_are_refused_naming_the_identity_experts():
    model = model_of()
    with pytest.raises(RerouteError) as refused:
        ompmoe.collect_stats(model, [random_ids(seed=1)], reroute=True, progress=False)
    assert str(refused.value) == (
        "reroute=True is not supported on zero-computation (identity) experts: model.layers.0.mlp has 2, which may "
        "take a pruned expert's slot. Collect without reroute.")
