"""Plans, statistics, records and calibration batches that do not fit are refused before any change."""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import ompmoe
from ompmoe.engine.apply.adaptive import adaptive_report, enable_adaptive, is_adaptive, reset_adaptive_counters
from ompmoe import MoEStats, collect_stats, plan_pruning, prune
from ompmoe.engine.apply.adaptive import ADAPTIVE_WARNING
from ompmoe.engine.collect.collector import CalibrationInputError
from ompmoe.engine.planning.plan import PlanMismatchError, PruningPlan
from ompmoe.engine.export.load import load_pruned
from ompmoe.engine.export.save import save_pruned
from ompmoe.engine.collect.statistics import FingerprintMismatchError, StatsFileError, model_fingerprint

from reference import make_model, random_ids

LAYERS = ["model.layers.1.mlp", "model.layers.2.mlp", "model.layers.3.mlp"]
FIX = "Make the plan with ompmoe.plan_pruning on statistics of this model."


def qwen() -> torch.nn.Module:
    return make_model("qwen3_moe", num_hidden_layers=4)  # MoE layers 1..3, 16 experts, top-4


@pytest.fixture(scope="module")
def stats() -> MoEStats:
    return collect_stats(qwen(), [random_ids(seed=1)])


@pytest.fixture(scope="module")
def plan(stats) -> PruningPlan:
    return plan_pruning(stats, 0.5)


def edited(plan: PruningPlan, layer: int = 0, **changes) -> PruningPlan:
    plan = copy.deepcopy(plan)
    plan.layers[layer] = dataclasses.replace(plan.layers[layer], **changes)
    return plan


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def assert_refused_untouched(plan: PruningPlan, message: str) -> None:
    model = qwen()
    before = weights(model)
    with pytest.raises(PlanMismatchError, match=re.escape(message)):
        prune(model, plan)
    after = weights(model)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert ompmoe.pruning_info(model) is None


# ----------------------------------------------------------------------------------- plans
def test_duplicate_ids(plan):
    assert_refused_untouched(
        edited(plan, kept=[0, 0, 0, 0]), f"Plan layer {LAYERS[0]}: expert id 0 is listed twice. {FIX}"
    )


def test_out_of_range_id_in_second_layer_leaves_first_layer_whole(plan):
    kept = plan.layers[1].kept[:-1] + [16]
    assert_refused_untouched(
        edited(plan, 1, kept=kept),
        f"Plan layer {LAYERS[1]}: expert id 16 is out of range for 16 experts (valid ids 0..15). {FIX}",
    )


@pytest.mark.parametrize(
    "kept, message",
    [
        ([], "keeps no expert (empty list); every MoE layer needs experts."),
        ([-1, 1, 2, 3], "expert id -1 is out of range for 16 experts (valid ids 0..15)."),
        ([0.0, 1, 2, 3], "expert id 0.0 is a float, not an int."),
        ([0, 1, 2], "keeps 3 experts but its router (top_k=4, 1 groups) needs at least 4."),
    ],
)
def test_bad_kept_lists(plan, kept, message):
    assert_refused_untouched(edited(plan, kept=kept), f"Plan layer {LAYERS[0]}: {message} {FIX}")


def test_layers_reordered_renamed_missing_or_extra(plan):
    swapped = copy.deepcopy(plan)
    swapped.layers[0], swapped.layers[1] = swapped.layers[1], swapped.layers[0]
    assert_refused_untouched(
        swapped,
        f"MoE layer 0 of the plan is {LAYERS[1]!r} but this model's is {LAYERS[0]!r} "
        f"(plans apply by name, in model order). {FIX}",
    )
    assert_refused_untouched(
        edited(plan, 2, name="model.layers.9.mlp"),
        f"MoE layer 2 of the plan is 'model.layers.9.mlp' but this model's is {LAYERS[2]!r}",
    )
    fewer = copy.deepcopy(plan)
    fewer.layers = fewer.layers[:2]
    assert_refused_untouched(fewer, f"The plan has 2 MoE layers but this model has 3 ({LAYERS[0]} .. {LAYERS[2]}). {FIX}")
    more = copy.deepcopy(plan)
    more.layers.append(more.layers[-1])
    assert_refused_untouched(more, "The plan has 4 MoE layers but this model has 3")


