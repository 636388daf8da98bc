"""Model names as users give them (hub ids, local paths, ``tiny:<model_type>``, ``shipped:<name>``): load the
model or its config and pick its tokenizer, for the calibration, fine-tuning and evaluation modules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._quiet import quiet_calls
from ..data import resolve_shipped
from ..data.sources import BYTES as BYTES_TOKENIZER
from ..data.sources import require_hub_model

TINY_PREFIX = "tiny:"
"""``tiny:<model_type>``: a tiny random model of a supported architecture (offline tests and demos)."""


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"bfloat16"``/``"torch.bfloat16"``/a dtype/``None`` as a ``torch.dtype`` (or ``None``)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"Unknown dtype {dtype!r}; use e.g. 'bfloat16', 'float16' or 'float32'.")
    return resolved


def is_tiny(name: Any) -> bool:
    return isinstance(name, str) and name.startswith(TINY_PREFIX)


def model_and_name(model: str | nn.Module | None) -> tuple[nn.Module | None, str | None]:
    """``(instance, name)`` of a model given as an instance (named by its config's ``_name_or_path``) or by name."""
    if isinstance(model, nn.Module):
        return model, getattr(getattr(model, "config", None), "_name_or_path", None) or None
    return None, None if model is None else str(model)


def resolve_model(name: str) -> str:
    """``name`` as ``from_pretrained`` takes it, refused at once when it cannot be loaded: a misspelt
    shipped name, a local path that does not exist, or a hub id that is neither cached nor reachable."""
    path = resolve_shipped(name, "model path")
    if path == name and not Path(name).expanduser().exists():
        require_hub_model(name)
    from ..engine.collect.input_kinds import check_input_kind
    from ..engine.export.load import require_model_directory

    check_input_kind(path, "model")  # a run's folder, a plan or statistics given as the model
    require_model_directory(path, lambda inner: f"pass {inner} instead")
    return path


def default_dtype(name: str) -> torch.dtype | None:
    """The dtype the model ``name`` is loaded (or built without weights) in unless one is given: float32 for a shipped
    model (bf16 on disk for size only), else ``None``: the checkpoint's own."""
    return torch.float32 if resolve_shipped(name) != name else None


@quiet_calls()  # tiny models too: their first build imports transformers' modeling code (torchao's lines)
def load_model(name: str, dtype: torch.dtype | None = None, trust_remote_code: bool = False) -> nn.Module:
    """The causal LM named ``name``; checkpoints pruned by ompmoe load with their per-layer counts.

    ``dtype=None`` keeps the checkpoint's dtype, except for shipped models (bf16 on disk for size only): float32.
    """
    if is_tiny(name):
        from ..engine.tiny import tiny_model

        return tiny_model(name.removeprefix(TINY_PREFIX), dtype=dtype or torch.float32)
    from ..engine.export.load import load_pruned

    path = resolve_model(name)
    return load_pruned(path, dtype=dtype or default_dtype(name) or "auto", trust_remote_code=trust_remote_code)


@quiet_calls()
def model_config(name: str, trust_remote_code: bool = False) -> Any:
    """The config of the model named ``name``, without loading weights."""
    if is_tiny(name):
        from ..engine.tiny import tiny_config

        return tiny_config(name.removeprefix(TINY_PREFIX))
    from ..engine.export.config import load_stock_config  # AutoConfig; non-uniform pruned checkpoints too

    return load_stock_config(resolve_model(name), trust_remote_code=trust_remote_code)


def default_tokenizer(model_name: str | None, tokenizer: str | None = None) -> str | None:
    """The tokenizer to use: ``tokenizer`` if given, bytes for tiny models, else the model's own."""
    return resolve_shipped(tokenizer or (BYTES_TOKENIZER if is_tiny(model_name) else model_name),
                           "tokenizer path" if tokenizer else "model path")
