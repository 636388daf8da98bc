"""Write a pruned (or never-pruned) model as a directory stock tools load: atomically, with its card, tokenizer
and, for a non-uniform plan, its modeling code."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..apply.quantized import check_savable
from ..io import atomic_path
from .checkpoint import save_checkpoint


def save_pruned(model: nn.Module, path: str | os.PathLike, tokenizer: Any | None = None, overwrite: bool = False, *,
                dtype: torch.dtype | str | None = None, calibration: str | None = None,
                inputs: Iterable[str | os.PathLike] = (), **save_kwargs: Any) -> Path:
    """``save_pretrained`` into ``path`` atomically, as a directory stock tools can use: weights in ``dtype`` (default:
    the source checkpoint's), tokenizer, model card (``calibration`` describes the data) and, for a non-uniform plan,
    its modeling code. Quantized models are refused. ``inputs``: paths the run reads (never replaced)."""
    check_savable(model)
    with atomic_path(path, overwrite=overwrite, directory=True, inputs=inputs) as tmp:
        save_checkpoint(model, tmp, tokenizer=tokenizer, dtype=dtype, calibration=calibration, final_path=path,
                        **save_kwargs)
    return Path(path)
