"""Pruning, saving and reloading of every supported architecture, checked against literal references.

The central check: a pruned model must compute exactly what the ORIGINAL model computes when its
native router can no longer reach the dropped experts. The reference routers below re-implement
each architecture's routing from scratch on the full-size original model and mask the dropped
experts before the top-k (softmax routers renormalise over the kept experts, sigmoid routers score
groups over the kept experts, GPT-OSS masks its biased logits before top-k). Because the reference
keeps the original expert ids, comparing logits also checks the pruned model's id remapping.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import ompmoe
from ompmoe.engine.tiny import TINY_CONFIGS, tiny_model
from ompmoe.engine.apply.trial import pruned_view

ATOL = RTOL = 1e-5
NEG_INF = float("-inf")


# --------------------------------------------------------------------------- literal reference routers
# Each factory returns a forward for one router of the ORIGINAL model that behaves like the native
# router would if the experts outside ``keep`` (a bool mask over original ids) did not exist.


def softmax_router(norm_topk: bool) -> Callable[[nn.Module, torch.Tensor], Callable]:
    """Qwen2/Qwen3-MoE, OLMoE, Mixtral: softmax over the kept experts, top-k, optional renormalisation."""

    def make(router: nn.Module, keep: torch.Tensor) -> Callable:
        def forward(hidden_states: torch.Tensor):
            hidden = hidden_states.reshape(-1, router.hidden_dim)
            logits = F.linear(hidden, router.weight)
            probs = torch.softmax(logits.float().masked_fill(~keep, NEG_INF), dim=-1)
            top_value, top_index = torch.topk(probs, router.top_k, dim=-1)
            if norm_topk:
                top_value = top_value / top_value.sum(dim=-1, keepdim=True)
            return logits, top_value.to(logits.dtype), top_index

        return forward

    return make


def deepseek_v2_router(grouped: bool, num_groups: int, topk_group: int) -> Callable:
    """DeepSeek-V2: softmax over kept experts; greedy top-k, or top-k inside the best groups (max score)."""

    def make(router: nn.Module, keep: torch.Tensor) -> Callable:
        def forward(hidden_states: torch.Tensor):
            hidden = hidden_states.reshape(-1, router.hidden_dim).float()
            logits = F.linear(hidden, router.weight.float())
            scores = torch.softmax(logits.masked_fill(~keep, NEG_INF), dim=-1)
            allowed = keep.expand_as(scores)
            if grouped:
                per_group = scores.shape[-1] // num_groups
                group_scores = scores.masked_fill(~keep, NEG_INF).view(-1, num_groups, per_group).amax(dim=-1)
                best_groups = torch.topk(group_scores, topk_group, dim=-1).indices
                group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best_groups, True)
                allowed = allowed & group_mask.repeat_interleave(per_group, dim=1)
            top_value, top_index = torch.topk(scores.masked_fill(~allowed, NEG_INF), router.top_k, dim=-1)
            return logits, top_value * router.routed_scaling_factor, top_index

        return forward

    return make


def sigmoid_group_router(num_groups: int, topk_group: int, norm_topk: bool, scale: float) -> Callable:
    """DeepSeek-V3 / GLM-4-MoE: sigmoid scores plus correction bias; a group scores the sum of its two
    best kept experts; top-k among kept experts of the best groups; weights are the plain sigmoid scores."""

    def make(router: nn.Module, keep: torch.Tensor) -> Callable:
        def forward(hidden_states: torch.Tensor):
            hidden = hidden_states.reshape(-1, router.hidden_dim).float()
            logits = F.linear(hidden, router.weight.float())
            scores = torch.sigmoid(logits)
            choice = (scores + router.e_score_correction_bias).masked_fill(~keep, NEG_INF)
            per_group = choice.shape[-1] // num_groups
            group_scores = choice.view(-1, num_groups, per_group).topk(2, dim=-1).values.sum(dim=-1)
            best_groups = torch.topk(group_scores, topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best_groups, True)
            allowed = keep & group_mask.repeat_interleave(per_group, dim=1)
            top_index = torch.topk(choice.masked_fill(~allowed, NEG_INF), router.top_k, dim=-1).indices
            weights = scores.gather(1, top_index)
            if norm_topk:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            return logits, weights * scale, top_index

        return forward

    return make


def gpt_oss_router(router: nn.Module, keep: torch.Tensor) -> Callable:
    """GPT-OSS: biased logits, dropped experts masked to -inf before top-k, softmax over the top-k values."""

    def forward(hidden_states: torch.Tensor):
        logits = F.linear(hidden_states, router.weight, router.bias)
        top_value, top_index = torch.topk(logits.masked_fill(~keep, NEG_INF), router.top_k, dim=-1)
        return logits, torch.softmax(top_value, dim=1), top_index

    return forward


# --------------------------------------------------------------------------- architectures under test


@dataclass(frozen=True)
class Case:
    model_type: str
    overrides: dict[str, Any]
    count_key: str
    """Config key holding the number of routed experts."""
    router_attr: str
    reference: Callable[[nn.Module, torch.Tensor], Callable]
    router_tensors: tuple[str, ...]
    expert_tensors: tuple[str, ...]
    num_groups: int
    """Router groups (1 when routing is not group-limited); kept experts must be equal per group."""
    handmade_per_group: tuple[int, ...]
    """Kept experts per group for each MoE layer of the hand-made non-uniform plan (cycled)."""
    extra: dict[str, Any] = field(default_factory=dict)

    def model(self, seed: int = 0) -> nn.Module:
        return tiny_model(self.model_type, seed=seed, **self.overrides)


GLU = ("gate_up_proj", "down_proj")
CASES = {
    "qwen3_moe": Case(
        "qwen3_moe", {}, "num_experts", "gate", softmax_router(norm_topk=True), ("weight",), GLU, 1, (12, 5)
    ),
    "qwen2_moe": Case(
        "qwen2_moe", {}, "num_experts", "gate", softmax_router(norm_topk=False), ("weight",), GLU, 1, (12, 5, 9)
    ),
    "mixtral": Case(
        "mixtral", {}, "num_local_experts", "gate", softmax_router(norm_topk=True), ("weight",), GLU, 1, (6, 3, 5)
    ),
    "olmoe": Case(
        "olmoe", {}, "num_experts", "gate", softmax_router(norm_topk=False), ("weight",), GLU, 1, (5, 12, 9)
    ),
    "deepseek_v2": Case(
        "deepseek_v2", {}, "n_routed_experts", "gate", deepseek_v2_router(False, 4, 2), ("weight",), GLU, 1, (11, 6)
    ),
    "deepseek_v2_grouped": Case(
        "deepseek_v2", {"topk_method": "group_limited_greedy"}, "n_routed_experts", "gate",
        deepseek_v2_router(True, 4, 2), ("weight",), GLU, 4, (3, 2),
    ),
    "deepseek_v3": Case(
        "deepseek_v3", {}, "n_routed_experts", "gate", sigmoid_group_router(4, 2, True, 2.5),
        ("weight", "e_score_correction_bias"), GLU, 4, (2, 3),
    ),
    "glm4_moe": Case(
        "glm4_moe", {}, "n_routed_experts", "gate", sigmoid_group_router(2, 1, True, 1.5),
        ("weight", "e_score_correction_bias"), GLU, 2, (6, 4),
    ),
    "gpt_oss": Case(
        "gpt_oss", {}, "num_local_experts", "router", gpt_oss_router, ("weight", "bias"),
        ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"), 1, (3, 6, 5),
    ),
}
CASE_IDS = list(CASES)


def test_cases_cover_every_tiny_and_supported_architecture():
    covered = {case.model_type for case in CASES.values()}
    assert covered == set(TINY_CONFIGS) == set(ompmoe.supported_model_types())
    methods = {
        case_id: {router.topk_method for router in routers(original(case_id)[0], CASES[case_id]).values()}
        for case_id in ("deepseek_v2", "deepseek_v2_grouped")
    }
    assert methods == {"deepseek_v2": {"greedy"}, "deepseek_v2_grouped": {"group_limited_greedy"}}


# --------------------------------------------------------------------------- helpers

INPUT_IDS = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(1234))
CALIBRATION = [torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]

_ORIGINALS: dict[str, tuple[nn.Module, ompmoe.MoEStats]] = {}


def original(case_id: str) -> tuple[nn.Module, ompmoe.MoEStats]:
    """A fresh copy of the case's tiny model and its (cached) calibration statistics."""
    if case_id not in _ORIGINALS:
        model = CASES[case_id].model()
        _ORIGINALS[case_id] = (model, ompmoe.collect_stats(model, CALIBRATION))
    model, stats = _ORIGINALS[case_id]
    return copy.deepcopy(model), stats