def test_wrong_expert_count(plan):
    assert_refused_untouched(
        edited(plan, num_experts=12), f"Plan layer {LAYERS[0]} was made for 12 experts but the model's layer has 16. {FIX}"
    )


def test_grouped_router_needs_balanced_groups():
    model = make_model("deepseek_v2_grouped", num_hidden_layers=3)
    stats = collect_stats(model, [random_ids(seed=2)])
    good = plan_pruning(stats, 0.5, allocation="uniform")
    layer = good.layers[0]
    groups = layer.num_groups
    size = layer.num_experts // groups
    kept = list(range(len(layer.kept)))  # all from the first groups
    bad = edited(good, kept=kept)
    per_group = [sum(1 for e in kept if e // size == g) for g in range(groups)]
    with pytest.raises(PlanMismatchError, match=re.escape(f"keeps {per_group} experts in its {groups} groups")):
        prune(model, bad)
    prune(model, good)  # the planner's own plan passes


def test_valid_plan_still_prunes_and_a_repruned_record_is_checked(plan):
    model = prune(qwen(), plan)
    assert ompmoe.pruning_info(model)["kept_experts"] == plan.kept_by_layer()
    model.config.ompmoe["kept_experts"][LAYERS[0]] = [0] * len(plan.layers[0].kept)
    second = plan_pruning(collect_stats(model, [random_ids(seed=3)]), 0.25, allocation="uniform", min_kept_fraction=0.25)
    with pytest.raises(PlanMismatchError, match=re.escape(
        f"this model's config.ompmoe, layer {LAYERS[0]}: expert id 0 is listed twice."
    )):
        prune(model, second)


# ----------------------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(ratio="0.5"), TypeError, "ratio must be a real number (e.g. 0.5); got str '0.5'."),
        (dict(ratio=True), TypeError, "ratio must be a real number (e.g. 0.5); got bool True."),
        (dict(ratio=float("nan")), ValueError, "ratio must be a finite number; got nan."),
        (dict(ratio=0.5, risk_weight=float("nan")), ValueError, "risk_weight must be a finite number; got nan."),
        (dict(ratio=0.5, risk_weight=-1), ValueError, "risk_weight=-1.0 must be >= 0"),
        (dict(ratio=0.5, zeta=-1e-6), ValueError, "zeta=-1e-06 must be > 0"),
        (dict(ratio=0.5, zeta=0), ValueError, "zeta=0.0 must be > 0 (the stabilizer inside log(C(k) + zeta); the paper uses 1e-6)."),
        (dict(ratio=0.5, max_kept_fraction=float("inf")), ValueError, "max_kept_fraction must be a finite number; got inf."),
    ],
)
def test_plan_arguments_refused(stats, kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        plan_pruning(stats, **kwargs)
    with pytest.raises(error, match=re.escape(message)):
        ompmoe.PruningStrategy(**kwargs).validate([(layer.name, layer.routing) for layer in stats.layers])


@pytest.mark.parametrize("ratio", [np.float32(0.5), np.float64(0.5), torch.tensor(0.5), 0.5])
def test_numeric_ratio_types_plan_and_save(stats, ratio, tmp_path):
    plan = plan_pruning(stats, ratio, risk_weight=np.float32(3.0))
    assert type(plan.ratio) is float and plan.ratio == 0.5 and np.isfinite(plan.cost)
    assert plan.layers == plan_pruning(stats, 0.5).layers
    loaded = PruningPlan.load(plan.save(tmp_path / "plan.json"))
    assert loaded.ratio == 0.5 and loaded.layers == plan.layers


def test_plan_with_numpy_fields_saves(plan, tmp_path):
    odd = dataclasses.replace(plan, ratio=np.float32(0.5), cost=np.float64(1.5), num_tokens=np.int64(32))
    data = json.loads(odd.save(tmp_path / "p.json").read_text())
    assert (data["ratio"], data["cost"], data["num_tokens"]) == (0.5, 1.5, 32)


# ----------------------------------------------------------------------------- fingerprint
def test_fingerprint_sees_expert_width_and_attention():
    base = model_fingerprint(qwen())
    assert model_fingerprint(make_model("qwen3_moe", num_hidden_layers=4, seed=5)) == base
    for change in (dict(moe_intermediate_size=64), dict(num_key_value_heads=1), dict(head_dim=16)):
        other = make_model("qwen3_moe", num_hidden_layers=4, **change)
        assert model_fingerprint(other) != base, change


def test_statistics_of_narrower_experts_refused(stats, tmp_path):
    wide = make_model("qwen3_moe", num_hidden_layers=4, moe_intermediate_size=64)
    path = stats.save(tmp_path / "s.safetensors")
    with pytest.raises(FingerprintMismatchError, match="collected on a different model"):
        MoEStats.load(path, model=wide)


def test_statistics_of_an_earlier_format_get_one_clear_error(stats, tmp_path):
    path = tmp_path / "old.safetensors"
    meta = {**stats.metadata(), "format_version": 1}
    tensors = {f"layers.{i}.{k}": v for i, layer in enumerate(stats.layers) for k, v in layer.tensors().items()}
    save_file(tensors, str(path), metadata={"ompmoe": json.dumps(meta)})
    with pytest.raises(StatsFileError) as error:
        MoEStats.load(path)
    assert str(error.value) == (f"{path} has statistics format 1 (written by ompmoe {stats.library_version}); this "
                                "ompmoe reads format 2 only: load it with that version, or re-collect it: "
                                "ompmoe.collect_stats(model, batches).save(path).")


# ----------------------------------------------------------------------------- stats files
def rewrite(stats: MoEStats, path, edit_tensors=None, edit_meta=None):
    src = stats.save(path.with_suffix(".orig.safetensors"), overwrite=True)
    tensors = load_file(str(src))
    with safe_open(str(src), framework="pt") as handle:
        meta = json.loads(handle.metadata()["ompmoe"])
    if edit_tensors:
        edit_tensors(tensors)
    if edit_meta:
        edit_meta(meta)
    save_file(tensors, str(path), metadata={"ompmoe": json.dumps(meta)})
    return path


L1 = LAYERS[1]


def _nan(t):
    t["layers.1.gram"][0, 0] = float("nan")


def _neg_count(t):
    t["layers.1.token_count"][3] = -1.0


def _neg_diag(t):
    t["layers.1.gram"][2, 2] = -5.0


def _asym(t):
    t["layers.1.gram"][0, 1] += 1.0


def _float32(t):
    t["layers.1.routing_mass"] = t["layers.1.routing_mass"].float()


def _missing(t):
    del t["layers.1.norm_sum"]


def _extra(t):
    t["layers.7.gram"] = torch.zeros(2, 2, dtype=torch.float64)


def _twelve(m):
    m["layers"][1]["num_experts"] = 12


def _extra_layer(m):
    m["layers"].append({**m["layers"][-1], "name": "model.layers.4.mlp"})


def _tokens(m):
    m["num_tokens"] = -64


@pytest.mark.parametrize(
    "edit_tensors, edit_meta, message",
    [
        (_nan, None, f"layer 1 ({L1}): tensor 'gram' holds NaN or inf values."),
        (_neg_count, None, f"layer 1 ({L1}): tensor 'token_count' has negative values (-1.0)"),
        (_neg_diag, None, f"layer 1 ({L1}): tensor 'gram' has negative diagonal (-5.0)"),
        (_asym, None, f"layer 1 ({L1}): tensor 'gram' is not symmetric"),
        (_float32, None, f"layer 1 ({L1}): tensor 'routing_mass' is torch.float32, expected torch.float64."),
        (_missing, None, f"layer 1 ({L1}): tensor 'norm_sum' is missing (the metadata lists layer 1)."),
        (_extra, None, "the metadata lists 3 layers but the file holds tensors it does not describe (layers.7.gram, ...)."),
        (None, _twelve, f"layer 1 ({L1}): tensor 'gram' has shape (16, 16) but the metadata says 12 experts (expected (12, 12))."),
        (None, _extra_layer, "layer 3 (model.layers.4.mlp): tensor 'gram' is missing (the metadata lists layer 3)."),
        (None, _tokens, "num_tokens is -64; it must be a positive int."),
    ],
)
def test_corrupt_statistics_files(stats, tmp_path, edit_tensors, edit_meta, message):
    path = rewrite(stats, tmp_path / "bad.safetensors", edit_tensors, edit_meta)
    with pytest.raises(StatsFileError, match=re.escape(message)) as info:
        MoEStats.load(path)
    assert str(info.value).startswith(str(path))
    assert str(info.value).endswith("Re-collect it: ompmoe.collect_stats(model, batches).save(path).")


def test_clean_file_round_trips(stats, tmp_path):
    loaded = MoEStats.load(stats.save(tmp_path / "ok.safetensors"), model=qwen())
    assert all(torch.equal(a.gram, b.gram) for a, b in zip(loaded.layers, stats.layers))
    assert plan_pruning(loaded, 0.5).layers == plan_pruning(stats, 0.5).layers


# --------------------------------------------------------------------------------- records
def saved(plan, tmp_path, edit):
    path = save_pruned(prune(qwen(), plan), tmp_path / "pruned")
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c["ompmoe"]["kept_experts"][LAYERS[0]].__setitem__(0, 99),
         f"config.json's ompmoe record, layer {LAYERS[0]}: expert id 99 is out of range for 16 experts"),
        (lambda c: c["ompmoe"]["kept_experts"][LAYERS[0]].__setitem__(1, c["ompmoe"]["kept_experts"][LAYERS[0]][0]),
         "is listed twice"),
        (lambda c: c["ompmoe"]["kept_experts"].__setitem__(LAYERS[0], []), "keeps no expert (empty list)"),
        (lambda c: c["ompmoe"]["kept_experts"].pop(LAYERS[2]),
         f"config.json's ompmoe record lists layers {LAYERS[:2]} but the model built from config.json has MoE layers {LAYERS}."),
    ],
)
def test_load_pruned_checks_the_record(plan, tmp_path, edit, message):
    with pytest.raises(PlanMismatchError, match=re.escape(message)):
        load_pruned(saved(plan, tmp_path, edit))


