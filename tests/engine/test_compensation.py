"""Compensation after pruning, checked against literal least squares on cached block outputs.

The reference runs the unpruned and the really pruned (``ompmoe.prune``) blocks on the same cached inputs, takes
each kept expert's contribution by zeroing every other expert's down projection, and solves the least squares in
float64 by hand: nothing of ``ompmoe.engine.apply.compensation`` is reused.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager

import pytest
import torch
import transformers
from torch import nn

import ompmoe
from ompmoe.engine.adapters import architecture_of
from ompmoe.engine.apply.compensation import (
    MAX_SUM_BYTES, Compensation, CompensationError, _count_tokens, _LayerPass, apply_compensation, compensate,
    compensated_view, compensation_record, compensation_sums, fit_scales, fitting_tokens, heldout_losses,
    linear_sum_bytes, spread_blocks,
)
from ompmoe.engine.perplexity import perplexity
from ompmoe.engine.planning.plan import PlanMismatchError
from ompmoe.engine.collect.statistics import FingerprintMismatchError
from ompmoe.engine.tiny import tiny_model

from reference import capture_block_inputs, random_ids

# Softmax (Qwen3), sigmoid with groups, correction bias and a shared expert (GLM-4.5), transposed experts with
# biases (GPT-OSS).
CASES = ["qwen3_moe", "glm4_moe", "gpt_oss"]


def setup(model_type: str, allocation: str = "waterfill") -> tuple[nn.Module, ompmoe.PruningPlan]:
    model = tiny_model(model_type)
    stats = ompmoe.collect_stats(model, [random_ids(seed=s) for s in range(3)])
    plan = ompmoe.plan_pruning(stats, 0.5, method="omp", allocation=allocation, min_kept_fraction=0.25)
    return model, plan


def routed(layer: ompmoe.MoELayer, hidden: torch.Tensor) -> torch.Tensor:
    """The block's output without its shared experts (float64), on flattened inputs ``(T, d)``."""
    block = layer.block
    out = block(hidden.unsqueeze(0))
    out = out[0] if isinstance(out, tuple) else out
    out = out.reshape(-1, hidden.shape[-1])
    for name in ("shared_experts", "shared_expert"):
        shared = getattr(block, name, None)
        if shared is not None:
            extra = shared(hidden)
            gate = getattr(block, "shared_expert_gate", None)
            out = out - (torch.sigmoid(gate(hidden)) * extra if gate is not None else extra)
    return out.double()


@contextmanager
def only_expert(layer: ompmoe.MoELayer, index: int):
    """Every expert but ``index`` puts out zero (its down projection and bias zeroed meanwhile)."""
    saved = {n: p.detach().clone() for n, p in layer.experts.named_parameters(recurse=False)
             if n.startswith("down_proj")}
    with torch.no_grad():
        for name in saved:
            parameter = getattr(layer.experts, name)
            mask = torch.zeros(parameter.shape[0], dtype=torch.bool)
            mask[index] = True
            parameter[~mask] = 0
    try:
        yield
    finally:
        with torch.no_grad():
            for name, value in saved.items():
                getattr(layer.experts, name).copy_(value)