@torch.no_grad()
def logits_of(model: nn.Module, input_ids: torch.Tensor = INPUT_IDS) -> torch.Tensor:
    return model(input_ids=input_ids, use_cache=False).logits


def routers(model: nn.Module, case: Case) -> dict[str, nn.Module]:
    """Every router module of ``model`` keyed by its sparse block's path, found by class name."""
    found = {}
    for name, module in model.named_modules():
        router = getattr(module, case.router_attr, None)
        if router is not None and type(router).__name__.lower().endswith("router"):
            found[name] = router
    assert found, f"no router found in {type(model).__name__}"
    return found


@contextmanager
def reference_routing(model: nn.Module, case: Case, kept: dict[str, list[int]]):
    """Within the context, every router of the original ``model`` only reaches its ``kept`` experts."""
    found = routers(model, case)
    assert set(found) == set(kept), "every MoE block of the model must have a kept list"
    try:
        for name, router in found.items():
            keep = torch.zeros(router.weight.shape[0], dtype=torch.bool)
            keep[kept[name]] = True
            router.forward = case.reference(router, keep)
        yield
    finally:
        for router in found.values():
            router.__dict__.pop("forward", None)


def reference_logits(model: nn.Module, case: Case, kept: dict[str, list[int]]) -> torch.Tensor:
    with reference_routing(model, case, kept):
        return logits_of(model)


