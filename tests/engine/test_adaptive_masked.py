"""OMP-MoE+'s masked path for ``grouped_mm`` experts: the paper's rule, no host read, static shapes.

The masked path (``enable_adaptive(path="masked")``, the ``auto`` choice on accelerators) runs the experts' own
grouped computation with the skipped slots sorted past the last group and zeroed. It is checked here against the
literal per-token rule of ``test_adaptive.py`` (which instruments the experts' forward and so exercises the compact
path), against the compact path, and on the ``meta`` device, where any read of a value back to the host (``nonzero``,
``.item()``, a boolean index) fails: what runs there runs without synchronizing a GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ompmoe
from ompmoe.engine.apply.adaptive import (
    STATE_ATTR,
    adaptive_keep_mask,
    adaptive_paths,
    adaptive_report,
    disable_adaptive,
    enable_adaptive,
    masked_grouped_mm,
    masked_path_supported,
)

from reference import ARCH_IDS, random_ids
from test_adaptive import EPSILON, literal_layer_output, logits, scaled_model, stats_of

pytestmark = pytest.mark.filterwarnings("ignore:ompmoe adaptive inference:UserWarning")


def captured_calls(model: torch.nn.Module) -> tuple[list[list], list]:
    """Hooks only (the forward stays as adaptive inference set it): each experts call's arguments and output."""
    layers = ompmoe.find_moe_layers(model)
    received: list[list] = [[] for _ in layers]
    outputs: list[list] = [[] for _ in layers]
    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.experts.register_forward_pre_hook(
            lambda m, a, k, i=i: received[i].append(tuple(t.detach().clone() for t in a[:3])), with_kwargs=True,
            prepend=True))
        handles.append(layer.experts.register_forward_hook(
            lambda m, a, k, out, i=i: outputs[i].append(out.detach().clone()), with_kwargs=True))
    return received, outputs, handles


@pytest.mark.parametrize("case", ARCH_IDS)
def test_masked_path_matches_the_literal_per_token_rule(case):
    model = scaled_model(case, "grouped_mm")
    stats = stats_of(case)
    enable_adaptive(model, stats, EPSILON, path="masked")
    layers = ompmoe.find_moe_layers(model)
    assert all(masked_path_supported(layer.experts) for layer in layers)
    assert set(adaptive_paths(model).values()) == {"masked"}
    received, outputs, handles = captured_calls(model)
    try:
        logits(model, random_ids(batch=2, seq=16, seed=3))
    finally:
        for handle in handles:
            handle.remove()
    report = adaptive_report(model)
    skipped_somewhere = False
    for layer, calls, outs in zip(layers, received, outputs):
        assert len(calls) == len(outs) == 1
        hidden, index, weights = calls[0]
        expected, kept = literal_layer_output(layer.experts, hidden, index, weights, stats.layer(layer.name).alpha,
                                              EPSILON)
        torch.testing.assert_close(outs[0].to(torch.float64), expected, rtol=1e-5, atol=1e-5)
        counts = report[layer.name]
        assert counts["tokens"] == hidden.shape[0] and counts["kept_pairs"] == len(kept)
        per_token = torch.bincount(torch.tensor([t for t, _ in kept]), minlength=hidden.shape[0])
        assert counts["histogram"] == torch.bincount(per_token, minlength=layer.top_k + 1).tolist()
        skipped_somewhere |= len(kept) < index.numel()
    assert skipped_somewhere