@torch.no_grad()
def literal(model: nn.Module, pruned: nn.Module, ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Per MoE layer, on the unpruned model's block inputs: ``Y`` (unpruned routed output), ``C`` (T*d, K) the pruned
    block's per-kept-expert contributions (rerouting and renormalization included)."""
    layers, pruned_layers = ompmoe.find_moe_layers(model), ompmoe.find_moe_layers(pruned)
    with capture_block_inputs(layers) as captured:
        model(ids, use_cache=False)
    result = []
    for layer, pruned_layer, inputs in zip(layers, pruned_layers, captured):
        hidden = torch.cat(inputs)
        contributions = []
        for index in range(pruned_layer.num_experts):
            with only_expert(pruned_layer, index):
                contributions.append(routed(pruned_layer, hidden).reshape(-1))
        result.append({"Y": routed(layer, hidden).reshape(-1), "C": torch.stack(contributions, dim=1),
                       "pruned": routed(pruned_layer, hidden).reshape(-1), "hidden": hidden})
    return result


def literal_scales(Y: torch.Tensor, C: torch.Tensor, ridge: float) -> tuple[float, torch.Tensor]:
    """The per-layer factor ``<Y', Y> / ||Y'||^2`` and the per-expert ridge solution, by augmented least squares."""
    pruned = C.sum(1)
    layer = float(pruned @ Y / (pruned @ pruned))
    active = (C != 0).any(0)  # an expert no token reached is not determined: it keeps the layer's factor
    C = C[:, active]
    diagonal = (C * C).sum(0)
    rows = torch.diag((ridge * diagonal).sqrt())
    A = torch.cat([C, rows])
    b = torch.cat([Y, (ridge * diagonal).sqrt() * layer])
    expert = torch.full((len(active),), layer, dtype=torch.float64)
    expert[active] = torch.linalg.lstsq(A, b.unsqueeze(-1), driver="gelsd").solution.squeeze(-1)
    return layer, expert


def literal_map(Y: torch.Tensor, pruned: torch.Tensor, d: int, ridge: float) -> torch.Tensor:
    """``argmin_M sum_x ||Y(x) - M Y'(x)||^2 + lam ||M - s I||^2``, ``lam = ridge tr(Y'^T Y') / d``, by augmented least
    squares on the rows ``Y'(x)^T M^T = Y(x)^T``."""
    Y, P = Y.view(-1, d), pruned.view(-1, d)
    s = float((P * Y).sum() / (P * P).sum())
    lam = ridge * float((P * P).sum()) / d
    A = torch.cat([P, lam ** 0.5 * torch.eye(d, dtype=P.dtype)])
    B = torch.cat([Y, lam ** 0.5 * s * torch.eye(d, dtype=P.dtype)])
    return torch.linalg.lstsq(A, B, driver="gelsd").solution.T


@pytest.mark.parametrize("model_type", CASES)
def test_factors_equal_literal_least_squares_on_cached_block_outputs(model_type):
    model, plan = setup(model_type)
    pruned = ompmoe.prune(copy.deepcopy(model), plan)
    ids = random_ids(batch=3, seq=16, seed=7)
    reference = literal(model, pruned, ids)
    sums = compensation_sums(model, plan, ids, batch_size=2, granularity="linear")
    assert int(sums.num_tokens) == ids.numel()
    d = model.config.hidden_size
    for ridge in (0.0, 0.1):
        maps = fit_scales(sums, "linear", ridge=ridge)
        for layer_sums, ref in zip(sums.layers, reference):
            expected = literal_map(ref["Y"], ref["pruned"], d, ridge)
            torch.testing.assert_close(maps[layer_sums.name], expected, atol=1e-4, rtol=1e-3)
            after = ref["Y"].view(-1, d) - ref["pruned"].view(-1, d) @ expected.T
            assert layer_sums.residual(maps[layer_sums.name]) == pytest.approx(
                float(after.square().sum() / ref["Y"].square().sum()), rel=1e-4, abs=1e-7)
    per_layer = fit_scales(sums, "layer")
    for ridge in (0.0, 0.5):
        per_expert = fit_scales(sums, "expert", ridge=ridge)
        for layer_sums, ref in zip(sums.layers, reference):
            torch.testing.assert_close(ref["C"].sum(1), ref["pruned"], atol=1e-5, rtol=1e-5)  # the reference holds
            layer, expert = literal_scales(ref["Y"], ref["C"], ridge)
            torch.testing.assert_close(per_layer[layer_sums.name], torch.full_like(expert, layer), rtol=1e-4, atol=0)
            torch.testing.assert_close(per_expert[layer_sums.name], expert, atol=1e-4, rtol=1e-3)
            before = float((ref["Y"] - ref["pruned"]).square().sum() / ref["Y"].square().sum())
            assert layer_sums.residual(torch.ones(len(layer_sums.kept))) == pytest.approx(before, rel=1e-4)
    assert any(abs(s[0] - 1) > 1e-3 for s in per_layer.values())  # a real correction, not the identity


@pytest.mark.parametrize("granularity", ["expert", "linear"])
@pytest.mark.parametrize("model_type", CASES)
def test_folding_gives_exactly_the_corrected_block_output(model_type, granularity):
    model, plan = setup(model_type)
    compensation = compensate(model, plan, random_ids(batch=4, seq=16, seed=3), granularity=granularity, ridge=0.1)
    pruned = ompmoe.prune(copy.deepcopy(model), plan)
    reference = literal(model, pruned, random_ids(batch=2, seq=16, seed=5))
    compensation.apply(pruned)
    for layer, ref in zip(ompmoe.find_moe_layers(pruned), reference):
        correction = compensation.scales[layer.name]
        d = model.config.hidden_size
        if granularity == "linear":
            assert correction.shape == (d, d)
            expected = (ref["pruned"].view(-1, d) @ correction.T).reshape(-1)
        else:
            expected = ref["C"] @ correction
        with torch.no_grad():
            torch.testing.assert_close(routed(layer, ref["hidden"]).reshape(-1), expected, atol=2e-5, rtol=1e-4)
    assert pruned.config.ompmoe["compensation"] == compensation.record
    with pytest.raises(CompensationError, match="compensated already"):
        compensation.apply(pruned)


def test_the_model_is_left_as_it_was_and_the_record_says_what_was_fitted():
    model, plan = setup("glm4_moe")
    ids = random_ids(batch=2, seq=16, seed=4)
    with torch.no_grad():
        before = model(ids).logits
    model.train()
    compensation = compensate(model, plan, random_ids(batch=4, seq=16, seed=3), batch_size=3, max_tokens=None,
                              granularity="layer")
    assert model.training
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    record = compensation.record
    assert record["granularity"] == "layer" and record["num_tokens"] == 64 and record["sequential"] is False
    values = torch.cat(list(compensation.scales.values()))
    assert record["scale_min"] == pytest.approx(float(values.min()))
    assert record["scale_max"] == pytest.approx(float(values.max()))
    assert record["routed_error_after"] < record["routed_error_before"]
    automatic = compensate(model, plan, random_ids(batch=4, seq=16, seed=3), max_tokens=None)  # linear, ridge d / T
    assert automatic.record["ridge"] == pytest.approx(32 / 64)
    assert automatic.record["ridge_rule"] == "hidden_size / tokens"
    assert automatic.record["granularity"] == "linear" and 0 < automatic.record["map_off_diagonal"] < 1
    sums = compensation_sums(model, plan, random_ids(batch=4, seq=16, seed=3), granularity="linear")
    for name, correction in fit_scales(sums, "linear", ridge=0.5).items():
        torch.testing.assert_close(automatic.scales[name], correction)


def test_compensated_checkpoint_reloads_in_stock_transformers_with_identical_logits(tmp_path):
    model, plan = setup("qwen3_moe", allocation="uniform")
    compensation = compensate(model, plan, random_ids(batch=4, seq=16, seed=3))  # the default: a linear map
    pruned = compensation.apply(ompmoe.prune(model, plan))
    ompmoe.save_pruned(pruned, tmp_path / "model")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32).eval()
    ids = random_ids(batch=2, seq=16, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, pruned(ids).logits, atol=0, rtol=0)
    assert reloaded.config.ompmoe["compensation"]["granularity"] == "linear"


