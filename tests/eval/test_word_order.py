"""``ompmoe_word_order``: the offline task of configs/eval/tiny.yaml on which shipped:tiny-moe beats chance."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from ompmoe.cli import main  # noqa: E402
from ompmoe.data import corpus_documents  # noqa: E402
from ompmoe.eval.report import report_table  # noqa: E402
from ompmoe.eval.word_order import ANSWER_WORDS, CONTEXT_WORDS, PER_DOMAIN, word_order_docs  # noqa: E402

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "eval" / "tiny.yaml"
TASKS_DIR = str(Path(__file__).resolve().parents[1] / "eval_tasks")


def test_items_are_word_orders_of_held_out_text_with_one_true_order():
    docs = word_order_docs()
    assert [doc["domain"] for doc in docs] == ["prose"] * PER_DOMAIN + ["code"] * PER_DOMAIN
    assert [doc["label"] for doc in docs] == [index % 4 for index in range(len(docs))]
    texts = {domain: {doc["id"]: doc["text"] for doc in corpus_documents(domain, "heldout")}
             for domain in ("prose", "code")}
    train = {doc["text"] for domain in ("prose", "code") for doc in corpus_documents(domain, "train")}
    for doc in docs:
        source = texts[doc["domain"]][doc["id"].split(":", 1)[1].rsplit(":", 1)[0]]
        assert source not in train
        choices = doc["choices"]
        assert len(set(choices)) == 4
        assert len(re.findall(r"\S+", doc["context"])) == CONTEXT_WORDS
        # Same words, same whitespace: only the order differs.
        assert {tuple(sorted(choice.split())) for choice in choices} == {tuple(sorted(choices[0].split()))}
        assert {tuple(re.findall(r"\s+", choice)) for choice in choices} == {tuple(re.findall(r"\s+", choices[0]))}
        assert all(len(choice.split()) == ANSWER_WORDS for choice in choices)
        # Exactly the labelled choice is what follows the context in the held-out document.
        assert [doc["context"] + choice in source for choice in choices] == [i == doc["label"] for i in range(4)]


def test_shipped_model_scores_above_chance_and_the_report_averages_it(tmp_path):
    output = tmp_path / "original.json"
    main(["validate", "-c", str(CONFIG), "--data.include_path", TASKS_DIR, "--data.tasks", "[ompmoe_word_order]",
          "--data.limit", "60", "--data.output_path", str(output), "--model.timing_repeats", "0",
          "--trainer.logger.init_args.save_dir", str(tmp_path / "logs")])
    written = json.loads(output.read_text())
    n = written["n-samples"]["ompmoe_word_order"]["effective"]
    accuracy = written["results"]["ompmoe_word_order"]["acc,none"]
    chance = written["ompmoe"]["columns"][0]["chance"]  # recorded by the bridge: mean of 1 / choices
    assert n == 60 and chance == 0.25
    correct = round(accuracy * n)
    # One-sided binomial test: the chance of guessing at least this many right.
    p_value = sum(math.comb(n, k) * chance ** k * (1 - chance) ** (n - k) for k in range(correct, n + 1))
    assert p_value < 1e-6, (correct, n)
    table = report_table([output])
    # Averaged (not left out as at chance), and marked † as noisy: 60 items, fewer than 100.
    assert "| ompmoe_word_order † | Average |" in table and "Average over ompmoe_word_order." in table
    assert f"| {100 * accuracy:.2f} ± {100 * math.sqrt(accuracy * (1 - accuracy) / (n - 1)):.2f} | " in table
