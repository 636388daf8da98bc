"""Shipped data: calibration text and block cutting, the two-domain corpus and the shipped tiny-moe models.

Calibration text from anywhere (presets, the hub, local files) and its token packing: :mod:`.sources`."""

from __future__ import annotations

import gzip
import json
import sys
from importlib import resources
from pathlib import Path

import torch

from ..engine.names import CORPUS_DOMAINS, SHIPPED_MODELS, SHIPPED_PREFIX, resolve_shipped, shipped_model_path  # noqa: F401

SHIPPED_TEXT = "calibration.txt"


def shipped_text() -> str:
    """The offline calibration text that ships with ompmoe (Python reference docs, PSF license)."""
    return resources.files(__name__).joinpath(SHIPPED_TEXT).read_text(encoding="utf-8")


def byte_tokens(text: str) -> torch.Tensor:
    """UTF-8 bytes as token ids (vocabulary 256): the tokenizer of the tiny demo models."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def token_blocks(token_ids: torch.Tensor, seq_len: int, num_blocks: int) -> torch.Tensor:
    """First ``num_blocks`` non-overlapping blocks of ``seq_len`` tokens; the remainder is dropped. Raises before
    any model work if the stream is too short, saying how many tokens it has and needs."""
    if seq_len <= 0 or num_blocks <= 0:
        raise ValueError(f"seq_len and num_blocks must be positive; got seq_len={seq_len}, num_blocks={num_blocks}.")
    needed = seq_len * num_blocks
    found = int(token_ids.numel())
    if found < needed:
        # Only suggest values that are allowed (positive); with none, say how much text is missing.
        lower = [f"{name} to {value}" for name, value in (("num_blocks", found // seq_len),
                                                            ("seq_len", found // num_blocks)) if value > 0]
        hint = f"add text, or lower {' or '.join(lower)}" if lower else f"add text ({needed - found} more tokens)"
        raise ValueError(f"Calibration text has {found} tokens but {num_blocks} blocks of {seq_len} need {needed}: "
                         f"{hint}.")
    return token_ids.reshape(-1)[:needed].view(num_blocks, seq_len)


CORPUS_DIR = "corpus"
CORPUS_SPLITS = ("train", "calibration", "heldout")
"""Fixed splits of each domain (by whole documents; see ``corpus/README.md``)."""
def corpus_path(domain: str, split: str) -> Path:
    """Path of ``corpus/<domain>-<split>.jsonl.gz`` (one ``{"id", "text"}`` record per document)."""
    if domain not in CORPUS_DOMAINS or split not in CORPUS_SPLITS:
        raise ValueError(f"Unknown corpus part {domain!r}/{split!r}; domains {CORPUS_DOMAINS}, splits {CORPUS_SPLITS}.")
    return Path(str(resources.files(__name__).joinpath(CORPUS_DIR, f"{domain}-{split}.jsonl.gz")))


def corpus_documents(domain: str, split: str) -> list[dict[str, str]]:
    """The documents of one split of one domain, in their fixed order, as ``{"id", "text"}`` dicts."""
    with gzip.open(corpus_path(domain, split), "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def corpus_token_stream(tokenizer, domain: str, split: str, max_tokens: int | None = None) -> torch.Tensor:
    """One split of one domain as a token stream, built like :class:`ompmoe.CalibrationDataModule`'s
    (:func:`ompmoe.data.sources.token_stream`)."""
    from .sources import text_encoder, token_stream

    texts = (doc["text"] for doc in corpus_documents(domain, split))
    return token_stream(texts, text_encoder(tokenizer), max_tokens if max_tokens is not None else sys.maxsize)
