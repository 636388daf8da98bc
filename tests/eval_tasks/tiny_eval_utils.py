"""Data of the tiny lm-eval tasks used by ompmoe's evaluation tests (no downloads)."""

import json
from pathlib import Path

import datasets

HERE = Path(__file__).parent


def _rows(name):
    return [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]


def multiple_choice(**_):
    rows = _rows("tiny_mc.jsonl")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def arithmetic(**_):
    rows = _rows("tiny_gen.jsonl")
    return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:6]), "test": datasets.Dataset.from_list(rows[6:])})


def documents(**_):
    from ompmoe.data import shipped_text

    text = shipped_text()
    lengths = [40, 180, 255, 256, 257, 600, 1100]  # around the tiny models' 256-token context
    docs, start = [], 0
    for length in lengths:
        docs.append({"text": text[start:start + length]})
        start += length
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})
