"""OMP-MoE+ adaptive inference, checked against a literal per-token implementation of the paper's rule.

The reference routes nothing itself: it takes the arguments each fused ``experts`` module really
received inside a full model forward (original top-k ids and weights), decides token by token in
plain Python which experts to keep, and runs each kept (token, expert) pair alone. The tiny models
are built with ``initializer_range=0.2`` so expert energies are O(1-10) as in real models (with the
default 0.02 they are ~1e-5, below ``zeta = 1e-6`` times K, and the rule keeps every expert).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import torch
import transformers
from torch.utils.data import DataLoader

import ompmoe
from ompmoe.engine.apply.adaptive import (
    CONFIG_KEY,
    ZETA,
    adaptive_info,
    adaptive_keep_mask,
    adaptive_report,
    adaptive_totals,
    disable_adaptive,
    enable_adaptive,
    is_adaptive,
    reset_adaptive_counters,
    resolve_alphas,
    restore_adaptive,
)

from reference import ARCH_IDS, make_model, random_ids

pytestmark = pytest.mark.filterwarnings("ignore:ompmoe adaptive inference:UserWarning")

EPSILON = 0.2
IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
SCALE = dict(initializer_range=0.2)


def scaled_model(case: str, implementation: str | None = None, **overrides) -> torch.nn.Module:
    model = make_model(case, **{**SCALE, **overrides})
    if implementation is not None:
        model.set_experts_implementation(implementation)
    return model


_STATS: dict[str, ompmoe.MoEStats] = {}


def stats_of(case: str) -> ompmoe.MoEStats:
    """Statistics of the (unpruned) scaled tiny model of ``case`` on 4 x 32 random tokens."""
    if case not in _STATS:
        _STATS[case] = ompmoe.collect_stats(scaled_model(case), [random_ids(batch=4, seq=32, seed=7)])
    return _STATS[case]


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


# --------------------------------------------------------------------------------------- literal rule
def literal_kept_slots(weights: list[float], experts: list[int], alphas: list[float], epsilon: float) -> list[int]:
    """The paper's rule for one token, in plain Python: slots kept, in decreasing predicted energy."""
    energies = [w * w * alphas[e] for w, e in zip(weights, experts)]
    order = sorted(range(len(energies)), key=lambda j: -energies[j])  # stable: ties in slot order
    prefix, running = [], 0.0
    for j in order:
        running += energies[j]
        prefix.append(running)
    total = prefix[-1]
    for m in range(1, len(order) + 1):
        if 1.0 - prefix[m - 1] / (total + ZETA) <= epsilon:
            return order[:m]
    return order  # no prefix qualifies (epsilon = 0, or negligible energy): keep all


@torch.no_grad()
def literal_layer_output(experts, hidden, index, weights, alphas, epsilon):
    """Expected experts output (float64) and kept (token, slot) pairs, one token and one expert at a time."""
    output = torch.zeros(hidden.shape, dtype=torch.float64)
    kept_pairs = []
    alpha_list = alphas.tolist()
    for t in range(hidden.shape[0]):
        row_w = [float(w) for w in weights[t].to(torch.float64)]
        row_e = [int(e) for e in index[t]]
        for slot in sorted(literal_kept_slots(row_w, row_e, alpha_list, epsilon)):
            single = type(experts).forward(
                experts, hidden[t][None], torch.tensor([[row_e[slot]]]), torch.ones(1, 1, dtype=weights.dtype)
            )
            output[t] += row_w[slot] * single[0].to(torch.float64)
            kept_pairs.append((t, slot))
    return output, kept_pairs


