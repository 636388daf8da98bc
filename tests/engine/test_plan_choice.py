"""``method="auto"``'s choice: candidate plans from one statistics pass, tried on held-out blocks, the lowest loss kept."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import ompmoe
from ompmoe.engine.apply.plan_choice import choose_plan
from ompmoe.engine.perplexity import perplexity
from ompmoe.engine.adapters import SIGMOID_SHARED_GROUPED
from ompmoe.engine.planning.strategy import PruningStrategy, auto_settings
from ompmoe.engine.tiny import tiny_model

from reference import random_ids


def calibrated(model_type: str) -> tuple[torch.nn.Module, ompmoe.MoEStats]:
    model = tiny_model(model_type)
    stats = ompmoe.collect_stats(model, [random_ids(seed=s) for s in range(3)], loss_aware=True)
    return model, stats


def literal_loss(model: torch.nn.Module, plan: ompmoe.PruningPlan, blocks: torch.Tensor) -> float:
    """The mean next-token loss of a really pruned copy of ``model``."""
    return math.log(perplexity(ompmoe.prune(copy.deepcopy(model), plan), blocks))


SOFTMAX = [("omp_normalized", "loss"), ("omp", "waterfill")]


def test_auto_tries_the_settings_of_the_layout_and_a_fixed_half_stays_fixed():
    auto = PruningStrategy(method="auto", allocation="auto")
    assert auto.settings("qwen3_moe") == list(auto_settings("qwen3_moe")) == SOFTMAX
    assert auto.settings("glm4_moe") == auto.settings("deepseek_v3") == list(SIGMOID_SHARED_GROUPED) == [("reap", "waterfill")]
    # auto beside a named method is that method's own allocation, as it is published: never a trial
    assert PruningStrategy(method="omp", allocation="auto").settings("qwen3_moe") == [("omp", "waterfill")]
    assert PruningStrategy(method="reap", allocation="auto").settings("qwen3_moe") == [("reap", "uniform")]
    assert PruningStrategy(method="auto", allocation="uniform").settings("mixtral") == [
        ("omp_normalized", "uniform"), ("omp", "uniform")]
    assert PruningStrategy(method="reap", allocation="waterfill").settings("qwen3_moe") == [("reap", "waterfill")]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_candidates_are_the_plans_of_each_setting_and_the_choice_has_the_lowest_literal_loss(model_type):
    model, stats = calibrated(model_type)
    strategy = PruningStrategy(ratio=0.5, method="auto", allocation="auto", min_kept_fraction=0.25)
    candidates = strategy.candidates(stats)
    for plan, (method, allocation) in zip(candidates, SOFTMAX, strict=True):
        assert plan == ompmoe.plan_pruning(stats, 0.5, method=method, allocation=allocation, min_kept_fraction=0.25)
    held_out = random_ids(batch=3, seq=16, seed=99)
    literal = [literal_loss(model, plan, held_out) for plan in candidates]
    assert len({round(loss, 6) for loss in literal}) > 1  # the candidates differ, so the choice matters
    model.train()
    choice = ompmoe.choose_plan(model, candidates, held_out)
    assert model.training  # the mode is given back
    assert list(choice.losses.values()) == pytest.approx(literal, abs=1e-5)
    assert choice.index == literal.index(min(literal)) and choice.plan is candidates[choice.index]
    assert choice.summary() == (
        f"chose {choice.plan.method} + {choice.plan.allocation} by its loss on held-out calibration blocks ("
        + ", ".join(f"{m} + {a} {loss:.4f}" for (m, a), loss in zip(SOFTMAX, choice.losses.values())) + ")")


def test_a_layout_with_one_setting_has_one_candidate_the_recommended_plan():
    model, stats = calibrated("glm4_moe")
    auto = PruningStrategy(ratio=0.5, method="auto", allocation="auto")
    assert auto.candidates(stats) == [auto.plan(stats)] == [ompmoe.plan_pruning(stats, 0.5, method="reap")]


def test_equal_candidates_are_measured_once_and_the_first_wins(monkeypatch):
    import ompmoe.engine.apply.plan_choice as plan_choice

    model, stats = calibrated("qwen3_moe")
    plan = ompmoe.plan_pruning(stats, 0.5)
    twin = copy.deepcopy(plan)
    twin.method = "omp_twin"
    calls = []
    monkeypatch.setattr(plan_choice, "perplexity", lambda *args: calls.append(args) or math.e)
    choice = choose_plan(model, [plan, twin], random_ids(seed=5))
    assert len(calls) == 1 and choice.index == 0
    assert choice.losses == {"omp + waterfill": 1.0, "omp_twin + waterfill": 1.0}


def test_bad_choice_input_is_refused_with_the_shape_it_needs():
    model, stats = calibrated("qwen3_moe")
    with pytest.raises(ValueError, match=r"^choose_plan needs at least one candidate plan\.$"):
        choose_plan(model, [], random_ids())
    with pytest.raises(ValueError) as error:
        choose_plan(model, [ompmoe.plan_pruning(stats, 0.5)], torch.arange(16))
    assert str(error.value) == "choose_plan needs (num_blocks, seq_len) token ids with seq_len >= 2; got shape (16,)."


def test_a_strategy_of_ones_own_still_needs_only_validate_and_plan():
    class KeepAll:
        def validate(self, routings):
            return None

        def plan(self, stats):
            return ompmoe.plan_pruning(stats, 0.0)

    assert isinstance(KeepAll(), ompmoe.Strategy) and not hasattr(KeepAll(), "settings")
