"""The shipped models' cards read as a reader reads them: the held-out "subset" rows and how the card says they
were measured, and that measurement redone on the shipped weights."""

from __future__ import annotations

import math
import re

import torch

from ompmoe.data import corpus_token_stream, shipped_model_path, token_blocks


def card(name: str) -> str:
    return (shipped_model_path(name) / "README.md").read_text(encoding="utf-8")


def subset_measure(text: str) -> tuple[int, int]:
    """``(blocks, tokens per block)`` as the card states the subset rows' measurement."""
    found = re.search(r"\(first (\d+) blocks of (\d+) tokens of each\s+held-out split", text)
    assert found, "the card does not say how its subset rows were measured"
    return int(found.group(1)), int(found.group(2))


def subset_row(text: str, domain: str) -> list[str]:
    """The printed cells of the card's ``| <domain> (subset) | ... |`` row, first step to last."""
    found = re.search(rf"^\| {domain} \(subset\) \|(.*)\|$", text, flags=re.MULTILINE)
    assert found, f"the card has no {domain} (subset) row"
    return [cell.strip() for cell in found.group(1).split("|")]


@torch.no_grad()
def subset_perplexity(model: torch.nn.Module, tokenizer, domain: str, blocks: int, seq_len: int) -> float:
    """Literal: the first ``blocks`` non-overlapping blocks of ``seq_len`` tokens of the domain's held-out token
    stream, every token after the first of a block predicted; exp of the mean negative log-likelihood."""
    ids = token_blocks(corpus_token_stream(tokenizer, domain, "heldout", max_tokens=blocks * seq_len), seq_len, blocks)
    assert ids.shape == (blocks, seq_len)
    logits = model(input_ids=ids, use_cache=False).logits.float()
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return math.exp(float(nll))


def check_last_subset_point(name: str, model: torch.nn.Module, tokenizer, domain: str, shape: tuple[int, int]) -> None:
    """The card's subset row of ``domain`` ends at the shipped weights' perplexity, measured as the card states it
    (``shape``: the blocks and tokens per block the tests expect), to the printed precision."""
    import json

    text = card(name)
    training = json.loads((shipped_model_path(name) / "metrics.json").read_text())["training"]
    blocks, seq_len = subset_measure(text)
    assert (blocks, seq_len) == (training["curve_blocks"], training["seq_len"]) == shape
    measured = subset_perplexity(model, tokenizer, domain, blocks, seq_len)
    assert f"{measured:.1f}" == subset_row(text, domain)[-1], (domain, measured)