def test_sums_over_two_halves_added_equal_sums_over_all_batches():
    model, plan = setup("glm4_moe")
    batches = [random_ids(batch=2, seq=16, seed=s) for s in range(4)]
    whole = compensation_sums(model, plan, batches, granularity="linear")
    first = compensation_sums(model, plan, batches[:2], granularity="linear")
    second = compensation_sums(model, plan, batches[2:], granularity="linear")
    assert any(key.endswith("output_cross") for key in whole.state_dict())
    merged = first + second
    for key, value in whole.state_dict().items():
        torch.testing.assert_close(merged.state_dict()[key], value, rtol=1e-10, atol=1e-9)
    loaded = compensation_sums(model, plan, batches[:1], granularity="linear")
    loaded.load_state_dict({key: value + second.state_dict()[key] for key, value in first.state_dict().items()})
    for key, value in whole.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=1e-10, atol=1e-9)
    # compensate's reduce hook sees each layer's sums (here: doubled, as two identical ranks would sum them)
    doubled = compensate(model, plan, torch.cat(batches), max_tokens=None, ridge=0.1,
                         reduce=lambda states: [t.mul_(2) for t in states.values()])
    single = compensate(model, plan, torch.cat(batches), max_tokens=None, ridge=0.1)
    assert doubled.record["num_tokens"] == 2 * single.record["num_tokens"]
    for name, scales in single.scales.items():
        torch.testing.assert_close(doubled.scales[name], scales)