def pick_kept(num_experts: int, per_group: int, num_groups: int, seed: int) -> list[int]:
    """``per_group`` random experts of each of ``num_groups`` equal groups, ascending."""
    size = num_experts // num_groups
    generator = torch.Generator().manual_seed(seed)
    kept = []
    for group in range(num_groups):
        kept += (group * size + torch.randperm(size, generator=generator)[:per_group]).tolist()
    return sorted(kept)


def handmade_plan(case_id: str, stats: ompmoe.MoEStats) -> ompmoe.PruningPlan:
    """A real uniform plan whose kept lists are replaced so that layers keep different counts."""
    case = CASES[case_id]
    plan = ompmoe.plan_pruning(stats, 0.5, allocation="uniform")
    for i, layer in enumerate(plan.layers):
        per_group = case.handmade_per_group[i % len(case.handmade_per_group)]
        layer.kept = pick_kept(layer.num_experts, per_group, case.num_groups, seed=100 + i)
    counts = [layer.num_kept for layer in plan.layers]
    assert len(set(counts)) > 1, counts
    for layer in plan.layers:
        assert layer.num_kept >= layer.top_k
    return plan


def make_plan(case_id: str, kind: str, stats: ompmoe.MoEStats) -> ompmoe.PruningPlan:
    if kind == "handmade":
        return handmade_plan(case_id, stats)
    return ompmoe.plan_pruning(stats, 0.5, allocation=kind)


def kept_map(plan: ompmoe.PruningPlan) -> dict[str, list[int]]:
    return {layer.name: sorted(layer.kept) for layer in plan.layers}


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