def test_load_pruned_refuses_a_non_causal_architecture(plan, tmp_path):
    path = saved(plan, tmp_path, lambda c: c.__setitem__("architectures", ["AutoModel"]))
    with pytest.raises(PlanMismatchError, match=re.escape(
        "config.json names architectures=['AutoModel'], but AutoModel is not a causal-LM or multimodal class for "
        "model_type='qwen3_moe'; ompmoe loads Qwen3MoeForCausalLM."
    )):
        load_pruned(path)
    ok = saved(plan, tmp_path / "b", lambda c: None)
    assert ompmoe.pruning_info(load_pruned(ok))["kept_experts"] == plan.kept_by_layer()


def test_load_pruned_never_asks_for_remote_code(plan, tmp_path, monkeypatch):
    import transformers

    seen = {}
    real = transformers.AutoConfig.from_pretrained

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    def no_remote_code(*args, **kwargs):
        raise AssertionError(f"load_pruned ran remote code {args}")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", spy)
    for module in (transformers.dynamic_module_utils, transformers.models.auto.configuration_auto,
                   transformers.models.auto.auto_factory):
        monkeypatch.setattr(module, "get_class_from_dynamic_module", no_remote_code)
    # A non-uniform checkpoint carries remote code (auto_map); load_pruned reads it with the stock classes.
    path = saved(plan, tmp_path, lambda c: None)
    assert not plan.is_uniform and "auto_map" in json.loads((path / "config.json").read_text())
    assert type(load_pruned(path)).__module__.startswith("transformers.models.qwen3_moe")
    # Older checkpoints (an int count, no auto_map) go through AutoConfig, with remote code off.
    old = saved(plan, tmp_path / "old", lambda c: (c.pop("auto_map"), c.pop("experts_implementation")))
    load_pruned(old)
    assert seen["trust_remote_code"] is False


