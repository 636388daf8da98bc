"""The second shipped model, ``shipped:tiny-moe-64``: a fine-grained GLM-4.5-style MoE (64 experts, top-6,
a shared expert, group-limited sigmoid routing, a dense first layer) trained on the shipped corpus."""

import json
import math
import re

import pytest
import torch

import ompmoe
from reference import shipped_model, shipped_tokenizer, train_split_log_unigram
from model_cards import check_last_subset_point
from ompmoe.data import CORPUS_DOMAINS, corpus_token_stream, resolve_shipped, shipped_model_path, token_blocks

MODEL_DIR = shipped_model_path("tiny-moe-64")
SEQ_LEN, BLOCKS = 256, 8
UNIGRAM_FACTOR = 2.0
"""The model must beat an add-one-smoothed unigram model of the train split by this factor in perplexity
(ln 2 = 0.69 nats per token; the shipped model beats it by about 9x on prose and code)."""


@pytest.fixture(scope="module")
def model():
    return shipped_model("tiny-moe-64")


@pytest.fixture(scope="module")
def tokenizer():
    return shipped_tokenizer("tiny-moe-64")


def heldout_blocks(tokenizer, domain: str) -> torch.Tensor:
    return token_blocks(corpus_token_stream(tokenizer, domain, "heldout", max_tokens=BLOCKS * SEQ_LEN), SEQ_LEN, BLOCKS)


