"""``method="auto"``: the settings of the model's layout (ArchitectureSpec.auto), tried on held-out calibration blocks
in fits where there are several, else the first."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
from torch.utils.data import DataLoader

import ompmoe
from ompmoe.callbacks import ExpertPruning
from ompmoe.engine.adapters import ARCHITECTURES, SIGMOID_SHARED_GROUPED
from ompmoe.engine.perplexity import perplexity
from ompmoe.engine.planning.strategy import PruningStrategy, recommended_setting
from ompmoe.engine.collect.synthetic import synthetic_stats
from ompmoe.engine.tiny import tiny_model
from ompmoe.lightning.calibration_module import CalibrationModule

from reference import batches, trainer


def test_softmax_layouts_get_the_normalized_pursuit_and_sigmoid_grouped_ones_reap():
    assert recommended_setting("qwen3_moe") == ("omp_normalized", "loss")
    assert recommended_setting("glm4_moe") == recommended_setting("deepseek_v3") == SIGMOID_SHARED_GROUPED[0] == (
        "reap", "waterfill")
    assert all(method in ompmoe.METHODS and allocation in ompmoe.ALLOCATIONS
               for spec in ARCHITECTURES.values() for method, allocation in spec.auto)


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


def test_with_a_calibration_data_module_auto_tries_its_candidates_on_the_blocks_after_the_calibration_ones(monkeypatch):
    import ompmoe.callbacks.pruning

    logged = []
    monkeypatch.setattr(ompmoe.callbacks.pruning, "rank_zero_info", logged.append)
    data = ompmoe.CalibrationDataModule("shipped:mix", tokenizer="bytes", seq_len=32, num_blocks=4, batch_size=2)
    callback = ExpertPruning(PruningStrategy(ratio=0.5, method="auto", allocation="auto"), choice_blocks=2)
    model = CalibrationModule("tiny:qwen3_moe")
    trainer(callbacks=[callback]).fit(model, datamodule=data)
    held_out = ompmoe.CalibrationDataModule("shipped:mix", tokenizer="bytes", seq_len=32, num_blocks=6).blocks[4:]
    assert callback.stats.num_tokens == 4 * 32  # the statistics never saw the choice blocks
    candidates = PruningStrategy(ratio=0.5, method="auto", allocation="auto").candidates(callback.stats)
    original = tiny_model("qwen3_moe")  # what tiny:qwen3_moe loads: the weights before pruning
    literal = [math.log(perplexity(ompmoe.prune(copy.deepcopy(original), plan), held_out)) for plan in candidates]
    assert list(callback.choice.losses.values()) == pytest.approx(literal, abs=1e-5)
    best = candidates[literal.index(min(literal))]
    # the run's plan is the best candidate plus the record of its compensation
    assert dataclasses.replace(callback.plan, extra={}) == best and "compensation" in callback.plan.extra
    assert callback.choice.plan.kept_by_layer() == best.kept_by_layer()
    assert logged[0].endswith(f"(method and allocation 'auto': {callback.choice.summary()})")


def test_auto_without_blocks_to_try_its_candidates_on_says_so_and_takes_the_recommended_setting():
    callback = ExpertPruning(choice_blocks=2)
    with pytest.warns(UserWarning) as caught:
        trainer(callbacks=[callback]).fit(CalibrationModule("tiny:qwen3_moe"), DataLoader(batches(2), batch_size=2))
    assert [str(w.message) for w in caught if "choice_blocks" in str(w.message)] == [
        "ExpertPruning: method/allocation 'auto' tries its candidate plans on held-out calibration blocks, but the "
        "data module (NoneType) has no choice_blocks(n) (ompmoe.CalibrationDataModule has); using the setting "
        "recommended for qwen3_moe instead. Pass choice_blocks=0 to silence this."]
    assert callback.choice is None and (callback.plan.method, callback.plan.allocation) == ("omp_normalized", "loss")


def test_the_default_callback_on_a_plain_dataloader_takes_the_recommended_setting_without_a_warning(recwarn,
                                                                                                    monkeypatch):
    logged = []
    monkeypatch.setattr(ompmoe.callbacks.pruning, "rank_zero_info", logged.append)
    callback = ExpertPruning()
    trainer(callbacks=[callback]).fit(CalibrationModule("tiny:qwen3_moe"), DataLoader(batches(2), batch_size=2))
    assert [str(w.message) for w in recwarn if "choice_blocks" in str(w.message)] == []
    assert callback.choice is None and (callback.plan.method, callback.plan.allocation) == ("omp_normalized", "loss")
    assert logged[0].endswith("(method and allocation 'auto': recommended for qwen3_moe, docs/quality/intervals.md)")


def test_a_layout_with_one_setting_takes_it_without_a_trial_or_a_warning(recwarn):
    data = ompmoe.CalibrationDataModule("shipped:mix", tokenizer="bytes", seq_len=32, num_blocks=4, batch_size=2)
    callback = ExpertPruning()
    trainer(callbacks=[callback]).fit(CalibrationModule("tiny:glm4_moe"), datamodule=data)
    assert callback.choice is None and (callback.plan.method, callback.plan.allocation) == SIGMOID_SHARED_GROUPED[0]
    assert not [w for w in recwarn if "choice_blocks" in str(w.message)]
    assert callback.stats.layers[0].gram_loss is None  # REAP needs no backward


def test_too_little_text_for_the_choice_blocks_fails_before_the_statistics_pass(tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("x" * 100)
    data = ompmoe.CalibrationDataModule(str(text), tokenizer="bytes", seq_len=16, num_blocks=5)
    callback = ExpertPruning(choice_blocks=2)
    with pytest.raises(ValueError) as error:
        trainer(callbacks=[callback]).fit(CalibrationModule("tiny:qwen3_moe"), datamodule=data)
    assert str(error.value) == (
        "Calibration text has 100 tokens: too few for the 5 calibration blocks and the 2 more that method 'auto' "
        "tries its candidate plans on (7 blocks of 16). Add text, lower num_blocks, or set choice_blocks=0 (auto then "
        "takes the setting recommended for the architecture).")
    assert callback.stats is None and callback.pruning.collector.metric.num_tokens == 0


def test_choice_blocks_must_not_be_negative():
    with pytest.raises(ValueError, match=r"^choice_blocks must be >= 0 \(0: no trial of auto's candidate plans\); got -1\.$"):
        ExpertPruning(choice_blocks=-1)