# --------------------------------------------------------------------------- 1. literal correctness


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_reference_router_with_all_experts_reproduces_native_model(case_id):
    """The literal reference routers are faithful: keeping every expert changes nothing."""
    model, _ = original(case_id)
    case = CASES[case_id]
    everything = {name: list(range(router.weight.shape[0])) for name, router in routers(model, case).items()}
    torch.testing.assert_close(reference_logits(model, case, everything), logits_of(model), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kind", ["uniform", "waterfill", "handmade"])
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_pruned_logits_equal_original_with_dropped_experts_unreachable(case_id, kind):
    case = CASES[case_id]
    model, stats = original(case_id)
    reference_model = copy.deepcopy(model)
    plan = make_plan(case_id, kind, stats)
    kept = kept_map(plan)

    expected = reference_logits(reference_model, case, kept)
    if kind != "waterfill":
        # The masking must matter here, or this test could not tell wrong routing from right routing.
        # (A calibrated waterfill plan may keep every expert these tokens reach: GPT-OSS's tiny
        # routers send all calibration tokens to a few experts; its slices are still checked.)
        assert not torch.allclose(expected, logits_of(reference_model), atol=1e-3)

    pruned = ompmoe.prune(model, plan)
    assert pruned is model
    torch.testing.assert_close(logits_of(pruned), expected, atol=ATOL, rtol=RTOL)

    record = ompmoe.pruning_info(pruned)
    assert record["kept_experts"] == kept
    assert record["uniform"] == (len({len(ids) for ids in kept.values()}) == 1)
    original_counts = {name: router.weight.shape[0] for name, router in routers(reference_model, case).items()}
    assert record["original_num_experts"] == original_counts


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_pruned_tensors_are_original_tensors_at_kept_ids(case_id):
    case = CASES[case_id]
    model, stats = original(case_id)
    before = state(model)
    plan = handmade_plan(case_id, stats)
    kept = kept_map(plan)
    ompmoe.prune(model, plan)
    after = state(model)

    sliced: set[str] = set()
    for block_name, ids in kept.items():
        block = model.get_submodule(block_name)
        index = torch.tensor(ids)
        router, experts = getattr(block, case.router_attr), block.experts
        for prefix, names in ((case.router_attr, case.router_tensors), ("experts", case.expert_tensors)):
            for name in names:
                key = f"{block_name}.{prefix}.{name}"
                assert torch.equal(after[key], before[key][index]), key
                sliced.add(key)
        assert router.num_experts == experts.num_experts == len(ids)
        assert router.top_k == TINY_CONFIGS[case.model_type][1]["num_experts_per_tok"]
    # Everything else (attention, dense layers, shared experts, norms, embeddings) is untouched.
    assert set(after) == set(before)
    for key in set(before) - sliced:
        assert torch.equal(after[key], before[key]), key
    assert getattr(model.config, case.count_key) == max(len(ids) for ids in kept.values())


@pytest.mark.parametrize("kind", ["uniform", "handmade"])
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_pruned_view_computes_the_pruned_model_and_leaves_the_model_as_it_was(case_id, kind):
    """``pruned_view`` (candidate plans tried without a copy) equals the literal reference inside, and
    afterwards every tensor and count of the model is the original object with the original values."""
    case = CASES[case_id]
    model, stats = original(case_id)
    plan = make_plan(case_id, kind, stats)
    expected = reference_logits(copy.deepcopy(model), case, kept_map(plan))
    before, unpruned = state(model), logits_of(model)
    tensors = {name: tensor for name, tensor in model.named_parameters()}
    with pruned_view(model, plan) as viewed:
        assert viewed is model
        torch.testing.assert_close(logits_of(model), expected, atol=ATOL, rtol=RTOL)
        assert {name: router.num_experts for name, router in routers(model, case).items()} == {
            name: len(ids) for name, ids in kept_map(plan).items()}
    assert torch.equal(logits_of(model), unpruned)
    assert dict(model.named_parameters()) == tensors
    after = state(model)
    assert all(torch.equal(after[key], value) for key, value in before.items())
    assert all(router.num_experts == stats.layers[0].num_experts for router in routers(model, case).values())


def test_pruned_view_restores_the_model_when_its_body_raises():
    model, stats = original("glm4_moe")
    plan = make_plan("glm4_moe", "handmade", stats)
    unpruned = logits_of(model)
    with pytest.raises(RuntimeError, match="inside"):
        with pruned_view(model, plan):
            raise RuntimeError("inside")
    assert torch.equal(logits_of(model), unpruned)


# --------------------------------------------------------------------------- 2-4. round trips


@torch.no_grad()
def generate(model: nn.Module) -> torch.Tensor:
    return model.generate(INPUT_IDS, max_new_tokens=4, do_sample=False)


@pytest.mark.parametrize("kind", ["uniform", "handmade"])
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_save_and_load_round_trip(case_id, kind, tmp_path):
    case = CASES[case_id]
    model, stats = original(case_id)
    plan = make_plan(case_id, kind, stats)
    assert plan.is_uniform == (kind == "uniform")
    kept = kept_map(plan)
    ompmoe.prune(model, plan)
    expected_logits = logits_of(model)
    expected_tokens = generate(model)
    assert expected_tokens.shape == (INPUT_IDS.shape[0], INPUT_IDS.shape[1] + 4)
    assert torch.equal(expected_tokens[:, : INPUT_IDS.shape[1]], INPUT_IDS)

    target = tmp_path / "pruned"
    assert ompmoe.save_pruned(model, target) == target
    assert leftovers(tmp_path) == []

    saved = json.loads((target / "config.json").read_text())
    assert saved["ompmoe"]["kept_experts"] == kept
    assert saved["ompmoe"]["uniform"] is (kind == "uniform")
    if kind == "uniform":
        saved_config = transformers.AutoConfig.from_pretrained(target)
        assert getattr(saved_config, case.count_key) == max(len(ids) for ids in kept.values())
    else:  # the largest count, and an experts implementation every stock model class refuses (tests/engine/test_export.py)
        from ompmoe.engine.export.config import load_stock_config
        from ompmoe.engine.export.hub_code import HOW_TO_LOAD

        assert saved["experts_implementation"] == HOW_TO_LOAD
        assert getattr(load_stock_config(target), case.count_key) == max(len(ids) for ids in kept.values())

    loaded = ompmoe.load_pruned(target)
    assert type(loaded) is type(model)
    assert not loaded.training
    assert ompmoe.pruning_info(loaded) == ompmoe.pruning_info(model)
    for block_name, ids in kept.items():
        block = loaded.get_submodule(block_name)
        assert block.experts.num_experts == getattr(block, case.router_attr).num_experts == len(ids)
    assert torch.equal(logits_of(loaded), expected_logits)
    assert torch.equal(generate(loaded), expected_tokens)

    if kind == "uniform":
        plain = transformers.AutoModelForCausalLM.from_pretrained(target)
        assert type(plain) is type(model)
        assert ompmoe.pruning_info(plain) == ompmoe.pruning_info(model)
        assert torch.equal(logits_of(plain), expected_logits)
        assert torch.equal(generate(plain), expected_tokens)


def test_load_pruned_loads_an_unpruned_model_as_usual(tmp_path):
    model, _ = original("qwen3_moe")
    model.save_pretrained(tmp_path / "plain")
    loaded = ompmoe.load_pruned(tmp_path / "plain")
    assert ompmoe.pruning_info(loaded) is None
    assert torch.equal(logits_of(loaded), logits_of(model))


# --------------------------------------------------------------------------- 5. pruning twice


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_pruning_twice_records_original_ids(case_id, tmp_path):
    case = CASES[case_id]
    model, stats = original(case_id)
    reference_model = copy.deepcopy(model)
    before = state(model)
    num_experts = stats.layers[0].num_experts  # 16, or 8 for Mixtral and GPT-OSS
    first_count, second_count = num_experts * 3 // 4, num_experts // 2

    first = ompmoe.plan_pruning(stats, 0.5, allocation="uniform")
    for i, layer in enumerate(first.layers):
        layer.kept = pick_kept(num_experts, first_count // case.num_groups, case.num_groups, seed=7 + i)
    first_kept = kept_map(first)
    ompmoe.prune(model, first)

    # The first plan no longer matches the pruned model.
    snapshot = state(model)
    with pytest.raises(ompmoe.FingerprintMismatchError, match="Collect statistics and plan on this model"):
        ompmoe.prune(model, first)
    assert all(torch.equal(snapshot[k], v) for k, v in state(model).items())
    assert ompmoe.pruning_info(model)["kept_experts"] == first_kept

    restats = ompmoe.collect_stats(model, CALIBRATION)
    second = ompmoe.plan_pruning(restats, 1.0 - second_count / first_count, allocation="uniform")
    assert [layer.num_kept for layer in second.layers] == [second_count] * len(second.layers)
    ompmoe.prune(model, second)

    record = ompmoe.pruning_info(model)
    expected = {name: [first_kept[name][i] for i in layer.kept] for name, layer in zip(first_kept, second.layers)}
    assert record["kept_experts"] == expected
    assert record["original_num_experts"] == {name: num_experts for name in first_kept}
    assert record["uniform"] is True
    for block_name, ids in expected.items():
        assert len(ids) == second_count and set(ids) <= set(first_kept[block_name])
        for prefix, names in ((case.router_attr, case.router_tensors), ("experts", case.expert_tensors)):
            for name in names:
                key = f"{block_name}.{prefix}.{name}"
                assert torch.equal(model.state_dict()[key], before[key][torch.tensor(ids)]), key

    # Twice pruned = the original model routed to the recorded original ids only; and it reloads.
    expected_logits = reference_logits(reference_model, case, expected)
    torch.testing.assert_close(logits_of(model), expected_logits, atol=ATOL, rtol=RTOL)
    ompmoe.save_pruned(model, tmp_path / "twice")
    loaded = ompmoe.load_pruned(tmp_path / "twice")
    assert ompmoe.pruning_info(loaded)["kept_experts"] == expected
    assert torch.equal(logits_of(loaded), logits_of(model))


# --------------------------------------------------------------------------- 6. errors


def test_plan_for_a_different_model_is_refused_and_leaves_the_model_alone():
    qwen, qwen_stats = original("qwen3_moe")
    olmoe, _ = original("olmoe")
    plan = ompmoe.plan_pruning(qwen_stats, 0.5, allocation="uniform")
    before = state(olmoe)
    with pytest.raises(ompmoe.FingerprintMismatchError) as error:
        ompmoe.prune(olmoe, plan)
    message = str(error.value)
    assert f"fingerprint {plan.fingerprint}" in message
    assert f"this model has fingerprint {ompmoe.model_fingerprint(olmoe)}" in message
    assert "Collect statistics and plan on this model" in message
    assert ompmoe.pruning_info(olmoe) is None
    after = state(olmoe)
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)

    # Same architecture, different expert count: still a different model.
    smaller = tiny_model("qwen3_moe", num_experts=8)
    with pytest.raises(ompmoe.FingerprintMismatchError, match="Collect statistics"):
        ompmoe.prune(smaller, plan)


def test_save_refuses_existing_directory_without_overwrite(tmp_path):
    model, stats = original("mixtral")
    ompmoe.prune(model, ompmoe.plan_pruning(stats, 0.5, allocation="uniform"))
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("precious")

    with pytest.raises(ompmoe.OutputExistsError, match=r"already exists; pass --overwrite \(overwrite=True in Python\)") as error:
        ompmoe.save_pruned(model, target)
    assert isinstance(error.value, FileExistsError)
    assert str(target) in str(error.value)
    assert sorted(p.name for p in target.iterdir()) == ["keep.txt"]
    assert (target / "keep.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    # overwrite=True never deletes a directory ompmoe did not write (issue 15); its own output is replaced.
    with pytest.raises(ompmoe.engine.io.OutputNotReplaceableError, match=r"out is not an ompmoe output"):
        ompmoe.save_pruned(model, target, overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == ["keep.txt"]
    (target / ompmoe.engine.io.MARKER).write_text("{}")
    ompmoe.save_pruned(model, target, overwrite=True)
    assert not (target / "keep.txt").exists()
    assert json.loads((target / "config.json").read_text())["ompmoe"] == ompmoe.pruning_info(model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert torch.equal(logits_of(ompmoe.load_pruned(target)), logits_of(model))


class ExplodingTokenizer:
    def __init__(self):
        self.calls = []

    def save_pretrained(self, path):
        self.calls.append(Path(path))
        (Path(path) / "tokenizer.json").write_text("{}")  # a partial write before failing
        raise RuntimeError("disk full while writing the tokenizer")


class RecordingTokenizer:
    def save_pretrained(self, path):
        (Path(path) / "tokenizer_config.json").write_text(json.dumps({"recorded": True}))


def test_failed_save_leaves_nothing_behind(tmp_path):
    model, stats = original("gpt_oss")
    ompmoe.prune(model, ompmoe.plan_pruning(stats, 0.5, allocation="uniform"))
    target = tmp_path / "out"
    tokenizer = ExplodingTokenizer()
    with pytest.raises(RuntimeError, match="disk full"):
        ompmoe.save_pruned(model, target, tokenizer=tokenizer)
    assert len(tokenizer.calls) == 1 and tokenizer.calls[0] != target  # it wrote into a temporary sibling
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []

    # With overwrite=True a failed save keeps the previous output intact.
    target.mkdir()
    (target / "keep.txt").write_text("previous")
    (target / ompmoe.engine.io.MARKER).write_text("{}")  # an earlier ompmoe output
    with pytest.raises(RuntimeError, match="disk full"):
        ompmoe.save_pruned(model, target, tokenizer=ExplodingTokenizer(), overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == [ompmoe.engine.io.MARKER, "keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    # A working tokenizer is saved next to the model.
    ompmoe.save_pruned(model, tmp_path / "ok", tokenizer=RecordingTokenizer())
    assert json.loads((tmp_path / "ok" / "tokenizer_config.json").read_text()) == {"recorded": True}
    assert (tmp_path / "ok" / "config.json").is_file()
    assert leftovers(tmp_path) == []


def test_handmade_plans_respect_router_constraints():
    """Guards the test fixtures themselves: hand-made kept lists are equal per group and >= top_k."""
    for case_id, case in CASES.items():
        _, stats = original(case_id)
        plan = handmade_plan(case_id, stats)
        for layer in plan.layers:
            size = layer.num_experts // case.num_groups
            per_group = [sum(1 for e in layer.kept if e // size == g) for g in range(case.num_groups)]
            assert len(set(per_group)) == 1, (case_id, layer.name, per_group)
            assert layer.kept == sorted(set(layer.kept)) and 0 <= layer.kept[0] and layer.kept[-1] < layer.num_experts
            assert layer.num_kept >= layer.top_k


def test_non_uniform_pruning_turns_off_the_pooled_router_aux_loss():
    model = tiny_model("qwen3_moe", output_router_logits=True)
    stats = ompmoe.collect_stats(model, [torch.randint(0, 256, (2, 12))])
    plan = ompmoe.plan_pruning(stats, 0.5)
    plan.layers[0].kept = plan.layers[0].order[:9]
    plan.layers[1].kept = plan.layers[1].order[:7]
    ompmoe.prune(model, plan)
    assert model.config.output_router_logits is False
    assert ompmoe.pruning_info(model)["router_aux_loss"] is True  # FinetuneModule keeps a per-layer aux loss
    model(torch.randint(0, 256, (1, 8)))  # the pooled aux loss would fail on 9 vs 7 experts


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_vl_moe"])
def test_pruning_leaves_the_config_the_model_was_built_from_as_it_was(model_type):
    """Models built from one config object share it: pruning one changed the object, so a ratio sweep building each
    model from it built the next one pruned (7 experts, a record), then failed with 'the pruning record is corrupt'.
    The pruned model gets its own config (every module holding it, a container's text config too)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from ompmoe.engine.model_classes import text_config
    from ompmoe.engine.tiny import tiny_config

    config = tiny_config(model_type)
    before = config.to_dict()
    build = AutoModelForCausalLM if model_type == "qwen3_moe" else AutoModelForImageTextToText
    plans = []
    for ratio in (0.25, 0.5):
        model = build.from_config(config).eval()
        experts = ompmoe.find_moe_layers(model)[0].num_experts
        assert experts == (config.num_experts if model_type == "qwen3_moe" else config.text_config.num_experts)
        stats = ompmoe.collect_stats(model, [torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(0))],
                                     progress=False)
        plans.append(ompmoe.plan_pruning(stats, ratio, allocation="uniform"))
        ompmoe.prune(model, plans[-1])
        assert config.to_dict() == before and getattr(config, "ompmoe", None) is None
        holders = [module.config for module in model.modules() if "config" in module.__dict__]
        ours = {id(model.config), *(id(value) for value in vars(model.config).values() if hasattr(value, "to_dict"))}
        theirs = {id(config), *(id(value) for value in vars(config).values() if hasattr(value, "to_dict"))}
        assert {id(held) for held in holders} <= ours and not ours & theirs
        assert text_config(model.config).num_experts == ompmoe.find_moe_layers(model)[0].num_experts
    assert [plan.ratio for plan in plans] == [0.25, 0.5]