def test_shipped_model_loads_offline_within_the_size_budget(model, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_shipped("shipped:tiny-moe-64") == str(MODEL_DIR)
    assert MODEL_DIR.name == "tiny-moe-64" and MODEL_DIR.parent == shipped_model_path("tiny-moe").parent
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= 25_000_000
    again = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)
    # The routing biases were trained (loss-free balancing) and saved, in float32.
    biases = [m.e_score_correction_bias for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    assert len(biases) == model.config.num_hidden_layers - model.config.first_k_dense_replace
    assert all(b.dtype == torch.float32 and b.abs().max() > 0 for b in biases)


def test_config_is_fine_grained_grouped_and_matches_the_card(model):
    config = model.config
    assert config.model_type == "glm4_moe"
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_shared_experts) == (64, 6, 1)
    assert (config.n_group, config.topk_group, config.first_k_dense_replace) == (8, 4, 1)
    layers = ompmoe.find_moe_layers(model)
    assert [layer.name for layer in layers] == [f"model.layers.{i}.mlp" for i in range(1, config.num_hidden_layers)]
    assert all(layer.routing == {"num_experts": 64, "top_k": 6, "num_groups": 8, "topk_group": 4, "group_score_topk": 2}
               for layer in layers)
    metrics = json.loads((MODEL_DIR / "metrics.json").read_text())
    assert metrics["architecture"] == "glm4_moe"
    assert metrics["config"] == {key: getattr(config, key) for key in metrics["config"]}
    assert metrics["parameters"]["total"] == sum(p.numel() for p in model.parameters())
    card = (MODEL_DIR / "README.md").read_text(encoding="utf-8")
    stated = re.search(r"\*\*(\d+) routed experts of width (\d+), top-(\d+)\*\*, plus (\d+) shared expert", card)
    assert stated and tuple(map(int, stated.groups())) == (
        config.n_routed_experts, config.moe_intermediate_size, config.num_experts_per_tok, config.n_shared_experts)
    groups = re.search(r"\*\*(\d+) groups of (\d+)\*\*, each token first keeps the (\d+) groups", card)
    assert groups and tuple(map(int, groups.groups())) == (config.n_group, 64 // config.n_group, config.topk_group)
    dense = re.search(r"`Glm4MoeForCausalLM`, (\d+) decoder layers: the first (\d+) dense", card)
    assert dense and tuple(map(int, dense.groups())) == (config.num_hidden_layers, config.first_k_dense_replace)


@torch.no_grad()
def test_forward_is_finite_and_beats_a_literal_unigram_baseline(model, tokenizer):
    log_unigram = train_split_log_unigram(tokenizer)  # the unigram model of the text the network was trained on
    card = (MODEL_DIR / "README.md").read_text(encoding="utf-8")
    stated = {d: float(v) for d, v in re.findall(r"^\| (prose|code) \| ([0-9.]+) \|", card, flags=re.MULTILINE)}
    metrics = json.loads((MODEL_DIR / "metrics.json").read_text())
    for domain in CORPUS_DOMAINS:
        blocks = heldout_blocks(tokenizer, domain)
        logits = model(input_ids=blocks, use_cache=False).logits
        assert torch.isfinite(logits).all()
        targets = blocks[:, 1:].flatten()
        measured = math.exp(float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets)))
        unigram = math.exp(-float(log_unigram[targets].mean()))
        assert measured < unigram / UNIGRAM_FACTOR, (domain, measured, unigram)
        assert stated[domain] == pytest.approx(metrics["perplexity"][domain]["heldout"]["perplexity"], abs=0.006)
        # The card's subset rows end at this number, measured on the float32 weights before the bfloat16 cast.
        assert measured == pytest.approx(metrics["training"]["heldout_curve"][-1][domain], rel=5e-3)
        # The card's baseline is this unigram model on the whole held-out split, and the card's perplexity beats it.
        stream = corpus_token_stream(tokenizer, domain, "heldout")
        whole = stream[: stream.numel() // SEQ_LEN * SEQ_LEN].view(-1, SEQ_LEN)[:, 1:]
        baseline = math.exp(-float(log_unigram[whole].mean()))
        assert metrics["unigram_heldout_perplexity"][domain] == pytest.approx(baseline, rel=1e-9)
        assert stated[domain] < baseline / UNIGRAM_FACTOR


@pytest.mark.parametrize("domain", ["prose", "code"])
def test_the_cards_subset_rows_end_at_the_shipped_weights_perplexity(model, tokenizer, domain):
    """The card's subset rows' last column (the end of training), recomputed from the shipped weights; the earlier
    columns are of weights that are not shipped."""
    check_last_subset_point("tiny-moe-64", model, tokenizer, domain, (BLOCKS, SEQ_LEN))


def test_statistics_pruning_and_load_pruned_round_trip_keep_groups_balanced(model, tokenizer, tmp_path):
    import copy

    calibration = torch.cat([token_blocks(corpus_token_stream(tokenizer, d, "calibration", max_tokens=4 * 64), 64, 4)
                             for d in CORPUS_DOMAINS])
    stats = ompmoe.collect_stats(model, calibration.split(4), model_id="shipped:tiny-moe-64", source="shipped:mix")
    assert stats.num_tokens == 8 * 64
    # Expert 0.. of every layer is routed about top_k times per token in all (no token dropped).
    assert all(int(layer.token_count.sum()) == 6 * 8 * 64 for layer in stats.layers)
    plan = ompmoe.plan_pruning(stats, ratio=0.5)
    assert plan.achieved_ratio == pytest.approx(0.5)
    for layer in plan.layers:
        per_group = torch.bincount(torch.tensor(layer.kept) // 8, minlength=8)
        assert per_group.min() == per_group.max() >= 2, (layer.name, per_group.tolist())
    original = {layer.name: layer.experts.gate_up_proj.detach().clone() for layer in ompmoe.find_moe_layers(model)}
    pruned = ompmoe.prune(copy.deepcopy(model), plan)
    for layer in ompmoe.find_moe_layers(pruned):
        kept = torch.tensor(plan.kept_by_layer()[layer.name])
        assert torch.equal(layer.experts.gate_up_proj, original[layer.name][kept])
        assert layer.num_groups == 8 and layer.num_experts == len(kept)
    ompmoe.save_pruned(pruned, tmp_path / "pruned", tokenizer=tokenizer)
    loaded = ompmoe.load_pruned(tmp_path / "pruned", dtype=torch.float32)  # the shipped config says bfloat16
    assert ompmoe.pruning_info(loaded)["kept_experts"] == plan.kept_by_layer()
    assert [layer.routing["num_experts"] for layer in ompmoe.find_moe_layers(loaded)] == [l.num_kept for l in plan.layers]
    with torch.no_grad():
        ids = calibration[:2]
        expected = pruned(input_ids=ids, use_cache=False).logits
        assert torch.isfinite(expected).all()
        torch.testing.assert_close(loaded(input_ids=ids, use_cache=False).logits, expected)


def test_calibration_module_and_data_resolve_the_shipped_name():
    from ompmoe.lightning.calibration_data import CalibrationDataModule
    from ompmoe.lightning.calibration_module import CalibrationModule

    module = CalibrationModule("shipped:tiny-moe-64")
    assert module.tokenizer_name == str(MODEL_DIR)
    module.configure_model()
    assert next(module.model.parameters()).dtype == torch.float32
    assert module.model.config.model_type == "glm4_moe"
    data = CalibrationDataModule("shipped:code", tokenizer="shipped:tiny-moe-64", seq_len=32, num_blocks=2)
    assert data.blocks.shape == (2, 32) and int(data.blocks.max()) < module.model.config.vocab_size


def test_cli_fit_calibrates_and_prunes_the_shipped_model(tmp_path):
    from pathlib import Path

    import yaml

    from ompmoe.cli import main

    config = yaml.safe_load((Path(__file__).parents[2] / "configs" / "tiny.yaml").read_text())
    config["trainer"]["callbacks"][0]["init_args"].update(output_dir=str(tmp_path / "run"), evaluate_blocks=8)
    config["trainer"]["default_root_dir"] = str(tmp_path / "lightning")
    config["data"].update(num_blocks=4, seq_len=64)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(config))
    main(["fit", "-c", str(tmp_path / "tiny.yaml"), "--model.model", "shipped:tiny-moe-64",
          "--trainer.enable_progress_bar=false"])
    stats = ompmoe.MoEStats.load(tmp_path / "run" / "stats.safetensors")
    assert stats.model_id == "shipped:tiny-moe-64" and stats.num_tokens == 4 * 64
    plan = ompmoe.PruningPlan.load(tmp_path / "run" / "plan.json")
    assert plan.achieved_ratio == pytest.approx(0.5) and len(plan.layers) == 5
    assert all(layer.num_kept % 8 == 0 for layer in plan.layers)
    model = ompmoe.load_pruned(tmp_path / "run" / "model")
    assert [layer.num_experts for layer in ompmoe.find_moe_layers(model)] == [layer.num_kept for layer in plan.layers]
    assert (tmp_path / "run" / "model" / "tokenizer.json").is_file()
