"""Adaptive inference's messages: warnings only about experts the model still has, one model-wide line."""

from __future__ import annotations

import dataclasses
import warnings

import torch

import ompmoe
from ompmoe.engine.apply.adaptive import adaptive_report, adaptive_summary, enable_adaptive
from ompmoe.engine.tiny import tiny_model


def scaled_model() -> torch.nn.Module:
    return tiny_model("qwen3_moe", initializer_range=0.2)  # expert energies O(1), so tokens skip experts


def ids(seed: int) -> torch.Tensor:
    return torch.randint(3, 256, (4, 32), generator=torch.Generator().manual_seed(seed))


def with_unrouted(stats: ompmoe.MoEStats, unrouted: dict[str, list[int]]) -> ompmoe.MoEStats:
    """These statistics with the given experts' routed-token counts set to zero (as if never routed)."""
    layers = []
    for layer in stats.layers:
        counts = layer.token_count.clone()
        counts[unrouted.get(layer.name, [])] = 0
        layers.append(dataclasses.replace(layer, token_count=counts))
    return dataclasses.replace(stats, layers=layers)


def adaptive_warnings(model, stats) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        enable_adaptive(model, stats, 0.2)
    return [str(w.message) for w in caught if "ompmoe adaptive inference" in str(w.message)]


def test_experts_pruned_away_are_not_reported_as_never_routed():
    stats = ompmoe.collect_stats(scaled_model(), [ids(0)])
    plan = ompmoe.plan_pruning(stats, 0.5)
    removed = {layer.name: sorted(set(range(layer.num_experts)) - set(layer.kept)) for layer in plan.layers}
    model = ompmoe.prune(scaled_model(), plan)
    assert adaptive_warnings(model, with_unrouted(stats, removed)) == []
    # A kept expert that was never routed is reported, by its id in the pruned model.
    first = plan.layers[0]
    unrouted = {**removed, first.name: removed[first.name] + [first.kept[2]]}
    assert adaptive_warnings(model, with_unrouted(stats, unrouted)) == [
        "ompmoe adaptive inference: some experts of this model were never routed during calibration, so their "
        "alpha is 0 and OMP-MoE+ skips them whenever other experts cover 1 - epsilon (current expert ids per "
        f"layer): {{'{first.name}': [2]}}. Calibrate on more tokens to avoid this."
    ]
    # On the unpruned model every unrouted expert is reported.
    assert str({first.name: [1, 5]}) in adaptive_warnings(scaled_model(), with_unrouted(stats, {first.name: [1, 5]}))[0]


def test_adaptive_summary_is_the_model_wide_line():
    model = scaled_model()
    stats = ompmoe.collect_stats(model, [ids(0)])
    enable_adaptive(model, stats, 0.2)
    with torch.no_grad():
        model(ids(1))
    report = adaptive_report(model)
    kept = sum(entry["kept_pairs"] for entry in report.values())
    tokens = sum(entry["tokens"] for entry in report.values())
    native = sum(entry["tokens"] * entry["top_k"] for entry in report.values())
    assert 0 < kept < native
    expected = (
        f"adaptive (epsilon 0.2): {kept / tokens:.2f} of {model.config.num_experts_per_tok} experts per token and "
        f"layer, skip ratio {1 - kept / native:.3f}, routed-expert FLOPs ratio {kept / native:.3f}, "
        f"over 128 tokens in {len(report)} MoE layers"
    )
    assert adaptive_summary(model) == expected == adaptive_summary(report)
    assert ompmoe.adaptive_summary(scaled_model()) == "adaptive inference is off (no MoE layer has it enabled)"