def test_padding_counts_nothing():
    model, plan = setup("qwen3_moe")
    ids = random_ids(batch=2, seq=16, seed=2)
    padded = torch.cat([ids, torch.zeros(2, 4, dtype=ids.dtype)], dim=1)
    mask = torch.cat([torch.ones(2, 16), torch.zeros(2, 4)], dim=1).long()
    plain = compensation_sums(model, plan, [ids])
    masked = compensation_sums(model, plan, [{"input_ids": padded, "attention_mask": mask}])
    assert int(masked.num_tokens) == 32
    for key, value in plain.state_dict().items():  # right padding: the real tokens' inputs are unchanged
        torch.testing.assert_close(masked.state_dict()[key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type,granularity", [("qwen3_moe", "layer"), ("glm4_moe", "layer"),
                                                    ("glm4_moe", "linear")])
def test_sequential_fits_each_layer_on_the_compensated_pruned_models_inputs(model_type, granularity):
    model, plan = setup(model_type)
    ids = random_ids(batch=4, seq=16, seed=6)
    options = dict(max_tokens=None, granularity=granularity, ridge=0.1)
    sequential = compensate(model, plan, ids, batch_size=2, sequential=True, **options)
    plain = compensate(model, plan, ids, **options)
    first = ompmoe.find_moe_layers(model)[0].name
    torch.testing.assert_close(sequential.scales[first], plain.scales[first])  # same inputs in the first layer
    # The literal check: inputs of each layer in the pruned model compensated with these very corrections.
    pruned = ompmoe.prune(copy.deepcopy(model), plan)
    compensated = sequential.apply(copy.deepcopy(pruned))
    layers = ompmoe.find_moe_layers(model)
    d = model.config.hidden_size
    with capture_block_inputs(ompmoe.find_moe_layers(compensated)) as captured, torch.no_grad():
        compensated(ids, use_cache=False)
    with torch.no_grad():
        for layer, pruned_layer, inputs in zip(layers, ompmoe.find_moe_layers(pruned), captured):
            hidden = torch.cat(inputs)
            Y, Yp = routed(layer, hidden).reshape(-1), routed(pruned_layer, hidden).reshape(-1)
            if granularity == "linear":
                torch.testing.assert_close(sequential.scales[layer.name], literal_map(Y, Yp, d, 0.1),
                                           atol=1e-4, rtol=1e-3)
            else:
                assert float(sequential.scales[layer.name][0]) == pytest.approx(float(Yp @ Y / (Yp @ Yp)), rel=1e-4)
    assert any(not torch.allclose(sequential.scales[n], plain.scales[n]) for n in plain.scales)
    assert sequential.record["sequential"] is True


