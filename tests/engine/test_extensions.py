"""Optional statistics as plugins (ompmoe.engine.collect.extensions): a new kind is one class and its registration."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ompmoe import MoEStats, collect_stats, plan_pruning
from ompmoe.engine.collect.collector import StatisticsCollector
from ompmoe.engine.collect.extensions import STATISTICS, StatisticsExtension, register_statistics
from ompmoe.engine.collect.sums import LayerSumsMetric
from ompmoe.engine.methods import (METHODS, SelectionMethod, check_statistics, register_method, required_statistics,
                                   score_order)
from ompmoe.engine.planning.method_registry import require_statistic
from ompmoe.engine.planning.strategy import PruningStrategy
from ompmoe.engine.tiny import tiny_model


class _NoHooks:
    def attach(self) -> None:
        pass

    def detach(self) -> None:
        pass


class GateSquares(StatisticsExtension):
    """Per expert, the sum of its squared router weight over routed tokens (a test kind, no LayerStats field)."""

    name: ClassVar[str] = "gate_squares"
    kind: ClassVar[str] = "gate-square"
    prefix: ClassVar[str] = "gates"
    tensors: ClassVar[tuple[str, ...]] = ("gate_square_sum",)

    def __init__(self, model, layers, token_weight):
        super().__init__(model, layers, token_weight)
        self.metric = LayerSumsMetric(layers, {"gate_square_sum": "vector"})
        self.recorder = _NoHooks()
        self.seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def wrap(self, update):
        def chained(index, top_k_index, top_k_weights, outputs, *atoms):
            update(index, top_k_index, top_k_weights, outputs, *atoms)
            self.seen.append((index, top_k_index.detach().clone(), top_k_weights.detach().clone()))
            self.metric.update(index, "gate_square_sum", top_k_index, top_k_weights.detach().double().square())

        return chained


@dataclass
class LargestGateSquares(SelectionMethod):
    """largest summed squared gate (test method)"""

    name: ClassVar[str] = "largest_gate_squares"
    statistics: ClassVar[tuple[str, ...]] = ("gate_squares",)

    def select(self, layers):
        for key in ("gate_square_sum",):
            require_statistic(layers, key, f"Method {self.name!r}")
        return [score_order(layer.gate_square_sum, layer.num_groups) for layer in layers]


@pytest.fixture
def registered():
    register_statistics(GateSquares)
    register_method(LargestGateSquares)
    yield
    STATISTICS.pop(GateSquares.name)
    METHODS.pop(LargestGateSquares.name)


def batches():
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(3, 256, (2, 12), generator=generator) for _ in range(3)]


def test_a_registered_kind_is_collected_saved_merged_and_planned_on(registered, tmp_path):
    model = tiny_model("qwen3_moe", num_hidden_layers=2)
    collector = StatisticsCollector(model, statistics=["gate_squares"])
    assert set(collector.metrics()) == {"", "gates."}
    with collector, torch.no_grad():
        for batch in batches():
            collector.forward({"input_ids": batch})
    stats = collector.result()
    literal = [torch.zeros(layer.num_experts, dtype=torch.float64) for layer in stats.layers]
    for index, ids, weights in collector.extensions["gate_squares"].seen:
        for e, g in zip(ids.reshape(-1).tolist(), weights.reshape(-1).tolist()):
            literal[index][e] += g * g
    for layer, expected in zip(stats.layers, literal):
        assert torch.allclose(layer.gate_square_sum, expected, rtol=1e-12, atol=0)
        assert set(layer.extra) == {"gate_square_sum"}
    # The core sums are those of a plain pass.
    plain = collect_stats(model, batches())
    for a, b in zip(stats.layers, plain.layers):
        assert torch.equal(a.gram, b.gram) and torch.equal(a.routing_mass, b.routing_mass)
        assert b.gate_square_sum is None
    # Saved under its own name, loaded back, summed by merge.
    loaded = MoEStats.load(stats.save(tmp_path / "stats.safetensors"))
    merged = loaded.merge(stats)
    for a, b, m in zip(loaded.layers, stats.layers, merged.layers):
        assert torch.equal(a.gate_square_sum, b.gate_square_sum)
        assert torch.equal(m.gate_square_sum, 2 * b.gate_square_sum)
    # A method declaring it plans on it, and is refused without it, naming how to collect it.
    plan = plan_pruning(loaded, 0.5, method="largest_gate_squares")
    assert [p.order for p in plan.layers] == [score_order(x, 1).tolist() for x in literal]
    with pytest.raises(ValueError) as error:
        plan_pruning(plain, 0.5, method="largest_gate_squares")
    assert str(error.value) == (
        "Method 'largest_gate_squares' needs gate-square statistics ('gate_square_sum'), which these statistics lack "
        "(layers ['model.layers.1.mlp']). Collect them with ompmoe.collect_stats(model, "
        "batches, statistics=['gate_squares']) or ExpertPruning(..., statistics=['gate_squares'])."
    )


def test_collect_stats_collects_a_kind_by_name(registered):
    model = tiny_model("qwen3_moe", num_hidden_layers=2)
    stats = collect_stats(model, batches(), statistics=["gate_squares"])
    assert all(layer.gate_square_sum is not None for layer in stats.layers)


def test_one_check_names_what_a_strategy_needs_and_how_to_collect_it(registered):
    assert required_statistics("omp_loss", "loss") == {"loss_aware": ["method 'omp_loss'", "allocation 'loss'"]}
    assert required_statistics("omp_reroute", "loss_risk") == {
        "reroute": ["method 'omp_reroute'"], "loss_aware": ["allocation 'loss_risk'"]}
    assert required_statistics("omp", "waterfill") == {} == required_statistics("no_such_method", "no_such_allocation")
    with pytest.raises(ValueError) as error:
        check_statistics(PruningStrategy(method="omp_loss", allocation="loss"), [])
    assert str(error.value) == (
        "The strategy's method 'omp_loss' and allocation 'loss' need loss-aware statistics, which this calibration "
        "would not collect: pass ExpertPruning(..., loss_aware=True)."
    )
    with pytest.raises(ValueError) as error:
        check_statistics(PruningStrategy(method="largest_gate_squares"), ["loss_aware", "reroute"])
    assert str(error.value) == (
        "The strategy's method 'largest_gate_squares' needs gate-square statistics, which this calibration would not "
        "collect: pass ExpertPruning(..., statistics=['gate_squares'])."
    )
    check_statistics(PruningStrategy(method="largest_gate_squares", allocation="loss"), ["loss_aware", "gate_squares"])


def test_unknown_statistics_are_refused_with_the_registered_names():
    model = tiny_model("qwen3_moe", num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"Unknown statistics 'nope'; choose from \['loss_aware', 'reroute'\]\."):
        StatisticsCollector(model, statistics=["nope"])


def test_layer_stats_without_an_extension_tensor_read_none_and_unknown_names_still_fail():
    model = tiny_model("qwen3_moe", num_hidden_layers=2)
    layer = collect_stats(model, batches()).layers[0]
    assert layer.gram_loss is None and layer.gram_reroute is None
    with pytest.raises(AttributeError, match="has no attribute 'no_such_sum'"):
        layer.no_such_sum  # noqa: B018
    assert dataclasses.replace(layer).extra == {}


def test_a_file_with_an_extension_this_process_lacks_loads_with_its_tensors_kept(tmp_path):
    """Statistics of a plugin not imported here (or of a newer ompmoe) load, keep the tensors, and are still checked."""
    stats = collect_stats(tiny_model("qwen3_moe", num_hidden_layers=2), batches())
    n = stats.layers[0].num_experts
    gram = torch.eye(n, dtype=torch.float64) * 3
    signed = -torch.arange(n, dtype=torch.float64)
    extended = dataclasses.replace(stats, layers=[layer.with_tensors({"gram_plugin": gram, "plugin_first_order": signed})
                                                  for layer in stats.layers])
    with pytest.warns(UserWarning) as caught:
        loaded = MoEStats.load(extended.save(tmp_path / "plugin.safetensors"))
    assert [str(w.message) for w in caught] == [
        f"{tmp_path / 'plugin.safetensors'} holds statistics no registered extension fills (gram_plugin, "
        "plugin_first_order); they are kept in LayerStats.extra (import the extension that collects them to use them)."]
    for layer in loaded.layers:
        assert torch.equal(layer.gram_plugin, gram) and torch.equal(layer.plugin_first_order, signed)
    assert plan_pruning(loaded, 0.5) == plan_pruning(stats, 0.5)
    # A Gram's diagonal is a sum of squares whoever wrote it: a negative one is refused all the same.
    broken = dataclasses.replace(stats, layers=[layer.with_tensors({"gram_plugin": -gram}) for layer in stats.layers])
    with pytest.raises(ValueError, match=r"layer 0 \(model.layers.1.mlp\): tensor 'gram_plugin' has negative diagonal"):
        MoEStats.load(broken.save(tmp_path / "broken.safetensors"))
    # A tensor of a layer the metadata does not list is refused, as before.
    path = tmp_path / "plugin.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    save_file({**load_file(str(path)), "layers.9.gram_plugin": gram}, str(tmp_path / "extra.safetensors"), metadata)
    with pytest.raises(ValueError, match="holds tensors it does not describe"):
        MoEStats.load(tmp_path / "extra.safetensors")
