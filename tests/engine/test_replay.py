"""The grouped_mm replay: module output bit for bit, per-pair outputs as the literal ones, kernels run once."""

from __future__ import annotations

import pytest
import torch
import transformers.integrations.moe as hf_moe

import ompmoe.engine.collect.replay as replay_module
from ompmoe import StatisticsCollector, collect_stats, find_moe_layers
from ompmoe.engine.collect.replay import replay_grouped_mm, replayable
from ompmoe.engine.collect.statistics import PER_EXPERT_SUMS

from reference import ARCH_IDS, assert_gram_close, capture_block_inputs, make_model, random_ids


@pytest.mark.parametrize("case", ARCH_IDS)
def test_replay_matches_native_output_bits_and_literal_pairs(case):
    model = make_model(case)
    layers = find_moe_layers(model)
    with capture_block_inputs(layers) as captured, torch.no_grad():
        model(random_ids(batch=2, seq=8, seed=11), use_cache=False)
    for layer, inputs in zip(layers, captured, strict=True):
        hidden = inputs[0]
        _, weights, index = layer.router(hidden)
        assert replayable(layer.experts) is replay_grouped_mm
        with torch.no_grad():
            native = layer.experts(hidden, index, weights)
            output, pairs, weighted = replay_grouped_mm(layer.experts, hidden, index, weights)
            assert torch.equal(output, native)
            assert torch.equal(weighted, pairs * weights.reshape(-1, 1))
            assert output.dtype == native.dtype
            assert pairs.shape == (index.numel(), hidden.shape[1])
            for row, (t, slot) in enumerate((t, s) for t in range(index.shape[0]) for s in range(index.shape[1])):
                alone = layer.experts(hidden[t][None], index[t, slot].view(1, 1), torch.ones(1, 1, dtype=hidden.dtype))
                torch.testing.assert_close(pairs[row], alone[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ARCH_IDS)
def test_instrumented_logits_are_bit_identical(case):
    model = make_model(case)
    ids = random_ids(seed=12)
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
        with StatisticsCollector(model) as collector:
            instrumented = collector.forward({"input_ids": ids}).logits
    assert torch.equal(instrumented, plain)


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss", "deepseek_v2_grouped"])
def test_grouped_kernels_run_the_same_rows_as_the_plain_forward(case, monkeypatch):
    """Every expert weight multiplies exactly the rows it multiplies in the plain forward: no extra expert work."""
    model = make_model(case)
    native = hf_moe._grouped_linear
    calls: list[tuple[int, int]] = []

    def counting(input, weight, offs, *args, **kwargs):
        calls.append((weight.data_ptr(), input.shape[0]))
        return native(input, weight, offs, *args, **kwargs)

    monkeypatch.setattr(hf_moe, "_grouped_linear", counting)
    monkeypatch.setattr(replay_module, "_grouped_linear", counting)
    batch = random_ids(seed=13)
    with torch.no_grad():
        model(batch, use_cache=False)
    plain = list(calls)
    calls.clear()
    collect_stats(model, [batch])
    assert len(plain) == 2 * len(find_moe_layers(model))
    assert calls == plain


@pytest.mark.parametrize("case", ARCH_IDS)
def test_replayed_statistics_equal_the_flattened_grouped_mm_call_bit_for_bit(case, monkeypatch):
    """Same experts implementation, with and without the replay: identical statistics, every bit."""
    batches = [random_ids(seed=16), random_ids(seed=17)]
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0  # left padding: the padded path too
    batches.append({"input_ids": random_ids(seed=18), "attention_mask": mask})
    replayed = collect_stats(make_model(case), batches)
    monkeypatch.setattr(replay_module, "_grouped_linear", None)
    model = make_model(case)
    assert all(replayable(layer.experts) is None for layer in find_moe_layers(model))
    flattened = collect_stats(model, batches)
    assert replayed.num_tokens == flattened.num_tokens == 3 * 32 - 5
    for a, b in zip(replayed.layers, flattened.layers, strict=True):
        for key, value in a.tensors().items():
            assert torch.equal(value, b.tensors()[key]), key


@pytest.mark.parametrize("case", ARCH_IDS)
def test_replayed_and_flattened_statistics_agree(case):
    """grouped_mm (replayed) and eager (flattened call) give the same statistics to float32 rounding."""
    batches = [random_ids(seed=14), random_ids(seed=15)]
    replayed = collect_stats(make_model(case), batches)
    eager_model = make_model(case)
    eager_model.set_experts_implementation("eager")
    assert all(replayable(layer.experts) is None for layer in find_moe_layers(eager_model))
    flattened = collect_stats(eager_model, batches)
    assert replayed.num_tokens == flattened.num_tokens == 64
    for a, b in zip(replayed.layers, flattened.layers, strict=True):
        assert_gram_close(a.gram, b.gram, rtol=1e-5)
        assert_gram_close(a.gram_normalized, b.gram_normalized, rtol=1e-5)
        assert torch.equal(a.token_count, b.token_count)
        for key in PER_EXPERT_SUMS:
            torch.testing.assert_close(getattr(a, key), getattr(b, key), rtol=1e-5, atol=1e-6)


def test_no_replay_for_other_implementations_or_expert_parallel():
    model = make_model("qwen3_moe")
    experts = find_moe_layers(model)[0].experts
    assert replayable(experts) is replay_grouped_mm
    experts._is_expert_parallel = True
    assert replayable(experts) is None
    experts._is_expert_parallel = False
    for implementation in ("eager", "batched_mm"):
        model.set_experts_implementation(implementation)
        assert replayable(experts) is None