def test_keep_mask_matches_the_literal_rule_on_random_inputs():
    generator = torch.Generator().manual_seed(0)
    for trial in range(40):
        tokens, top_k, num_experts = 64, int(torch.randint(1, 9, (1,), generator=generator)), 16
        index = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
        weights = torch.rand(tokens, top_k, generator=generator)
        weights[::7, : max(1, top_k // 2)] = 0.25  # ties in predicted energy
        alphas = torch.rand(num_experts, dtype=torch.float64, generator=generator) * 10
        alphas[trial % num_experts] = 0.0  # an expert never seen in calibration
        if trial % 5 == 0:
            alphas = alphas * 1e-8  # total energy near zeta: keep everything at small epsilon
        for epsilon in (0.0, 0.01, 0.1, 0.3, 0.7, 1.0):
            mask = adaptive_keep_mask(index, weights, alphas, epsilon)
            for t in range(tokens):
                expected = literal_kept_slots(
                    [float(w) for w in weights[t].to(torch.float64)], index[t].tolist(), alphas.tolist(), epsilon
                )
                assert sorted(mask[t].nonzero().flatten().tolist()) == sorted(expected), (trial, epsilon, t)
    assert adaptive_keep_mask(index, weights, alphas, 0.0).all()
    assert (adaptive_keep_mask(index, weights, alphas * 1e8, 1.0).sum(1) == 1).all()


# ----------------------------------------------------------------------------- instrumented forwards
@dataclass
class LayerCalls:
    received: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """Original (hidden, top-k ids, top-k weights) of each call of the experts module."""
    native: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """What the native experts forward was actually given (compacted pairs, or the original)."""
    outputs: list[torch.Tensor] = field(default_factory=list)
    """The experts module's final output, as the MoE block receives it."""


@contextmanager
def instrument(model: torch.nn.Module) -> Iterator[list[LayerCalls]]:
    layers = ompmoe.find_moe_layers(model)
    calls = [LayerCalls() for _ in layers]
    handles = []
    for layer, record in zip(layers, calls):
        experts = layer.experts

        def before(module, args, kwargs, record=record):
            record.received.append(tuple(a.detach().clone() for a in args[:3]))

        def after(module, args, kwargs, output, record=record):
            record.outputs.append(output.detach().clone())

        handles.append(experts.register_forward_pre_hook(before, with_kwargs=True, prepend=True))
        handles.append(experts.register_forward_hook(after, with_kwargs=True))  # after adaptive's own hook

        def counting_forward(*args, experts=experts, record=record):
            record.native.append(tuple(a.detach().clone() for a in args[:3]))
            return type(experts).forward(experts, *args)

        experts.forward = counting_forward
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()
        for layer in layers:
            del layer.experts.forward


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", ARCH_IDS)
def test_every_layer_matches_the_literal_per_token_rule_and_runs_only_kept_pairs(case, implementation):
    model = scaled_model(case, implementation)
    stats = stats_of(case)
    enable_adaptive(model, stats, EPSILON)
    ids = random_ids(batch=2, seq=16, seed=3)
    with instrument(model) as calls:
        logits(model, ids)
    report = adaptive_report(model)
    layers = ompmoe.find_moe_layers(model)
    skipped_somewhere = False
    for layer, record in zip(layers, calls):
        assert len(record.received) == len(record.outputs) == len(record.native) == 1
        hidden, index, weights = record.received[0]
        expected, kept = literal_layer_output(
            layer.experts, hidden, index, weights, stats.layer(layer.name).alpha, EPSILON
        )
        torch.testing.assert_close(record.outputs[0].to(torch.float64), expected, rtol=1e-5, atol=1e-5)
        # The native experts forward saw exactly the kept pairs, in token-major slot order.
        native_hidden, native_index, native_weights = record.native[0]
        tokens = torch.tensor([t for t, _ in kept])
        slots = torch.tensor([s for _, s in kept])
        if len(kept) == index.numel():
            assert torch.equal(native_index, index) and torch.equal(native_weights, weights)
        else:
            skipped_somewhere = True
            assert native_index.shape == (len(kept), 1)
            assert torch.equal(native_index[:, 0], index[tokens, slots])
            assert torch.equal(native_weights[:, 0], weights[tokens, slots])
            assert torch.equal(native_hidden, hidden[tokens])
        # Counters: kept executions and tokens, as the literal rule counts them.
        counts = report[layer.name]
        assert counts["tokens"] == hidden.shape[0]
        assert counts["kept_pairs"] == len(kept) == native_index.numel()
        assert counts["avg_experts_per_token"] == pytest.approx(len(kept) / hidden.shape[0])
        assert counts["skip_ratio"] == pytest.approx(1 - len(kept) / index.numel())
        per_token = torch.bincount(tokens, minlength=hidden.shape[0])
        assert counts["histogram"] == torch.bincount(per_token, minlength=layer.top_k + 1).tolist()
    assert skipped_somewhere, "epsilon=0.2 should skip some experts in these models"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", ARCH_IDS)
def test_epsilon_zero_gives_the_plain_logits_bit_for_bit(case, implementation):
    model = scaled_model(case, implementation)
    ids = random_ids(batch=2, seq=16, seed=4)
    plain = logits(model, ids)
    enable_adaptive(model, stats_of(case), 0.0)
    assert torch.equal(logits(model, ids), plain)
    totals = adaptive_totals(adaptive_report(model))
    assert totals["skip_ratio"] == 0.0 and totals["flops_ratio"] == 1.0


@pytest.mark.parametrize("case", ARCH_IDS)
def test_disable_restores_the_plain_model(case):
    model = scaled_model(case)
    ids = random_ids(batch=2, seq=16, seed=5)
    plain = logits(model, ids)
    enable_adaptive(model, stats_of(case), 0.3)
    assert is_adaptive(model) and adaptive_info(model)["epsilon"] == 0.3
    assert not torch.equal(logits(model, ids), plain)
    disable_adaptive(model)
    assert not is_adaptive(model) and adaptive_info(model) is None and adaptive_report(model) == {}
    for layer in ompmoe.find_moe_layers(model):
        assert not layer.experts._forward_hooks and not layer.experts._forward_pre_hooks
    assert torch.equal(logits(model, ids), plain)


def test_switching_adaptive_off_while_paused_leaves_it_off():
    from ompmoe.engine.apply.adaptive import adaptive_paused

    model = scaled_model("qwen3_moe")
    ids = random_ids(batch=2, seq=16, seed=5)
    plain = logits(model, ids)
    enable_adaptive(model, stats_of("qwen3_moe"), 0.3)
    with adaptive_paused(model) as paused:
        disable_adaptive(model)
    assert paused and not is_adaptive(model) and torch.equal(logits(model, ids), plain)
    enable_adaptive(model, stats_of("qwen3_moe"), 0.3)
    with adaptive_paused(model):
        assert torch.equal(logits(model, ids), plain)  # the full top-k meanwhile
    assert not torch.equal(logits(model, ids), plain)  # and the rule again afterwards


def test_enabling_again_replaces_the_settings_and_counters_reset():
    model = scaled_model("qwen3_moe")
    ids = random_ids(batch=2, seq=16, seed=6)
    enable_adaptive(model, stats_of("qwen3_moe"), 0.5)
    logits(model, ids)
    enable_adaptive(model, stats_of("qwen3_moe"), 0.1)
    layer = ompmoe.find_moe_layers(model)[0]
    assert len(layer.experts._forward_hooks) == len(layer.experts._forward_pre_hooks) == 1
    assert adaptive_totals(adaptive_report(model))["tokens"] == 0
    logits(model, ids)
    first = adaptive_report(model, reset=True)
    assert all(entry["tokens"] == 32 and entry["epsilon"] == 0.1 for entry in first.values())
    assert adaptive_totals(adaptive_report(model))["tokens"] == 0
    logits(model, ids)
    assert adaptive_report(model) == first
    reset_adaptive_counters(model)
    assert adaptive_totals(adaptive_report(model))["tokens"] == 0


@pytest.mark.parametrize("case", ARCH_IDS)
def test_save_and_load_round_trip_keeps_adaptive_inference(case, tmp_path):
    model = scaled_model(case)
    ids = random_ids(batch=2, seq=16, seed=8)
    enable_adaptive(model, stats_of(case), EPSILON)
    expected = logits(model, ids)
    ompmoe.save_pruned(model, tmp_path / "model")
    loaded = ompmoe.load_pruned(tmp_path / "model")
    assert is_adaptive(loaded)
    assert adaptive_info(loaded) == adaptive_info(model)
    assert torch.equal(logits(loaded, ids), expected)
    assert adaptive_report(loaded) == adaptive_report(model)
    # Plain from_pretrained keeps the record; restore_adaptive switches it on.
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert not is_adaptive(plain) and restore_adaptive(plain)
    assert torch.equal(logits(plain, ids), expected)


@pytest.mark.parametrize("case", ARCH_IDS)
def test_pruned_model_maps_original_alphas_to_kept_experts_and_round_trips(case, tmp_path):
    stats = stats_of(case)
    model = scaled_model(case)
    ompmoe.prune(model, ompmoe.plan_pruning(stats, 0.5))
    kept = ompmoe.pruning_info(model)["kept_experts"]
    enable_adaptive(model, stats, EPSILON)
    for name, alphas in adaptive_info(model)["alphas"].items():
        assert alphas == stats.layer(name).alpha[kept[name]].tolist()
    ids = random_ids(batch=2, seq=16, seed=9)
    expected = logits(model, ids)
    assert adaptive_totals(adaptive_report(model))["skip_ratio"] > 0
    ompmoe.save_pruned(model, tmp_path / "model")
    loaded = ompmoe.load_pruned(tmp_path / "model")
    assert is_adaptive(loaded) and adaptive_info(loaded) == adaptive_info(model)
    assert torch.equal(logits(loaded, ids), expected)
    # Statistics collected on the pruned model itself are accepted as they are.
    disable_adaptive(loaded)
    own = ompmoe.collect_stats(loaded, [random_ids(batch=4, seq=32, seed=7)])
    enable_adaptive(loaded, own, EPSILON)
    for name, alphas in adaptive_info(loaded)["alphas"].items():
        assert alphas == own.layer(name).alpha.tolist()


def test_alphas_from_a_dict_and_bad_inputs_are_refused():
    model = scaled_model("qwen3_moe")
    layers = ompmoe.find_moe_layers(model)
    alphas = {layer.name: torch.rand(layer.num_experts) for layer in layers}
    enable_adaptive(model, alphas, 0.1)
    assert resolve_alphas(model, adaptive_info(model)["alphas"]).keys() == alphas.keys()
    with pytest.raises(ValueError, match="epsilon"):
        enable_adaptive(model, alphas, 1.5)
    with pytest.raises(ValueError, match="alphas were given"):
        enable_adaptive(model, {**alphas, layers[0].name: torch.ones(3)})
    with pytest.raises(KeyError, match="No alphas"):
        enable_adaptive(model, {layers[0].name: alphas[layers[0].name]})
    with pytest.raises(ValueError, match="does not have"):
        enable_adaptive(model, {**alphas, "model.layers.99.mlp": torch.ones(16)})
    with pytest.raises(ValueError, match="non-negative"):
        enable_adaptive(model, {**alphas, layers[0].name: -torch.ones(16)})
    with pytest.raises(ValueError, match="model"):
        enable_adaptive(model, stats_of("olmoe"))
    with pytest.raises(TypeError):
        enable_adaptive(model, [1.0, 2.0])
    # A failed call leaves the previous setting in place.
    assert is_adaptive(model) and adaptive_info(model)["epsilon"] == 0.1


def test_pruning_after_enabling_is_caught():
    stats = stats_of("olmoe")
    model = scaled_model("olmoe")
    enable_adaptive(model, stats, 0.1)
    ompmoe.prune(model, ompmoe.plan_pruning(stats, 0.5))
    with pytest.raises(RuntimeError, match="enable_adaptive"):
        logits(model, random_ids())
    enable_adaptive(model, stats, 0.1)  # original statistics, mapped through the pruning record
    logits(model, random_ids())


@pytest.mark.parametrize("case", ["deepseek_v2", "gpt_oss", "qwen2_moe"])
def test_bfloat16_models_skip_experts_too(case):
    model = scaled_model(case, dtype=torch.bfloat16)
    enable_adaptive(model, stats_of(case), EPSILON)
    out = logits(model, random_ids())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert adaptive_totals(adaptive_report(model))["skip_ratio"] > 0


# --------------------------------------------------------------------------------------- Lightning
def text_batches(num_blocks: int, seq_len: int = 32) -> list[dict[str, torch.Tensor]]:
    from ompmoe.data import byte_tokens, shipped_text, token_blocks

    blocks = token_blocks(byte_tokens(shipped_text()), seq_len, num_blocks)
    return [{"input_ids": block, "attention_mask": torch.ones_like(block)} for block in blocks]


def evaluating_module(model):
    from ompmoe.lightning.calibration_module import CalibrationModule

    class Evaluating(CalibrationModule):
        def validation_step(self, batch, batch_idx):
            with torch.no_grad():
                self(**batch)

        test_step = validation_step

    return Evaluating(model)


def quiet_trainer(callbacks, **kwargs):
    import lightning.pytorch as pl

    options = dict(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False)
    return pl.Trainer(callbacks=callbacks, **{**options, **kwargs})


def test_monitor_switches_adaptive_on_and_logs_the_counters(tmp_path):
    from ompmoe.callbacks import AdaptiveInferenceMonitor

    stats_path = stats_of("olmoe").save(tmp_path / "stats.safetensors")
    data = text_batches(4)
    monitor = AdaptiveInferenceMonitor(epsilon=EPSILON, stats=str(stats_path))
    module = evaluating_module(scaled_model("olmoe"))
    trainer = quiet_trainer([monitor])
    trainer.validate(module, DataLoader(data, batch_size=2))
    reference = scaled_model("olmoe")
    enable_adaptive(reference, stats_of("olmoe"), EPSILON)
    for batch in DataLoader(data, batch_size=2):
        logits(reference, batch["input_ids"])
    expected = adaptive_report(reference)
    assert monitor.report == {name: {**entry, "epsilon": None} for name, entry in expected.items()}
    metrics = trainer.callback_metrics
    totals = adaptive_totals(expected)
    assert float(metrics["val/adaptive/avg_experts_per_token"]) == pytest.approx(totals["avg_experts_per_token"])
    assert float(metrics["val/adaptive/skip_ratio"]) == pytest.approx(totals["skip_ratio"])
    for name, entry in expected.items():
        assert float(metrics[f"val/adaptive/{name}/skip_ratio"]) == pytest.approx(entry["skip_ratio"])
    # test: counters restart at each epoch
    trainer.test(module, DataLoader(data[:2], batch_size=2))
    assert float(trainer.callback_metrics["test/adaptive/skip_ratio"]) == pytest.approx(
        adaptive_totals(monitor.report)["skip_ratio"]
    )
    assert all(entry["tokens"] == 64 for entry in monitor.report.values())


def test_pruning_callback_switches_adaptive_on_and_saves_it(tmp_path):
    from ompmoe.callbacks import AdaptiveInferenceMonitor, ExpertPruning
    from ompmoe import PruningStrategy

    data = text_batches(4)
    callback = ExpertPruning(PruningStrategy(ratio=0.5), output_dir=str(tmp_path / "run"), adaptive_epsilon=EPSILON)
    module = evaluating_module(scaled_model("qwen2_moe"))
    monitor = AdaptiveInferenceMonitor()
    quiet_trainer([callback, monitor], num_sanity_val_steps=0, limit_val_batches=0).fit(
        module, DataLoader(data, batch_size=2)
    )
    model = callback.pruned_model
    kept = ompmoe.pruning_info(model)["kept_experts"]
    record = adaptive_info(model)
    assert record["epsilon"] == EPSILON
    for layer in callback.stats.layers:
        assert record["alphas"][layer.name] == layer.alpha[kept[layer.name]].tolist()
    loaded = ompmoe.load_pruned(tmp_path / "run" / "model")
    assert adaptive_info(loaded) == record
    probe = data[0]["input_ids"][None]
    assert torch.equal(logits(loaded, probe), logits(model, probe))
    # The monitor (no epsilon) logs what the pruned model does in a later validation run.
    trainer = quiet_trainer([monitor])
    trainer.validate(module, DataLoader(data, batch_size=2))
    assert 0 < float(trainer.callback_metrics["val/adaptive/skip_ratio"]) < 1


def test_cli_accepts_the_monitor_and_adaptive_epsilon(tmp_path):
    from pathlib import Path

    import yaml

    from ompmoe.cli import main

    config = yaml.safe_load((Path(__file__).parents[2] / "configs" / "tiny.yaml").read_text())
    pruning = next(c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("ExpertPruning"))
    pruning["init_args"].update(output_dir=str(tmp_path / "run"), adaptive_epsilon=0.05,
                               evaluate_blocks=8)
    config["trainer"]["default_root_dir"] = str(tmp_path / "lightning")
    config["data"].update(num_blocks=4, seq_len=64)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    main(["fit", "-c", str(path), "--trainer.enable_progress_bar=false",
          "--trainer.callbacks+=ompmoe.callbacks.AdaptiveInferenceMonitor", "--trainer.callbacks.per_layer=false"])
    model = ompmoe.load_pruned(tmp_path / "run" / "model")
    assert is_adaptive(model) and adaptive_info(model)["epsilon"] == 0.05
    assert CONFIG_KEY in (tmp_path / "run" / "model" / "config.json").read_text()


def test_epsilon_zero_skips_the_rule_and_counts_every_pair(monkeypatch):
    """At epsilon = 0 no prefix can qualify, so the hooks do not even evaluate the rule."""
    import ompmoe.engine.apply.adaptive as adaptive_module

    model = scaled_model("qwen3_moe")
    ids = random_ids(seed=21)
    plain = logits(model, ids)
    enable_adaptive(model, stats_of("qwen3_moe"), 0.0)

    def refuse(*args, **kwargs):
        raise AssertionError("the rule was evaluated at epsilon = 0")

    monkeypatch.setattr(adaptive_module, "adaptive_keep_mask", refuse)
    assert torch.equal(logits(model, ids), plain)
    report = adaptive_report(model)
    top_k = model.config.num_experts_per_tok
    for entry in report.values():
        assert entry["tokens"] == 32 and entry["kept_pairs"] == 32 * top_k
        assert entry["histogram"] == [0] * top_k + [32]


@pytest.mark.parametrize("model_type", ["minimax_m2", "qwen3_vl_moe", "deepseek_v4", "inkling_text", "step3p7"])
def test_types_recognized_by_their_modules_follow_the_literal_rule(model_type):
    """OMP-MoE+ on types no spec registers (a routing bias on the block, a multimodal container, hash-routed layers
    left whole, router rows past the experts, experts with their own forward): every routed layer's output is the
    literal per-token rule's."""
    from ompmoe.engine.tiny import tiny_model

    model = tiny_model(model_type)
    stats = ompmoe.collect_stats(model, [random_ids(batch=4, seq=32, seed=7)], progress=False)
    enable_adaptive(model, stats, 0.5)  # top-2 routers: the first expert's energy share is >= 0.5
    with instrument(model) as calls:
        logits(model, random_ids(batch=2, seq=16, seed=3))
    skipped = 0
    for layer, record in zip(ompmoe.find_moe_layers(model), calls):
        hidden, index, weights = record.received[0]
        expected, kept = literal_layer_output(layer.experts, hidden, index, weights, stats.layer(layer.name).alpha,
                                              0.5)
        torch.testing.assert_close(record.outputs[0].to(torch.float64), expected, rtol=1e-5, atol=1e-5)
        skipped += index.numel() - len(kept)
    assert skipped > 0, "epsilon=0.5 skips the second of two experts"