def test_refuses_a_plan_of_another_model_bad_options_and_unpruned_targets():
    model, plan = setup("qwen3_moe")
    other = tiny_model("qwen3_moe", num_experts=8, num_experts_per_tok=2)
    ids = random_ids(batch=2, seq=16, seed=1)
    with pytest.raises(FingerprintMismatchError, match="made for a different model.*before ompmoe.prune"):
        compensate(other, plan, ids)
    pruned = ompmoe.prune(copy.deepcopy(model), plan)
    with pytest.raises(FingerprintMismatchError, match="different model"):
        compensate(pruned, plan, ids)  # a pruned model: compensation fits on the unpruned one
    broken = copy.deepcopy(plan)
    broken.layers[0].kept = broken.layers[0].kept + [broken.layers[0].kept[0]]
    with pytest.raises(PlanMismatchError, match="listed twice"):
        compensate(model, broken, ids)
    with pytest.raises(CompensationError, match="granularity must be one of layer, expert, linear"):
        compensate(model, plan, ids, granularity="token")
    with pytest.raises(CompensationError, match="ridge must be"):
        compensate(model, plan, ids, ridge=-1.0)
    with pytest.raises(CompensationError, match="max_tokens must be a positive int, 'auto' or None"):
        compensate(model, plan, ids, max_tokens=0)
    with pytest.raises(CompensationError, match=r"\(num_blocks, seq_len\)"):
        compensate(model, plan, ids[0])
    compensation = compensate(model, plan, ids)
    with pytest.raises(CompensationError, match="pruned model"):
        compensation.apply(copy.deepcopy(model))
    other_plan = ompmoe.plan_pruning(ompmoe.collect_stats(model, [ids]), 0.25, method="reap")
    with pytest.raises(CompensationError, match="fit it with the plan the model was pruned with"):
        compensation.apply(ompmoe.prune(copy.deepcopy(model), other_plan))
    bare = {name: torch.full((len(ids_),), float("nan")) for name, ids_ in compensation.kept.items()}
    with pytest.raises(CompensationError, match="not all finite"):
        apply_compensation(copy.deepcopy(pruned), bare, kept=compensation.kept)
    wrong = {name: torch.eye(5) for name in compensation.kept}
    with pytest.raises(CompensationError, match=r"expected \(32, 32\)"):
        apply_compensation(copy.deepcopy(pruned), wrong, kept=compensation.kept)
    with pytest.raises(CompensationError, match="needs the output sums"):
        fit_scales(compensation_sums(model, plan, ids, granularity="layer"), "linear")
    assert isinstance(compensation, Compensation)


def test_spread_blocks_takes_evenly_spaced_blocks_and_auto_fits_on_16_tokens_per_dimension():
    blocks = torch.arange(10).view(10, 1).expand(10, 4)
    assert spread_blocks(blocks, 12)[:, 0].tolist() == [0, 4, 9]
    assert spread_blocks(blocks, 400).shape[0] == 10
    model, plan = setup("qwen3_moe")
    assert fitting_tokens(model) == 16 * 32 and fitting_tokens(model, calibration_tokens=1000) == 250
    ids = random_ids(batch=40, seq=16, seed=2)  # 640 tokens: "auto" takes 512, i.e. 32 evenly spaced blocks
    assert compensate(model, plan, ids).record["num_tokens"] == 512
    assert compensate(model, plan, ids, max_tokens=None).record["num_tokens"] == 640