# ------------------------------------------------------------------------------- collection
def test_adaptive_is_paused_while_collecting():
    ids = [random_ids(seed=7)]
    plain = collect_stats(qwen(), ids)
    model = qwen()
    enable_adaptive(model, plain, epsilon=0.5)
    with pytest.warns(UserWarning, match=re.escape(ADAPTIVE_WARNING)):
        adaptive = collect_stats(model, ids)
    for a, b in zip(adaptive.layers, plain.layers):
        assert all(torch.equal(x, y) for x, y in zip(a.tensors().values(), b.tensors().values()))
    assert is_adaptive(model)
    reset_adaptive_counters(model)
    with torch.no_grad():
        model(ids[0])
    assert sum(s["tokens"] for s in adaptive_report(model).values()) > 0


@pytest.mark.parametrize(
    "batch, message",
    [
        ({"input_ids": random_ids(), "attention_mask": torch.full((2, 16), 7)},
         "attention_mask must hold only 0 and 1 (padding and real tokens); found 7."),
        ({"input_ids": random_ids(), "attention_mask": -torch.ones(2, 16)}, "found -1.0"),
        ({"input_ids": random_ids(), "attention_mask": torch.ones(2, 15)},
         "attention_mask has shape (2, 15) but input_ids has (2, 16)"),
        (torch.full((2, 16), 256), "input_ids hold token id 256 (min 256, max 256) but the model's vocabulary has 256 tokens (valid ids 0..255)"),
        (torch.full((2, 16), -3), "input_ids hold token id -3"),
        (torch.zeros(0, 16, dtype=torch.long), "Calibration batch input_ids has shape (0, 16)"),
        (torch.zeros(2, 0, dtype=torch.long), "Calibration batch input_ids has shape (2, 0)"),
    ],
)
def test_bad_calibration_batches(batch, message):
    with pytest.raises(CalibrationInputError, match=re.escape(message)):
        collect_stats(qwen(), [batch])


