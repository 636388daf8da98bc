"""The registries: a method, an allocation or an architecture added in one place works everywhere."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch

import ompmoe
from ompmoe import collect_stats, plan_pruning
from ompmoe.engine.planning.allocation import ALLOCATIONS
from ompmoe.engine.methods import METHODS, SelectionMethod, get_method, method_table, register_method, score_order

from reference import make_model, random_ids

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def registries():
    """Restore the registries after a test registers something."""
    methods, allocations, architectures = dict(METHODS), dict(ALLOCATIONS), dict(ompmoe.ARCHITECTURES)
    yield
    for registry, saved in ((METHODS, methods), (ALLOCATIONS, allocations), (ompmoe.ARCHITECTURES, architectures)):
        registry.clear()
        registry.update(saved)


@pytest.fixture(scope="module")
def stats():
    model = make_model("qwen3_moe")
    return collect_stats(model, [random_ids(seed=s) for s in range(2)])


def _least_routed_method():
    @register_method
    @dataclass
    class LeastRouted(SelectionMethod):
        """fewest routed tokens (a deliberately bad test method)"""

        name: ClassVar[str] = "least_routed"
        offset: float = 0.0

        def select(self, layers):
            return [score_order(-(layer.token_count.to(torch.float64) + self.offset), layer.num_groups) for layer in layers]

    return LeastRouted


def test_a_method_registered_in_one_place_works_in_plan_strategy_and_table(registries, stats):
    cls = _least_routed_method()
    plan = plan_pruning(stats, 0.5, method="least_routed", allocation="uniform", method_options={"offset": 1.0})
    assert plan.method == "least_routed" and plan.extra == {"method_options": {"offset": 1.0}}
    for layer, planned in zip(stats.layers, plan.layers):
        expected = sorted(range(layer.num_experts), key=lambda e: (float(layer.token_count[e]), e))
        assert planned.order == expected
    assert ompmoe.PruningStrategy(ratio=0.5, method="least_routed", allocation="uniform",
                                  method_options={"offset": 1.0}).plan(stats) == plan
    assert plan_pruning(stats, 0.5, method=cls(offset=1.0), allocation="uniform") == plan
    assert "| `least_routed` | `offset=0.0` | fewest routed tokens (a deliberately bad test method) |" in method_table()


def test_a_registered_method_runs_in_the_lightning_callback(registries, tmp_path):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from ompmoe.callbacks import ExpertPruning

    _least_routed_method()
    data = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)} for ids in (random_ids(seed=s) for s in range(3))]
    strategy = ompmoe.PruningStrategy(ratio=0.5, method="least_routed", allocation="uniform", method_options={"offset": 2.0})
    callback = ExpertPruning(strategy, output_dir=str(tmp_path / "run"), plots=False)
    pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, callbacks=[callback]).fit(
        ompmoe.CalibrationModule("tiny:qwen3_moe"), DataLoader(data, batch_size=None))
    expected = plan_pruning(callback.stats, 0.5, method="least_routed", allocation="uniform", method_options={"offset": 2.0})
    assert callback.plan == expected
    assert ompmoe.PruningPlan.load(tmp_path / "run" / "plan.json") == expected
    reloaded = ompmoe.load_pruned(tmp_path / "run" / "model")
    assert [layer.num_experts for layer in ompmoe.find_moe_layers(reloaded)] == [8] * len(expected.layers)


def test_unknown_methods_and_options_are_refused_with_the_valid_ones(stats):
    with pytest.raises(ValueError) as info:
        get_method("random", {"sede": 3})
    assert str(info.value) == "Method 'random' has no option 'sede'; its options are ['seed']."
    with pytest.raises(ValueError) as info:
        plan_pruning(stats, 0.5, method="omp", method_options={"seed": 1})
    assert str(info.value) == "Method 'omp' has no option 'seed'; its options are none."
    with pytest.raises(ValueError, match=r"Method 'nowhere\.Thing' is not registered and cannot be imported"):
        get_method("nowhere.Thing")


def test_register_method_refuses_what_would_not_work(registries):
    class NotADataclass(SelectionMethod):
        name: ClassVar[str] = "x"

    with pytest.raises(TypeError, match="register_method needs a @dataclass subclass of SelectionMethod"):
        register_method(NotADataclass)

    @dataclass
    class Unnamed(SelectionMethod):
        pass

    with pytest.raises(ValueError, match="Unnamed.name must be an identifier-like method name; got ''"):
        register_method(Unnamed)

    @dataclass
    class Impostor(SelectionMethod):
        name: ClassVar[str] = "omp"

    with pytest.raises(ValueError, match="A method named 'omp' is already registered"):
        register_method(Impostor)


def test_an_allocation_registered_in_one_place(registries, stats):
    @ompmoe.register_allocation("front_loaded")
    def front_loaded(problem: ompmoe.AllocationProblem) -> list[int]:
        """every spare expert to the earliest layers"""
        counts = [choice.low for choice in problem.choices]
        spare = problem.budget - sum(counts)
        for i, choice in enumerate(problem.choices):
            extra = min(spare, choice.high - choice.low)
            counts[i] += extra
            spare -= extra
        return counts

    plan = plan_pruning(stats, 0.5, allocation="front_loaded")
    kept = [layer.num_kept for layer in plan.layers]
    assert plan.allocation == "front_loaded" and sum(kept) == sum(layer.num_experts for layer in stats.layers) // 2
    assert kept == [10, 6]  # 16 of 32 kept, at least ceil(0.375 * 16) = 6 each: the 4 spare go to layer 0
    assert ompmoe.PruningStrategy(ratio=0.5, allocation="front_loaded").plan(stats) == plan


def test_an_architecture_registered_in_one_place(registries):
    """A new model_type (here: Qwen3-MoE under another name) collects, plans, prunes and reloads."""
    spec = ompmoe.ARCHITECTURES["qwen3_moe"]
    ompmoe.register_architecture("qwen3_moe_alias", dataclasses.replace(spec))
    model = make_model("qwen3_moe")
    model.config.model_type = "qwen3_moe_alias"
    stats = collect_stats(model, [random_ids()])
    assert stats.model_type == "qwen3_moe_alias"
    plan = plan_pruning(stats, 0.5)
    ompmoe.prune(model, plan)
    assert [layer.num_experts for layer in ompmoe.find_moe_layers(model)] == [layer.num_kept for layer in plan.layers]
    with pytest.raises(ValueError, match="model_type 'qwen3_moe' is already registered with another spec"):
        ompmoe.register_architecture("qwen3_moe", dataclasses.replace(spec, router_attr="router"))


def test_external_method_by_import_path_in_the_cli(tmp_path, stats):
    """``ompmoe prune --method package.module.Class`` imports (and so registers) a method from outside ompmoe."""
    (tmp_path / "my_methods.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass
        from typing import ClassVar

        import torch
        from ompmoe import SelectionMethod, register_method
        from ompmoe.engine.methods import score_order

        @register_method
        @dataclass
        class Reversed(SelectionMethod):
            """highest expert ids first (test method)"""
            name: ClassVar[str] = "reversed_ids"
            start: int = 0

            def select(self, layers):
                return [score_order(torch.arange(layer.num_experts, dtype=torch.float64) + self.start,
                                    layer.num_groups) for layer in layers]
    '''))
    stats_path = tmp_path / "stats.safetensors"
    stats.save(stats_path)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run(
        [sys.executable, "-m", "ompmoe.cli", "prune", "--stats", str(stats_path), "--ratio", "[0.5]",
         "--output_dir", str(tmp_path / "out"), "--method", "my_methods.Reversed", "--method_options.start", "2",
         "--allocation", "uniform"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads((tmp_path / "out" / "plan-0.5.json").read_text())
    assert plan["method"] == "reversed_ids" and plan["extra"] == {"method_options": {"start": 2}}
    assert [layer["kept"] for layer in plan["layers"]] == [list(range(8, 16))] * len(stats.layers)


def test_cli_prune_sets_every_method_option(tmp_path, stats):
    stats_path = tmp_path / "stats.safetensors"
    stats.save(stats_path)
    from ompmoe.cli import main

    main(["prune", "--stats", str(stats_path), "--ratio", "[0.5]", "--output_dir", str(tmp_path / "out"),
          "--method", "random", "--method_options.seed", "3", "--zeta", "0.001", "--min_kept_fraction", "0.25"])
    plan = ompmoe.PruningPlan.load(tmp_path / "out" / "plan-0.5.json")
    assert plan == plan_pruning(stats, 0.5, method="random", method_options={"seed": 3}, zeta=0.001, min_kept_fraction=0.25)


def test_readme_method_table_is_the_registry():
    readme = (REPO / "docs" / "methods.md").read_text()
    start, end = "<!-- methods-table:start -->\n", "\n<!-- methods-table:end -->"
    table = readme[readme.index(start) + len(start):readme.index(end)]
    assert table == method_table()


def test_removed_names_are_gone(stats):
    import importlib

    for name in ("RandomStrategy", "OMPStrategy", "STRATEGIES"):
        assert not hasattr(ompmoe, name)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("ompmoe.strategies")
    with pytest.raises(TypeError, match="min_ratio"):
        plan_pruning(stats, 0.5, min_ratio=0.25)
    assert not hasattr(importlib.import_module("ompmoe.callbacks"), "OMPMoEPruning")


@pytest.mark.parametrize("registry", ["ompmoe.engine.collect.extensions:STATISTICS",
                                      "ompmoe.engine.planning.allocation:ALLOCATIONS",
                                      "ompmoe.engine.planning.method_registry:METHODS"])
def test_a_stage_registry_loads_the_built_in_methods_on_its_first_read(registry):
    """collect/ and planning/ never import methods/: their registries import it when first read, in a fresh process
    where nothing else loaded it, and registering alone does not."""
    module, name = registry.split(":")
    code = textwrap.dedent(f"""
        import sys
        from {module} import {name} as registry
        registry["mine"] = object()
        print("ompmoe.engine.methods" in sys.modules, registry.registered("omp") is not None)
        print(list(registry))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    before, names = done.stdout.splitlines()
    assert before == "False False"
    built_in = {"STATISTICS": {"loss_aware", "reroute"}, "METHODS": set(METHODS),
                "ALLOCATIONS": {"uniform", "waterfill", "optimal", "loss", "loss_risk"}}[name]
    assert set(ast.literal_eval(names)) == {*built_in, "mine"}
