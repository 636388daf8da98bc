"""``method="auto"``: the setting recommended per architecture (ArchitectureSpec.recommended), in plans and fits."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader

import ompmoe
from ompmoe.callbacks import ExpertPruning
from ompmoe.engine.adapters import ARCHITECTURES, SIGMOID_SHARED_GROUPED
from ompmoe.engine.strategy import PruningStrategy, recommended_setting
from ompmoe.engine.synthetic import synthetic_stats
from ompmoe.engine.tiny import tiny_model
from ompmoe.lightning.calibration_module import CalibrationModule

from reference import batches, trainer


def test_softmax_layouts_get_the_normalized_pursuit_and_sigmoid_grouped_ones_reap():
    assert recommended_setting("qwen3_moe") == ("omp_normalized", "loss")
    assert recommended_setting("glm4_moe") == recommended_setting("deepseek_v3") == SIGMOID_SHARED_GROUPED == ("reap", "waterfill")
    assert all(spec.recommended[0] in ompmoe.METHODS and spec.recommended[1] in ompmoe.ALLOCATIONS
               for spec in ARCHITECTURES.values())


def test_auto_plans_exactly_as_the_recommended_setting_named_explicitly():
    model = tiny_model("glm4_moe")
    stats = ompmoe.collect_stats(model, batches(2))
    auto = PruningStrategy(ratio=0.5, method="auto", allocation="auto").plan(stats)
    assert auto == PruningStrategy(ratio=0.5, method="reap", allocation="waterfill").plan(stats)
    mixed = PruningStrategy(ratio=0.5, method="omp", allocation="auto").plan(stats)
    assert (mixed.method, mixed.allocation) == ("omp", "waterfill")


def test_auto_without_an_architecture_names_the_fix():
    stats = synthetic_stats(num_layers=2, num_experts=8, top_k=2)
    stats.model_type = None
    with pytest.raises(ValueError) as error:
        PruningStrategy(method="auto").plan(stats)
    assert str(error.value).startswith(
        "method/allocation 'auto' picks the setting recommended for the model's architecture, but the statistics "
        "name no architecture; name them instead, e.g. method='omp_normalized', allocation='loss' (supported: ")


def test_the_callback_defaults_to_auto_collects_what_it_needs_and_says_so(monkeypatch):
    import ompmoe.callbacks.pruning

    logged = []
    monkeypatch.setattr(ompmoe.callbacks.pruning, "rank_zero_info", logged.append)
    callback = ExpertPruning()
    trainer(callbacks=[callback]).fit(CalibrationModule("tiny:qwen3_moe"), DataLoader(batches(2), batch_size=2))
    assert (callback.plan.method, callback.plan.allocation) == ("omp_normalized", "loss")
    assert callback.stats.layers[0].gram_loss is not None  # the loss allocation's statistics were collected
    assert logged[0].endswith("(method and allocation 'auto': recommended for qwen3_moe, docs/quality/intervals.md)")
    paper = ExpertPruning(PruningStrategy(method="omp", allocation="waterfill"))
    trainer(callbacks=[paper]).fit(CalibrationModule("tiny:qwen3_moe"), DataLoader(batches(2), batch_size=2))
    assert (paper.plan.method, paper.plan.allocation) == ("omp", "waterfill") and paper.stats.layers[0].gram_loss is None


def test_prune_command_resolves_auto_from_the_statistics_and_says_so(tmp_path, capsys):
    from ompmoe.cli import main

    stats = ompmoe.collect_stats(tiny_model("glm4_moe"), batches(2))
    stats.save(tmp_path / "stats.safetensors")
    main(["prune", "--stats", str(tmp_path / "stats.safetensors"), "--ratio", "0.5", "--method", "auto",
          "--allocation", "auto", "--output_dir", str(tmp_path / "plans"), "--quiet", "false"])
    plan = ompmoe.PruningPlan.load(tmp_path / "plans" / "plan-0.5.json")
    assert (plan.method, plan.allocation) == ("reap", "waterfill")
    assert capsys.readouterr().out.splitlines()[0].endswith(
        "(method and allocation 'auto': recommended for glm4_moe, docs/quality/intervals.md)")