def test_a_refused_batch_leaves_the_model_in_its_own_mode():
    model = qwen().train()
    with pytest.raises(CalibrationInputError):
        collect_stats(model, [{"input_ids": random_ids(), "attention_mask": torch.full((2, 16), 7)}])
    assert model.training


def test_bool_and_float_masks_accepted():
    ids = random_ids(seed=4)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :3] = 0
    reference = collect_stats(qwen(), [{"input_ids": ids, "attention_mask": mask}])
    for variant in (mask.bool(), mask.float()):
        other = collect_stats(qwen(), [{"input_ids": ids, "attention_mask": variant}])
        assert other.num_tokens == reference.num_tokens == 29
        assert torch.equal(other.layers[0].gram, reference.layers[0].gram)


def test_token_weights_must_be_0_or_1():
    # The Lightning callback hands masks (times 0/1 sample weights) straight to the metric.
    from ompmoe.engine.collect.sums import MoEStatsMetric

    metric = MoEStatsMetric(ompmoe.find_moe_layers(qwen()))
    with pytest.raises(CalibrationInputError, match=re.escape("Token weights (attention_mask) must be 0 or 1; found 0.5.")):
        metric.set_token_weight(torch.tensor([[1.0, 0.5]]), num_tokens=2)
    assert float(metric.num_tokens) == 0.0
    metric.set_token_weight(torch.tensor([[1, 0, 1]]), num_tokens=3)
    assert float(metric.num_tokens) == 2.0


def test_plan_file_that_is_not_a_plan(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"layers": [{"name": "x"}]}))
    with pytest.raises(PlanMismatchError, match=re.escape(f"{path} is not a valid ompmoe plan (TypeError: ")):
        PruningPlan.load(path)
    with pytest.raises(FileNotFoundError, match=re.escape(f"No plan file at {tmp_path / 'none.json'}")):
        PruningPlan.load(tmp_path / "none.json")
