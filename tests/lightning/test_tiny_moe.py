"""The shipped two-domain corpus and the small Qwen3-MoE trained on it (``shipped:tiny-moe``)."""

import hashlib
import json
import re

import pytest
import torch

from ompmoe.data import (
    CORPUS_DOMAINS,
    CORPUS_SPLITS,
    corpus_documents,
    corpus_path,
    resolve_shipped,
    shipped_model_path,
)
from reference import shipped_model, shipped_tokenizer
from model_cards import card, subset_measure, subset_perplexity, subset_row

MODEL_DIR = shipped_model_path("tiny-moe")


def card_perplexities() -> dict[str, float]:
    """Held-out perplexity per domain as stated in the model card's table."""
    card = (MODEL_DIR / "README.md").read_text(encoding="utf-8")
    found = dict(re.findall(r"^\| (prose|code) \| ([0-9.]+) \|", card, flags=re.MULTILINE))
    assert set(found) == set(CORPUS_DOMAINS), "the model card has no held-out perplexity table"
    return {domain: float(value) for domain, value in found.items()}


@pytest.fixture(scope="module")
def model():
    return shipped_model("tiny-moe")


@pytest.fixture(scope="module")
def tokenizer():
    return shipped_tokenizer("tiny-moe")


def test_corpus_splits_are_disjoint_and_cover_both_domains():
    digests: dict[str, tuple[str, str]] = {}
    for domain in CORPUS_DOMAINS:
        ids: dict[str, str] = {}
        for split in CORPUS_SPLITS:
            assert corpus_path(domain, split).stat().st_size < 1_000_000
            docs = corpus_documents(domain, split)
            assert len(docs) >= 10
            for doc in docs:
                assert doc["text"].strip()
                assert ids.setdefault(doc["id"], split) == split, f"{domain} document {doc['id']} in two splits"
                digest = hashlib.sha256(doc["text"].encode()).hexdigest()
                assert digests.setdefault(digest, (domain, split)) == (domain, split), f"{doc['id']} repeated"
    # No module is in both domains: its docstrings are prose only if its source is not code.
    code_files = {doc["id"] for split in CORPUS_SPLITS for doc in corpus_documents("code", split)}
    docstring_files = {
        doc["id"].removeprefix("docstrings:").rsplit("#", 1)[0]
        for split in CORPUS_SPLITS
        for doc in corpus_documents("prose", split)
        if doc["id"].startswith("docstrings:")
    }
    assert docstring_files and not code_files & docstring_files


def test_held_out_prose_paragraphs_are_not_in_training_prose():
    def paragraphs(split):
        return {p.strip() for doc in corpus_documents("prose", split) for p in doc["text"].split("\n\n") if len(p.strip()) >= 64}

    train = paragraphs("train")
    assert not paragraphs("heldout") & train
    assert not paragraphs("calibration") & train


def test_shipped_model_loads_offline_and_is_a_real_moe(model, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_shipped("shipped:tiny-moe") == str(MODEL_DIR)
    assert resolve_shipped("tiny:qwen3_moe") == "tiny:qwen3_moe"
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= 25 * 2**20
    config = model.config
    assert config.model_type == "qwen3_moe" and config.num_experts >= 16 and config.num_experts_per_tok >= 2
    assert 10e6 <= sum(p.numel() for p in model.parameters()) <= 30e6
    import ompmoe

    layers = ompmoe.find_moe_layers(model)
    assert len(layers) == config.num_hidden_layers and all(layer.num_experts == config.num_experts for layer in layers)
    again = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)


def test_tokenizer_round_trips_both_domains(tokenizer):
    assert len(tokenizer) >= 4000 and tokenizer.eos_token == "<|endoftext|>"
    for domain in CORPUS_DOMAINS:
        text = corpus_documents(domain, "heldout")[0]["text"][:3000]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) < len(text) / 2  # BPE merges, not bytes
        assert tokenizer.decode(ids) == text
    odd = "déjà vu \u2014 \U0001f600\tx = {'a': [1, 2]}\n\n    return None\r\n"
    assert tokenizer.decode(tokenizer(odd, add_special_tokens=False)["input_ids"]) == odd


@torch.no_grad()
def test_held_out_perplexity_is_the_model_cards(model, tokenizer):
    """The card's subset rows' last column (the end of training) recomputed from the shipped weights as the card
    states it (the first 8 blocks of 256 tokens of each held-out split), to the printed precision. The earlier
    columns are of weights that are not shipped; the whole-split table takes 140k tokens (about 15 s here) and is
    compared with metrics.json, which the card is generated from (tests/lightning/test_train_tiny_moe.py)."""
    text = card("tiny-moe")
    metrics = json.loads((MODEL_DIR / "metrics.json").read_text())
    blocks, seq_len = subset_measure(text)
    assert (blocks, seq_len) == (metrics["training"]["curve_blocks"], metrics["training"]["seq_len"]) == (8, 256)
    for domain in CORPUS_DOMAINS:
        printed = subset_row(text, domain)
        measured = subset_perplexity(model, tokenizer, domain, blocks, seq_len)
        assert f"{measured:.1f}" == printed[-1], (domain, measured, printed[-1])
        # metrics.json's unrounded value is of the float32 training weights, before the bfloat16 cast.
        assert measured == pytest.approx(metrics["training"]["heldout_curve"][-1][domain], rel=5e-3)
    # The card's whole-split numbers are the ones the training script measured.
    stated = card_perplexities()
    for domain in CORPUS_DOMAINS:
        assert stated[domain] == pytest.approx(metrics["perplexity"][domain]["heldout"]["perplexity"], abs=0.006)


def test_calibration_sources_and_module_resolve_the_shipped_model():
    from ompmoe.lightning.calibration_data import CalibrationDataModule
    from ompmoe.lightning.calibration_module import CalibrationModule

    module = CalibrationModule("shipped:tiny-moe")
    assert module.tokenizer_name == str(MODEL_DIR)
    module.configure_model()
    assert next(module.model.parameters()).dtype == torch.float32
    mix = CalibrationDataModule("shipped:mix", tokenizer="shipped:tiny-moe", seq_len=32, num_blocks=5)
    prose = CalibrationDataModule("shipped:prose", tokenizer="shipped:tiny-moe", seq_len=32, num_blocks=3)
    code = CalibrationDataModule("shipped:code", tokenizer="shipped:tiny-moe", seq_len=32, num_blocks=2)
    blocks = mix.blocks
    assert torch.equal(blocks[0::2], prose.blocks) and torch.equal(blocks[1::2], code.blocks)
    assert mix.describe() == "shipped:ompmoe/data/corpus/prose-calibration,shipped:ompmoe/data/corpus/code-calibration"
    assert prose.describe() == "shipped:ompmoe/data/corpus/prose-calibration"
    first = corpus_documents("prose", "calibration")[0]["text"]
    assert torch.equal(prose.blocks[0], module_tokens(first)[:32])


def module_tokens(text: str) -> torch.Tensor:
    from transformers import AutoTokenizer

    return torch.tensor(AutoTokenizer.from_pretrained(MODEL_DIR)(text, add_special_tokens=False)["input_ids"])
