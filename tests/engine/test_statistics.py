"""collect_stats against statistics built the slow way, plus merging, padding, I/O and input forms."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from ompmoe import (
    FingerprintMismatchError,
    MoEStats,
    OutputExistsError,
    StatisticsCollector,
    __version__,
    collect_stats,
    find_moe_layers,
    model_fingerprint,
)
from ompmoe.engine.collect.statistics import PER_EXPERT_SUMS
from ompmoe.engine.tiny import tiny_model

from reference import ARCH_IDS, assert_gram_close, capture_block_inputs, literal_layer, make_model, random_ids


def assert_stats_close(a: MoEStats, b: MoEStats, rtol: float, exact_counts: bool = True) -> None:
    assert a.num_tokens == b.num_tokens
    assert [(la.name, la.routing) for la in a.layers] == [(lb.name, lb.routing) for lb in b.layers]
    for la, lb in zip(a.layers, b.layers):
        assert_gram_close(la.gram, lb.gram, rtol=rtol)
        for key in PER_EXPERT_SUMS:
            if key == "token_count" and exact_counts:
                assert torch.equal(la.token_count, lb.token_count)
            else:
                torch.testing.assert_close(getattr(la, key), getattr(lb, key), rtol=rtol, atol=rtol)


def assert_stats_equal(a: MoEStats, b: MoEStats) -> None:
    assert a.num_tokens == b.num_tokens
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert (la.name, la.routing) == (lb.name, lb.routing)
        for key, value in la.tensors().items():
            assert torch.equal(value, lb.tensors()[key]), key


# ----------------------------------------------------------------------------- the key test
def test_collected_stats_equal_literal_atoms(collected):
    stats, layers = collected.stats, collected.layers
    assert stats.num_tokens == 32
    assert stats.model_type == collected.model.config.model_type
    assert stats.fingerprint == model_fingerprint(collected.model)
    assert [layer.name for layer in stats.layers] == [layer.name for layer in layers]
    for layer_stats, layer, literal in zip(stats.layers, layers, collected.literal, strict=True):
        assert layer_stats.routing == layer.routing
        assert layer_stats.gram.dtype == torch.float64
        assert layer_stats.gram.shape == (layer.num_experts, layer.num_experts)
        # The literal atoms are non-trivial and every routed slot was counted.
        assert float(literal.gram.diagonal().min()) >= 0 and float(literal.gram.diagonal().max()) > 0
        assert float(literal.token_count.sum()) == 32 * layer.top_k
        assert_gram_close(layer_stats.gram, literal.gram, rtol=1e-5)
        assert torch.equal(layer_stats.token_count, literal.token_count)
        for key in ("routing_mass", "sq_norm_sum", "norm_sum", "weighted_norm_sum"):
            torch.testing.assert_close(getattr(layer_stats, key), literal.tensors()[key], rtol=1e-5, atol=1e-6)
        # Derived quantities follow the literal atoms: ||Y||^2 and ||V_e||^2.
        y = literal.atoms.sum(dim=0)
        assert layer_stats.signal_energy == pytest.approx(float(y.square().sum()), rel=1e-5)
        torch.testing.assert_close(
            layer_stats.atom_energy, literal.atoms.square().sum(dim=(1, 2)), rtol=1e-5, atol=1e-6 * float(y.square().sum())
        )
        torch.testing.assert_close(
            layer_stats.alpha, literal.sq_norm_sum / literal.token_count.clamp(min=1), rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("case", ARCH_IDS)
def test_literal_atoms_sum_to_routed_block_output(case):
    """The reference itself: sum_e V_e is the native routed output (shared experts excluded)."""
    model = make_model(case)
    layers = find_moe_layers(model)
    with capture_block_inputs(layers) as captured, torch.no_grad():
        model(random_ids(batch=1, seq=8, seed=4))
    for layer, inputs in zip(layers, captured):
        hidden = inputs[0]
        _, weights, index = layer.router(hidden)
        with torch.no_grad():
            native = layer.experts(hidden, index, weights)
        literal = literal_layer(layer, hidden)
        torch.testing.assert_close(literal.atoms.sum(dim=0), native.to(torch.float64), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ model left as it was
@pytest.mark.parametrize("case", ARCH_IDS)
def test_instrumented_forward_leaves_logits_unchanged(case):
    model = make_model(case)
    ids = random_ids(seed=5)
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
        collector = StatisticsCollector(model)
        with collector:
            for layer in collector.layers:
                assert "forward" in vars(layer.experts)
            instrumented = collector.forward({"input_ids": ids}).logits
    torch.testing.assert_close(instrumented, plain, rtol=1e-5, atol=1e-5)
    for layer in collector.layers:
        assert "forward" not in vars(layer.experts)
    assert collector.result().num_tokens == 32


@pytest.mark.parametrize("training", [True, False])
def test_collect_stats_restores_forward_and_training_mode(training):
    model = make_model("mixtral").train(training)
    reference = collect_stats(make_model("mixtral"), [random_ids(seed=6)])
    stats = collect_stats(model, [random_ids(seed=6)])
    assert model.training is training
    assert all(module.training is training for module in model.modules())
    assert all("forward" not in vars(layer.experts) for layer in find_moe_layers(model))
    assert_stats_equal(stats, reference)  # statistics are always taken in eval mode


def test_collect_stats_restores_model_after_an_error():
    model = make_model("qwen3_moe").train()
    with pytest.raises(TypeError):
        collect_stats(model, [random_ids(), "not a batch"])
    assert model.training
    assert all("forward" not in vars(layer.experts) for layer in find_moe_layers(model))


@pytest.mark.parametrize("case", ARCH_IDS)
def test_each_expert_module_runs_once_per_batch(case, monkeypatch):
    """The flattened call, used for implementations without a replay (here eager); see test_replay.py."""
    model = make_model(case)
    model.set_experts_implementation("eager")
    layers = find_moe_layers(model)
    experts_cls = type(layers[0].experts)
    native = experts_cls.forward
    calls: list[tuple[int, int]] = []

    def counting(self, hidden_states, *args, **kwargs):
        calls.append((id(self), hidden_states.shape[0]))
        return native(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(experts_cls, "forward", counting)
    batches = [random_ids(seed=7), random_ids(seed=8)]
    with torch.no_grad():
        for batch in batches:
            model(batch, use_cache=False)
    plain_calls = list(calls)
    calls.clear()
    collect_stats(model, batches)
    expected_modules = [id(layer.experts) for layer in layers] * len(batches)
    assert [module for module, _ in plain_calls] == expected_modules
    assert [module for module, _ in calls] == expected_modules
    # One call carries every routed (token, expert) pair of the batch.
    assert [rows for _, rows in calls] == [32 * layer.top_k for layer in layers] * len(batches)


# ------------------------------------------------------------------------------ padding
@pytest.mark.parametrize("case", ARCH_IDS)
def test_padding_is_not_counted(case):
    model = make_model(case)
    ids = random_ids(seed=9)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0  # right padding: the kept prefix sees the same causal context
    padded_ids = ids.clone()
    padded_ids[1, 10:] = 0
    padded = collect_stats(model, [{"input_ids": padded_ids, "attention_mask": mask}])
    separate = collect_stats(model, [ids[0:1], ids[1:2, :10]])
    assert padded.num_tokens == separate.num_tokens == 26
    assert_stats_close(padded, separate, rtol=1e-5)

    # And the padded batch equals the literal statistics over the unmasked tokens only.
    layers = find_moe_layers(model)
    with capture_block_inputs(layers) as captured:
        again = collect_stats(model, [{"input_ids": padded_ids, "attention_mask": mask}])
    assert_stats_equal(again, padded)
    for layer_stats, layer, inputs in zip(padded.layers, layers, captured):
        literal = literal_layer(layer, inputs[0], keep=mask)
        assert float(literal.token_count.sum()) == 26 * layer.top_k
        assert torch.equal(layer_stats.token_count, literal.token_count)
        assert_gram_close(layer_stats.gram, literal.gram)
        for key in ("routing_mass", "sq_norm_sum", "norm_sum", "weighted_norm_sum"):
            torch.testing.assert_close(getattr(layer_stats, key), literal.tensors()[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss"])
def test_left_padding_with_position_ids_is_not_counted(case):
    model = make_model(case)
    ids = random_ids(seed=17)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    padded = collect_stats(model, [{"input_ids": ids, "attention_mask": mask, "position_ids": position_ids}])
    separate = collect_stats(model, [ids[0:1], ids[1:2, 6:]])
    assert padded.num_tokens == 26
    assert_stats_close(padded, separate, rtol=1e-5)


def test_all_padding_batch_adds_nothing():
    model = make_model("olmoe")
    ids = random_ids(seed=10)
    base = collect_stats(model, [ids])
    mask = torch.zeros_like(ids)
    with_empty = collect_stats(model, [ids, {"input_ids": ids, "attention_mask": mask}])
    assert with_empty.num_tokens == base.num_tokens
    assert_stats_equal(with_empty, base)


# ------------------------------------------------------------------------------ merging
@pytest.mark.parametrize("case", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_merge_equals_joint_collection(case):
    model = make_model(case)
    a, b = random_ids(seed=11), random_ids(seed=12)
    joint = collect_stats(model, [a, b], source="joint")
    stats_a = collect_stats(model, [a], source="a")
    stats_b = collect_stats(model, [b], source="b")
    merged = stats_a.merge(stats_b)
    assert merged.num_tokens == stats_a.num_tokens + stats_b.num_tokens == joint.num_tokens == 64
    assert merged.sources == ["a", "b"]
    assert merged.fingerprint == joint.fingerprint
    for lm, lj, la in zip(merged.layers, joint.layers, stats_a.layers):
        assert (lm.name, lm.routing) == (lj.name, lj.routing)
        for key, value in lm.tensors().items():
            torch.testing.assert_close(value, lj.tensors()[key], rtol=1e-12, atol=1e-12)
        assert not torch.equal(lm.gram, la.gram)  # the second batch really added something
    # Merging is a sum, not a replacement: stats(A) merged with itself doubles every sum.
    doubled = stats_a.merge(stats_a)
    assert doubled.sources == ["a"]
    for ld, la in zip(doubled.layers, stats_a.layers):
        for key, value in ld.tensors().items():
            assert torch.equal(value, 2 * la.tensors()[key])


def test_merge_of_different_models_raises():
    qwen = collect_stats(make_model("qwen3_moe"), [random_ids()])
    mixtral = collect_stats(make_model("mixtral"), [random_ids()])
    assert qwen.fingerprint != mixtral.fingerprint
    with pytest.raises(FingerprintMismatchError) as info:
        qwen.merge(mixtral)
    assert str(info.value) == (
        f"Cannot merge statistics of different models (fingerprints {qwen.fingerprint} and "
        f"{mixtral.fingerprint}). Collect both on the same model."
    )


def test_fingerprint_ignores_weights_but_not_structure():
    assert model_fingerprint(make_model("qwen3_moe", seed=0)) == model_fingerprint(make_model("qwen3_moe", seed=1))
    assert model_fingerprint(make_model("qwen3_moe")) != model_fingerprint(tiny_model("qwen3_moe", num_experts=8))
    assert model_fingerprint(make_model("deepseek_v2")) != model_fingerprint(make_model("deepseek_v2_grouped"))


# ------------------------------------------------------------------------------ on disk
def test_save_load_round_trip(tmp_path):
    model = make_model("deepseek_v3")
    stats = collect_stats(model, [random_ids(seed=13)], model_id="tiny/deepseek-v3", source="unit-test")
    path = tmp_path / "stats.safetensors"
    assert stats.save(path) == path
    loaded = MoEStats.load(path, model=model)

    assert loaded.model_id == "tiny/deepseek-v3"
    assert loaded.model_type == "deepseek_v3"
    assert loaded.fingerprint == stats.fingerprint == model_fingerprint(model)
    assert loaded.num_tokens == stats.num_tokens == 32
    assert loaded.sources == ["unit-test"]
    assert loaded.library_version == stats.library_version == __version__
    assert loaded.metadata() == stats.metadata()
    for la, lb in zip(loaded.layers, stats.layers, strict=True):
        assert (la.name, la.routing) == (lb.name, lb.routing)
        for key, value in la.tensors().items():
            assert value.dtype == torch.float64
            assert torch.equal(value, lb.tensors()[key]), key
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats.safetensors"]


def test_load_refuses_model_of_different_structure(tmp_path):
    stats = collect_stats(make_model("qwen3_moe"), [random_ids()], model_id="tiny/qwen3")
    path = stats.save(tmp_path / "stats.safetensors")
    other = tiny_model("qwen3_moe", num_experts=8)
    other_fingerprint = model_fingerprint(other)
    with pytest.raises(FingerprintMismatchError) as info:
        MoEStats.load(path, model=other)
    assert str(info.value) == (
        f"These statistics were collected on a different model (fingerprint {stats.fingerprint}, "
        f"model_id='tiny/qwen3'); this model has fingerprint {other_fingerprint}. "
        "Re-run collect_stats on this model, or load the model the statistics came from."
    )
    with pytest.raises(FingerprintMismatchError):
        MoEStats.load(path).check_compatible(other)


def test_save_refuses_to_overwrite(tmp_path):
    model = make_model("gpt_oss")
    first = collect_stats(model, [random_ids(seed=14)])
    second = collect_stats(model, [random_ids(seed=15)])
    path = tmp_path / "stats.safetensors"
    first.save(path)
    before = path.read_bytes()
    with pytest.raises(OutputExistsError) as info:
        second.save(path)
    assert str(info.value) == (
        f"{path} already exists; pass --overwrite (overwrite=True in Python) to replace it, or choose another output path."
    )
    assert isinstance(info.value, FileExistsError)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats.safetensors"]

    second.save(path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats.safetensors"]
    assert_stats_equal(MoEStats.load(path), second)


def test_load_rejects_missing_and_foreign_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="No statistics file at"):
        MoEStats.load(tmp_path / "missing.safetensors")
    foreign = tmp_path / "foreign.safetensors"
    save_file({"x": torch.zeros(2)}, str(foreign))
    with pytest.raises(ValueError, match="not ompmoe statistics"):
        MoEStats.load(foreign)
    # A future format version is refused rather than misread.
    stats = collect_stats(make_model("olmoe"), [random_ids()])
    meta = {**stats.metadata(), "format_version": 99, "library_version": "9.0"}
    future = tmp_path / "future.safetensors"
    save_file({"layers.0.gram": torch.zeros(1)}, str(future), metadata={"ompmoe": json.dumps(meta)})
    with pytest.raises(ValueError, match=r"statistics format 99 \(written by ompmoe 9.0\); this ompmoe reads format 2 "
                                         r"only: load it with that version, or re-collect it"):
        MoEStats.load(future)


# ------------------------------------------------------------------------- input forms
def test_input_forms_give_equal_stats():
    model = make_model("qwen2_moe")
    ids = random_ids(seed=16)
    as_tensors = collect_stats(model, [ids[0:1], ids[1:2]])
    as_dicts = collect_stats(model, [{"input_ids": ids[0:1]}, {"input_ids": ids[1:2], "labels": ids[1:2]}])
    as_vectors = collect_stats(model, iter([ids[0], ids[1]]))
    as_vector_dicts = collect_stats(model, [{"input_ids": ids[0]}, {"input_ids": ids[1]}])
    with_ones_mask = collect_stats(
        model, [{"input_ids": row[None], "attention_mask": torch.ones(1, 16, dtype=torch.long)} for row in ids]
    )
    assert as_tensors.num_tokens == 32
    assert_stats_equal(as_dicts, as_tensors)
    assert_stats_equal(as_vectors, as_tensors)
    assert_stats_equal(as_vector_dicts, as_tensors)
    assert_stats_close(with_ones_mask, as_tensors, rtol=1e-6)


def test_bad_batches_raise():
    model = make_model("qwen3_moe")
    with pytest.raises(TypeError) as info:
        collect_stats(model, [[1, 2, 3]])
    assert str(info.value) == (
        "Each calibration batch must be an input-id tensor (batch, seq), a dict with 'input_ids' for model(**batch) "
        "or a tuple/list (input_ids[, attention_mask]) of tensors; got list."
    )
    with pytest.raises(TypeError, match="got dict"):
        collect_stats(model, [{"attention_mask": torch.ones(1, 4)}])
    with pytest.raises(ValueError, match="No calibration tokens were seen; pass at least one non-empty batch."):
        collect_stats(model, [])


def test_non_finite_values_at_padded_positions_are_ignored():
    from ompmoe.engine.collect.sums import MoEStatsMetric

    model = make_model("qwen3_moe")
    layer = find_moe_layers(model)[0]
    torch.manual_seed(3)
    ids = torch.stack([torch.randperm(layer.num_experts)[: layer.top_k] for _ in range(5)])
    gates = torch.rand(5, layer.top_k)
    outputs = torch.randn(5 * layer.top_k, 32)
    clean, dirty = MoEStatsMetric([layer]), MoEStatsMetric([layer])
    clean.set_token_weight(None, num_tokens=3)
    clean.update(0, ids[:3], gates[:3], outputs[: 3 * layer.top_k])
    dirty.set_token_weight(torch.tensor([1, 1, 1, 0, 0]), num_tokens=5)
    poisoned = outputs.clone()
    poisoned[3 * layer.top_k :] = float("nan")
    gates_poisoned = gates.clone()
    gates_poisoned[3:] = float("inf")
    dirty.update(0, ids, gates_poisoned, poisoned)
    (a,), tokens_a = clean.compute()
    (b,), tokens_b = dirty.compute()
    assert tokens_a == tokens_b == 3
    for key, value in a.tensors().items():
        assert torch.equal(value, b.tensors()[key]), key


def test_the_sums_are_full_precision_inside_a_mixed_precision_forward():
    """The hooks run inside the model's forward, which ``bf16-mixed`` autocasts: the sums' products were taken in
    bfloat16 (a Gram 3e-4 off and not symmetric, which loading then refused). Each metric's update under autocast
    adds exactly what it adds outside it."""
    from ompmoe.engine.collect.sums import MoEStatsMetric
    from ompmoe.engine.methods.loss.metric import LossStatsMetric
    from ompmoe.engine.methods.loss.statistics import LOSS_TENSORS
    from ompmoe.engine.methods.reroute.metric import RerouteStatsMetric
    from ompmoe.engine.methods.reroute.statistics import REROUTE_TENSORS

    layer = find_moe_layers(make_model("qwen3_moe"))[0]
    generator = torch.Generator().manual_seed(4)
    tokens, k = 6, layer.top_k
    ids = torch.stack([torch.randperm(layer.num_experts, generator=generator)[:k] for _ in range(tokens)])
    gates = torch.rand(tokens, k, generator=generator)
    outputs = torch.randn(tokens * k, 32, generator=generator)
    atoms = outputs.view(tokens, k, -1) * gates.unsqueeze(-1)
    grad = torch.randn(tokens, 32, generator=generator)
    updates = [(lambda: MoEStatsMetric([layer]), lambda m: m.update(0, ids, gates, outputs)),
               (lambda: LossStatsMetric([layer], LOSS_TENSORS), lambda m: m.update(0, ids, atoms, grad, None)),
               (lambda: RerouteStatsMetric([layer], REROUTE_TENSORS),
                lambda m: m.update(0, ids, atoms * 0.5, atoms, None))]
    for make, update in updates:
        plain, mixed = make(), make()
        if isinstance(plain, MoEStatsMetric):
            plain.set_token_weight(None, num_tokens=tokens)
            mixed.set_token_weight(None, num_tokens=tokens)
        update(plain)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            update(mixed)
        for name in plain._defaults:
            assert torch.equal(getattr(mixed, name), getattr(plain, name)), (type(plain).__name__, name)
        gram = next(getattr(plain, name) for name in plain._defaults if name.startswith("gram"))
        assert torch.equal(gram, gram.T) and bool(gram.abs().sum() > 0)
