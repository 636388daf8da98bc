"""The third shipped model, ``shipped:tiny-moe-a3b``: the Qwen3-30B-A3B layout (64 small routed experts, top-8,
softmax router with normalized top-k weights, no shared expert, every layer sparse) trained on the shipped corpus."""

import json
import math
import re

import pytest
import torch

import ompmoe
from reference import shipped_model, shipped_tokenizer, train_split_log_unigram
from model_cards import check_last_subset_point
from ompmoe.data import CORPUS_DOMAINS, corpus_token_stream, resolve_shipped, shipped_model_path, token_blocks

MODEL_DIR = shipped_model_path("tiny-moe-a3b")
SEQ_LEN, BLOCKS = 256, 8
UNIGRAM_FACTOR = 2.0
"""The model must beat an add-one-smoothed unigram model of the train split by this factor in perplexity."""


@pytest.fixture(scope="module")
def model():
    return shipped_model("tiny-moe-a3b")


@pytest.fixture(scope="module")
def tokenizer():
    return shipped_tokenizer("tiny-moe-a3b")


def test_loads_offline_within_the_size_budget_with_the_shipped_tokenizer(model, tokenizer, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_shipped("shipped:tiny-moe-a3b") == str(MODEL_DIR)
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= 25_000_000
    assert tokenizer.get_vocab() == shipped_tokenizer("tiny-moe").get_vocab()


def test_config_is_the_qwen3_30b_a3b_layout_and_matches_the_card(model):
    config = model.config
    assert config.model_type == "qwen3_moe"
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (64, 8, True)
    assert config.mlp_only_layers == [] and config.decoder_sparse_step == 1  # every layer sparse, no shared expert
    layers = ompmoe.find_moe_layers(model)
    assert [layer.name for layer in layers] == [f"model.layers.{i}.mlp" for i in range(config.num_hidden_layers)]
    assert not any(hasattr(layer.block, name) for layer in layers for name in ("shared_expert", "shared_experts"))
    metrics = json.loads((MODEL_DIR / "metrics.json").read_text())
    assert (metrics["architecture"], metrics["name"]) == ("qwen3_moe", "tiny-moe-a3b")
    assert metrics["config"] == {key: getattr(config, key) for key in metrics["config"]}
    assert metrics["parameters"]["total"] == sum(p.numel() for p in model.parameters())
    card = (MODEL_DIR / "README.md").read_text(encoding="utf-8")
    stated = re.search(r"\*\*(\d+) routed experts per layer, top-(\d+)\*\* \(softmax router", card)
    assert stated and tuple(map(int, stated.groups())) == (64, 8)
    assert f"expert intermediate size {config.moe_intermediate_size}; no shared expert" in card


@torch.no_grad()
def test_forward_is_finite_and_beats_a_literal_unigram_baseline(model, tokenizer):
    log_unigram = train_split_log_unigram(tokenizer)  # the unigram model of the text the network was trained on
    card = (MODEL_DIR / "README.md").read_text(encoding="utf-8")
    stated = {d: float(v) for d, v in re.findall(r"^\| (prose|code) \| ([0-9.]+) \|", card, flags=re.MULTILINE)}
    metrics = json.loads((MODEL_DIR / "metrics.json").read_text())
    for domain in CORPUS_DOMAINS:
        blocks = token_blocks(corpus_token_stream(tokenizer, domain, "heldout", max_tokens=BLOCKS * SEQ_LEN),
                              SEQ_LEN, BLOCKS)
        logits = model(input_ids=blocks, use_cache=False).logits
        assert torch.isfinite(logits).all()
        targets = blocks[:, 1:].flatten()
        measured = math.exp(float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets)))
        unigram = math.exp(-float(log_unigram[targets].mean()))
        assert measured < unigram / UNIGRAM_FACTOR, (domain, measured, unigram)
        assert stated[domain] == pytest.approx(metrics["perplexity"][domain]["heldout"]["perplexity"], abs=0.006)
        # The card's subset rows end at this number, measured on the float32 weights before the bfloat16 cast.
        assert measured == pytest.approx(metrics["training"]["heldout_curve"][-1][domain], rel=5e-3)


@pytest.mark.parametrize("domain", ["prose", "code"])
def test_the_cards_subset_rows_end_at_the_shipped_weights_perplexity(model, tokenizer, domain):
    """The card's subset rows' last column (the end of training), recomputed from the shipped weights; the earlier
    columns are of weights that are not shipped."""
    check_last_subset_point("tiny-moe-a3b", model, tokenizer, domain, (BLOCKS, SEQ_LEN))


def test_statistics_pruning_and_load_pruned_round_trip(model, tokenizer, tmp_path):
    import copy

    calibration = torch.cat([token_blocks(corpus_token_stream(tokenizer, d, "calibration", max_tokens=4 * 64), 64, 4)
                             for d in CORPUS_DOMAINS])
    stats = ompmoe.collect_stats(model, calibration.split(4), model_id="shipped:tiny-moe-a3b", source="shipped:mix")
    assert all(int(layer.token_count.sum()) == 8 * 8 * 64 for layer in stats.layers)  # top-8, no token dropped
    plan = ompmoe.plan_pruning(stats, ratio=0.5)
    assert plan.achieved_ratio == pytest.approx(0.5)
    original = {layer.name: layer.experts.gate_up_proj.detach().clone() for layer in ompmoe.find_moe_layers(model)}
    pruned = ompmoe.prune(copy.deepcopy(model), plan)
    for layer in ompmoe.find_moe_layers(pruned):
        kept = torch.tensor(plan.kept_by_layer()[layer.name])
        assert torch.equal(layer.experts.gate_up_proj, original[layer.name][kept])
    ompmoe.save_pruned(pruned, tmp_path / "pruned", tokenizer=tokenizer)
    loaded = ompmoe.load_pruned(tmp_path / "pruned", dtype=torch.float32)
    assert ompmoe.pruning_info(loaded)["kept_experts"] == plan.kept_by_layer()
    with torch.no_grad():
        ids = calibration[:2]
        expected = pruned(input_ids=ids, use_cache=False).logits
        assert torch.isfinite(expected).all()
        torch.testing.assert_close(loaded(input_ids=ids, use_cache=False).logits, expected)