@pytest.mark.parametrize("case", ARCH_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_and_compact_paths_give_the_same_outputs_and_counters(case, dtype):
    model = scaled_model(case, "grouped_mm", dtype=dtype)
    ids = random_ids(batch=2, seq=24, seed=11)
    results = {}
    for path in ("masked", "compact"):
        enable_adaptive(model, stats_of(case), EPSILON, path=path)
        assert set(adaptive_paths(model).values()) == {path}
        received, outputs, handles = captured_calls(model)
        try:
            final = logits(model, ids)
        finally:
            for handle in handles:
                handle.remove()
        results[path] = (final, adaptive_report(model), outputs)
    (masked, masked_report, masked_outs), (compact, compact_report, compact_outs) = results["masked"], results["compact"]
    assert torch.isfinite(masked).all()
    if dtype == torch.float32:
        assert masked_report == compact_report
        torch.testing.assert_close(masked, compact, rtol=1e-5, atol=1e-5)
    else:  # bf16 rounding may differ after the first layer, and with it a later layer's routing: compare the first
        first = ompmoe.find_moe_layers(model)[0].name
        assert masked_report[first] == compact_report[first]
        torch.testing.assert_close(masked_outs[0][0].float(), compact_outs[0][0].float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_masked_path_with_nothing_skipped_is_the_native_computation_bit_for_bit(case):
    """A zeta so large that no prefix qualifies: every slot is kept and the masked path is the native forward."""
    model = scaled_model(case, "grouped_mm")
    ids = random_ids(batch=2, seq=16, seed=12)
    plain = logits(model, ids)
    enable_adaptive(model, stats_of(case), 0.5, zeta=1e30, path="masked")
    assert torch.equal(logits(model, ids), plain)
    assert all(entry["skip_ratio"] == 0.0 for entry in adaptive_report(model).values())


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss", "deepseek_v2_grouped"])
def test_masked_path_reads_nothing_back_to_the_host(case):
    """On ``meta`` tensors every value read fails: the rule, the counters and the masked experts run there, and the
    compact path (its ``nonzero``) does not."""
    model = scaled_model(case, "grouped_mm")
    stats = stats_of(case)
    layer = ompmoe.find_moe_layers(model)[0]
    experts = layer.experts
    experts.to(device="meta", dtype=torch.bfloat16)  # grouped_mm's meta kernel wants bf16
    tokens, dim = 12, model.config.hidden_size
    hidden = torch.empty(tokens, dim, device="meta", dtype=torch.bfloat16)
    index = torch.empty(tokens, layer.top_k, device="meta", dtype=torch.long)
    weights = torch.empty(tokens, layer.top_k, device="meta", dtype=torch.bfloat16)
    enable_adaptive(model, stats, EPSILON)  # auto: meta is no CPU, so masked
    assert adaptive_paths(model)[layer.name] == "masked"
    with torch.no_grad():
        out = experts(hidden, index, weights)
    assert out.shape == (tokens, dim) and out.device.type == "meta"
    assert getattr(experts, STATE_ATTR).histogram.device.type == "meta"
    keep = adaptive_keep_mask(index, weights, torch.ones(experts.num_experts, device="meta"), EPSILON)
    assert masked_grouped_mm(experts, hidden, index, weights, keep).shape == (tokens, dim)
    enable_adaptive(model, stats, EPSILON, path="compact")
    with pytest.raises((RuntimeError, NotImplementedError)):
        with torch.no_grad():
            experts(hidden, index, weights)


def test_auto_path_is_compact_on_cpu_and_for_other_implementations():
    model = scaled_model("qwen3_moe", "grouped_mm")
    enable_adaptive(model, stats_of("qwen3_moe"), EPSILON)
    assert set(adaptive_paths(model).values()) == {"compact"}  # CPU: compaction is faster there
    for implementation in ("eager", "batched_mm"):
        other = scaled_model("qwen3_moe", implementation)
        enable_adaptive(other, stats_of("qwen3_moe"), EPSILON, path="masked")
        assert set(adaptive_paths(other).values()) == {"compact"}
        assert all("forward" not in layer.experts.__dict__ for layer in ompmoe.find_moe_layers(other))
    with pytest.raises(ValueError, match="path"):
        enable_adaptive(model, stats_of("qwen3_moe"), EPSILON, path="fast")


def test_a_replaced_forward_falls_back_to_compact_and_the_masked_forward_comes_back():
    model = scaled_model("qwen3_moe", "grouped_mm")
    ids = random_ids(batch=2, seq=16, seed=13)
    stats = stats_of("qwen3_moe")
    enable_adaptive(model, stats, EPSILON, path="compact")
    expected = logits(model, ids)
    enable_adaptive(model, stats, EPSILON, path="masked")
    layers = ompmoe.find_moe_layers(model)
    calls = []
    for layer in layers:  # someone instruments the experts' forward: this call goes the compact way
        experts = layer.experts

        def spy(*args, experts=experts):
            calls.append(args[1].shape)
            return type(experts).forward(experts, *args)

        experts.forward = spy
    torch.testing.assert_close(logits(model, ids), expected, rtol=1e-5, atol=1e-5)
    assert len(calls) == len(layers) and all(shape[1] == 1 for shape in calls)  # flattened (pairs, 1) routing
    for layer in layers:
        del layer.experts.forward
    logits(model, ids)  # no forward installed: compact once, the masked forward is put back
    assert all(getattr(layer.experts, STATE_ATTR).forward is layer.experts.__dict__["forward"] for layer in layers)
    torch.testing.assert_close(logits(model, ids), expected, rtol=1e-5, atol=1e-5)
    disable_adaptive(model)
    assert all("forward" not in layer.experts.__dict__ for layer in layers)


def test_statistics_collected_with_the_masked_path_on_are_those_of_the_plain_model():
    model = scaled_model("olmoe", "grouped_mm")
    batches = [random_ids(batch=2, seq=16, seed=14)]
    plain = ompmoe.collect_stats(model, batches)
    enable_adaptive(model, stats_of("olmoe"), EPSILON, path="masked")
    with pytest.warns(UserWarning, match="switched off while statistics are collected"):
        again = ompmoe.collect_stats(model, batches)
    for a, b in zip(plain.layers, again.layers):
        assert torch.equal(a.alpha, b.alpha)
    ids = random_ids(batch=2, seq=16, seed=15)
    with_masked = logits(model, ids)
    enable_adaptive(model, stats_of("olmoe"), EPSILON, path="compact")
    torch.testing.assert_close(with_masked, logits(model, ids), rtol=1e-5, atol=1e-5)


def test_deepcopy_keeps_the_masked_forward_bound_to_the_copy():
    model = scaled_model("qwen3_moe", "grouped_mm")
    enable_adaptive(model, stats_of("qwen3_moe"), EPSILON, path="masked")
    ids = random_ids(batch=2, seq=16, seed=16)
    twin = copy.deepcopy(model)
    expected = logits(model, ids)
    assert torch.equal(logits(twin, ids), expected)
    assert adaptive_report(twin) == adaptive_report(model)  # each counted its own call
    for layer in ompmoe.find_moe_layers(twin):
        assert layer.experts.forward.__self__ is layer.experts
