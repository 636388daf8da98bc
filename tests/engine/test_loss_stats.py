"""Loss-aware statistics (ompmoe.engine.methods.loss) against a literal per-token autograd implementation."""

from __future__ import annotations

import pytest
import torch

from ompmoe import MoEStats, collect_stats, find_moe_layers
from ompmoe.engine.collect.collector import StatisticsCollector
from ompmoe.engine.methods.loss import LOSS_TENSORS, LossAwareError

from reference import capture_block_inputs, literal_layer, make_model, random_ids

CASES = ["qwen3_moe", "deepseek_v2_grouped"]


def literal_loss_sums(model, ids, mask=None):
    """Plain autograd (``retain_grad`` on each experts output, ``loss.backward()``), then per-token loops."""
    layers = find_moe_layers(model)
    outputs, handles = [], []
    for layer in layers:
        def hook(module, args, output):
            output.retain_grad()
            outputs.append(output)
        handles.append(layer.experts.register_forward_hook(hook))
    try:
        with capture_block_inputs(layers) as captured:
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()
    weight = torch.ones(ids.shape) if mask is None else mask.to(torch.float32)
    loss = torch.zeros((), dtype=torch.float64)
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1] - 1):
            if weight[b, t] > 0 and weight[b, t + 1] > 0:
                loss = loss + torch.nn.functional.cross_entropy(logits[b, t].float(), ids[b, t + 1]).double()
    model.zero_grad()
    loss.backward()
    keep = weight.reshape(-1) > 0
    result = []
    for layer, output, inputs in zip(layers, outputs, captured):
        literal = literal_layer(layer, inputs[0], keep=keep)
        grad = output.grad.to(torch.float64)
        n = layer.num_experts
        sums = {"gram_grad": torch.zeros(n, n, dtype=torch.float64), "gram_loss": torch.zeros(n, n, dtype=torch.float64),
                "gram_fisher": torch.zeros(n, n, dtype=torch.float64), "loss_first_order": torch.zeros(n, dtype=torch.float64)}
        for t in range(grad.shape[0]):
            if not keep[t]:
                continue
            atoms, d = literal.atoms[:, t, :], grad[t]  # (n, d): zero rows for experts not routed
            a = atoms @ d
            sums["gram_grad"] += d.square().sum() * atoms @ atoms.T
            sums["gram_loss"] += torch.outer(a, a)
            sums["gram_fisher"] += (atoms * d.square()) @ atoms.T
            sums["loss_first_order"] += a
        result.append(sums)
    return result, float(loss.detach())


def assert_sums_close(actual, expected):
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])  # replayed experts, flattened per-expert call
def test_loss_sums_equal_literal_autograd(case, padded, implementation):
    model = make_model(case)
    model.set_experts_implementation(implementation)
    ids = random_ids(seed=2)
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[1, 11:] = 0
    batch = {"input_ids": ids} if mask is None else {"input_ids": ids, "attention_mask": mask}
    stats = collect_stats(model, [batch], loss_aware=True)
    assert all(p.requires_grad for p in model.parameters())  # restored after the frozen pass
    assert all(p.grad is None for p in model.parameters())  # no weight gradient was kept
    plain = collect_stats(model, [batch])
    expected, _ = literal_loss_sums(model, ids, mask)
    for layer, plain_layer, sums in zip(stats.layers, plain.layers, expected, strict=True):
        assert torch.equal(layer.gram, plain_layer.gram)  # the forward statistics are untouched
        assert plain_layer.gram_loss is None
        assert float(sums["gram_loss"].diagonal().max()) > 0
        for key in LOSS_TENSORS:
            assert_sums_close(getattr(layer, key), sums[key])


def test_loss_is_the_summed_next_token_cross_entropy():
    model = make_model("qwen3_moe")
    ids = random_ids(seed=3)
    collector = StatisticsCollector(model, loss_aware=True)
    with collector, torch.enable_grad():
        logits = collector.forward({"input_ids": ids}).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
    assert float(collector.extensions["loss_aware"].metric.loss_sum) == pytest.approx(float(expected.detach()), rel=1e-6)


def test_merge_of_two_batches_equals_joint_collection():
    model = make_model("qwen3_moe")
    first, second = random_ids(seed=4), random_ids(seed=5)
    joint = collect_stats(model, [first, second], loss_aware=True)
    merged = collect_stats(model, [first], loss_aware=True).merge(collect_stats(model, [second], loss_aware=True))
    for a, b in zip(joint.layers, merged.layers, strict=True):
        for key in LOSS_TENSORS:
            torch.testing.assert_close(getattr(a, key), getattr(b, key), rtol=1e-12, atol=1e-12 * float(getattr(a, key).abs().max()))
    # Merging with statistics that lack the loss terms drops them (an optional tensor needs both sides).
    partial = joint.merge(collect_stats(model, [second]))
    assert all(layer.gram_loss is None for layer in partial.layers)


def test_save_load_round_trip_keeps_loss_tensors(tmp_path):
    model = make_model("qwen3_moe")
    stats = collect_stats(model, [random_ids(seed=6)], loss_aware=True)
    assert bool((stats.layers[0].loss_first_order < 0).any())  # signed values are legal on disk
    loaded = MoEStats.load(stats.save(tmp_path / "stats.safetensors"), model=model)
    for a, b in zip(stats.layers, loaded.layers, strict=True):
        assert set(a.tensors()) == set(b.tensors()) >= set(LOSS_TENSORS)
        for key, value in a.tensors().items():
            assert torch.equal(value, b.tensors()[key]), key


def test_non_reentrant_activation_checkpointing_counts_once():
    model = make_model("qwen3_moe")
    ids = random_ids(seed=7)
    reference = collect_stats(model, [ids], loss_aware=True)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # Hugging Face checkpoints only in train mode
    collector = StatisticsCollector(model, loss_aware=True)
    model.requires_grad_(False)
    with collector, torch.enable_grad():
        collector.forward({"input_ids": ids})
    stats = collector.result()
    for a, b in zip(stats.layers, reference.layers, strict=True):
        torch.testing.assert_close(a.gram, b.gram, rtol=1e-5, atol=1e-6 * float(b.gram.max()))
        for key in LOSS_TENSORS:
            assert_sums_close(getattr(a, key), getattr(b, key))


def test_no_grad_forward_is_refused_with_the_fix():
    model = make_model("qwen3_moe")
    collector = StatisticsCollector(model, loss_aware=True)
    with collector, torch.no_grad(), pytest.raises(LossAwareError, match="needs the forward to run with gradients enabled"):
        collector.forward({"input_ids": random_ids(seed=8)})