@pytest.mark.parametrize("model_type", ["glm4_moe", "gpt_oss"])
def test_compensated_view_computes_the_pruned_compensated_model_and_restores_the_weights(model_type):
    model, plan = setup(model_type)
    compensation = compensate(model, plan, random_ids(batch=4, seq=16, seed=3))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    pruned = ompmoe.prune(copy.deepcopy(model), plan)
    compensated = compensation.apply(copy.deepcopy(pruned))
    ids = random_ids(batch=2, seq=16, seed=8)
    with torch.no_grad(), compensated_view(model, plan, compensation):
        torch.testing.assert_close(model(ids).logits, compensated(ids).logits, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    without, with_ = heldout_losses(model, plan, compensation, ids, batch_size=1)
    assert without == pytest.approx(math.log(perplexity(pruned, ids)), abs=1e-6)
    assert with_ == pytest.approx(math.log(perplexity(compensated, ids)), abs=1e-6)
    other = Compensation({n: s[:-1] for n, s in compensation.scales.items()},
                         {n: k[:-1] for n, k in compensation.kept.items()})
    with pytest.raises(CompensationError, match="fitted for kept experts"), compensated_view(model, plan, other):
        pass


def test_the_sums_accumulate_on_the_models_device_and_fit_from_there():
    model, plan = setup("glm4_moe")
    device = next(model.parameters()).device
    sums = compensation_sums(model, plan, random_ids(batch=4, seq=16, seed=3), granularity="linear")
    assert sums.num_tokens.device == device and sums.num_tokens.dtype == torch.float64
    for layer in sums.layers:
        assert {(t.device, t.dtype) for t in layer.tensors().values()} == {(device, torch.float64)}
    scales = fit_scales(sums, "linear", ridge=0.1)
    assert all(s.device.type == "cpu" and s.dtype == torch.float64 for s in scales.values())
    assert compensation_record(sums, scales, "linear", 0.1)["num_tokens"] == 64


def test_the_hooks_read_nothing_back_to_the_host():
    """On ``meta`` tensors every value read fails (``.item()``, ``nonzero``, a boolean index, a copy to the CPU): the
    pruned router's call, a padded batch's sums (``linear`` included) and the token count run there, so on a GPU they
    do not synchronize it. (The replacements' expert evaluation reads how many there are: the one read per layer.)"""
    model = tiny_model("qwen3_moe").to("meta")
    layer = ompmoe.find_moe_layers(model)[0]
    hooks = _LayerPass(layer, [0, 2, 3, 5], architecture_of(model).count_attributes, last=False, outputs=True,
                       fit=None)
    tokens, d = 10, model.config.hidden_size
    hooks._router_hook(layer.router, (torch.empty(tokens, d, device="meta"),), {}, None)
    ids, weights = hooks._routing
    hooks.token_weight = torch.empty(tokens, dtype=torch.long, device="meta")  # padding: masked, not dropped
    contributions = torch.empty(*ids.shape, d, device="meta") * weights.unsqueeze(-1)
    hooks._add(ids, contributions, torch.empty(tokens, d, device="meta"))
    shapes = {key: (value.device.type, tuple(value.shape)) for key, value in hooks.sums.tensors().items()}
    assert shapes == {"gram": ("meta", (4, 4)), "cross": ("meta", (4,)), "target_energy": ("meta", ()),
                      "output_gram": ("meta", (d, d)), "output_cross": ("meta", (d, d))}
    count = torch.zeros((), dtype=torch.float64, device="meta")
    batch = {"input_ids": ids, "attention_mask": torch.empty(tokens, 4, dtype=torch.long, device="meta")}
    assert _count_tokens(count, batch).device.type == "meta"


def test_linear_is_refused_before_any_forward_when_its_sums_exceed_the_budget():
    model, plan = setup("qwen3_moe")
    layers = ompmoe.find_moe_layers(model)
    d = model.config.hidden_size
    assert linear_sum_bytes(layers) == {torch.device("cpu"): len(layers) * 2 * d * d * 8}
    assert MAX_SUM_BYTES == 8 * 2**30
    forwards = []
    handle = model.register_forward_pre_hook(lambda *args: forwards.append(1))
    ids = random_ids(batch=2, seq=16, seed=1)
    try:
        with pytest.raises(CompensationError, match=r"needs 32 KiB of float64 sums on cpu \(two 32 x 32 per MoE "
                                                    r"layer\), over max_sum_bytes=1000 .*granularity='expert' or a "
                                                    r"larger max_sum_bytes"):
            compensate(model, plan, ids, max_sum_bytes=1000)
        with pytest.raises(CompensationError, match="max_sum_bytes"):
            compensation_sums(model, plan, ids, granularity="linear", max_sum_bytes=1000)
        with pytest.raises(CompensationError, match="max_sum_bytes must be a positive int or None"):
            compensate(model, plan, ids, max_sum_bytes=0)
        assert not forwards
        assert compensate(model, plan, ids, granularity="expert", max_sum_bytes=1000).record["granularity"] == "expert"
        exact = len(layers) * 2 * d * d * 8
        assert compensate(model, plan, ids, max_sum_bytes=exact).record["granularity"] == "linear"
        assert compensate(model, plan, ids, max_sum_bytes=None).record["granularity"] == "linear"
    finally:
        handle.remove()
