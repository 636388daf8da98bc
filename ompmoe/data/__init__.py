"""Calibration text: cut a token stream into the paper's non-overlapping fixed-length blocks."""

from __future__ import annotations

from importlib import resources

import torch

SHIPPED_TEXT = "calibration.txt"


def shipped_text() -> str:
    """The offline calibration text that ships with ompmoe (Python reference docs, PSF license)."""
    return resources.files(__name__).joinpath(SHIPPED_TEXT).read_text(encoding="utf-8")


def byte_tokens(text: str) -> torch.Tensor:
    """UTF-8 bytes as token ids (vocabulary 256): the tokenizer of the tiny demo models."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def token_blocks(token_ids: torch.Tensor, seq_len: int, num_blocks: int) -> torch.Tensor:
    """First ``num_blocks`` non-overlapping blocks of ``seq_len`` tokens; the remainder is dropped.

    Raises before any model work if the stream is too short, saying how many tokens it has and needs.
    """
    if seq_len <= 0 or num_blocks <= 0:
        raise ValueError(f"seq_len and num_blocks must be positive; got seq_len={seq_len}, num_blocks={num_blocks}.")
    needed = seq_len * num_blocks
    found = int(token_ids.numel())
    if found < needed:
        raise ValueError(
            f"Calibration text has {found} tokens but {num_blocks} blocks of {seq_len} need {needed}: "
            f"add text, or lower num_blocks to {found // seq_len} or seq_len to {found // num_blocks}."
        )
    return token_ids.reshape(-1)[:needed].view(num_blocks, seq_len)
