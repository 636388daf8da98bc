"""ExpertPruning checkpoints every statistics extension's sums under its prefix and restores them on resume."""

from __future__ import annotations

import torch

from ompmoe.callbacks import ExpertPruning
from ompmoe.engine.collect.collector import StatisticsCollector
from ompmoe.engine.tiny import tiny_model


def filled_callback(statistics: list[str]) -> ExpertPruning:
    callback = ExpertPruning(statistics=statistics)
    model = tiny_model("qwen3_moe", num_hidden_layers=2)
    callback.pruning.collector = StatisticsCollector(model, statistics=callback.pruning.statistics)
    generator = torch.Generator().manual_seed(4)
    for metric in callback.pruning.collector.metrics().values():
        for name in metric._defaults:
            state = getattr(metric, name)
            setattr(metric, name, torch.rand(state.shape, generator=generator, dtype=state.dtype))
    return callback


def test_extension_states_round_trip_through_the_checkpoint_under_their_prefix():
    saved = filled_callback(["reroute", "loss_aware"])
    state = saved.state_dict()
    names = set(state["states"])
    assert {"gram_0", "reroute.gram_reroute_0", "reroute.gram_reroute_normalized_0", "loss.gram_loss_0",
            "loss.loss_first_order_0", "loss.loss_sum"} <= names
    resumed = ExpertPruning(loss_aware=True, reroute=True)
    resumed.pruning.collector = StatisticsCollector(tiny_model("qwen3_moe", num_hidden_layers=2), statistics=resumed.pruning.statistics)
    resumed.load_state_dict(state)
    for prefix, metric in resumed.pruning.collector.metrics().items():
        original = saved.pruning.collector.metrics()[prefix]
        for name in metric._defaults:
            assert torch.equal(getattr(metric, name), getattr(original, name)), prefix + name


def test_states_of_statistics_this_fit_does_not_collect_are_ignored():
    state = filled_callback(["loss_aware"]).state_dict()
    plain = ExpertPruning()
    plain.pruning.collector = StatisticsCollector(tiny_model("qwen3_moe", num_hidden_layers=2))
    plain.load_state_dict(state)
    assert set(plain.pruning.collector.metrics()) == {""}
    assert torch.equal(plain.pruning.collector.metric.gram_0, state["states"]["gram_0"])
