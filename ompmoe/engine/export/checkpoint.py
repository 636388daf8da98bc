"""Write a complete pruned checkpoint: weights in the source dtype, tokenizer, remote code, model card.

Every path that writes a model comes here, so each output directory loads in stock tools.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from ..._quiet import quiet_calls
from ..adapters import architecture_of
from ..model_classes import auto_class_names
from ..names import resolve_shipped
from .config import load_tokenizer
from .hub_code import write_remote_code
from ..hub import is_hub_id
from .model_card import model_card
from .safetensors_writer import parallel_pretrained_writes

TOKENIZER_HINT = (
    "pass tokenizer=<hub id, path or tokenizer> to save_pruned (CLI: ompmoe prune --tokenizer ...; "
    "callback: ExpertPruning(tokenizer=...))"
)


class MissingTokenizerWarning(UserWarning):
    """A pruned model was saved without tokenizer files; stock tools cannot run it as is."""


def source_name(model: nn.Module) -> str | None:
    """The hub id or path the model was loaded from, if transformers recorded one."""
    name = getattr(getattr(model, "config", None), "_name_or_path", None)
    return str(name) if name else None


def source_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype stored in the source checkpoint's ``config.json`` (loading may have upcast the weights); ``None``
    when the source is unknown or not available locally (nothing is downloaded)."""
    name = source_name(model)
    if name is None:
        return None
    try:
        config_dict, _ = transformers.PreTrainedConfig.get_config_dict(name, local_files_only=True)
        value = config_dict.get("dtype", config_dict.get("torch_dtype"))
        return _resolve_dtype(str(value)) if value else None
    except (OSError, ValueError):
        return None


def resolve_tokenizer(tokenizer: Any, model: nn.Module) -> Any | None:
    """A tokenizer object from ``tokenizer`` (object, hub id or path) or else the model's source, or ``None``."""
    if hasattr(tokenizer, "save_pretrained"):
        return tokenizer
    named = isinstance(tokenizer, (str, os.PathLike))
    candidate = str(tokenizer) if named else source_name(model) if tokenizer is None else None
    if candidate is None or candidate == "bytes" or candidate.startswith("tiny:"):
        return None
    try:
        path = resolve_shipped(candidate)
        loaded = load_tokenizer(path, local_files_only=not is_hub_id(path))
        if len(loaded) < 2:  # transformers 5 builds an empty tokenizer for a folder without tokenizer files
            raise ValueError(f"{path} has no tokenizer files (what loads from it is an empty vocabulary)")
        return loaded
    except Exception as error:  # noqa: BLE001 - transformers raises many kinds for "no tokenizer here"
        if named:
            remote = ("; its tokenizer is remote code, which ompmoe does not run: pass one that loads without it "
                      "(ompmoe fit --model.tokenizer, ompmoe prune --tokenizer)" if "trust_remote_code" in str(error)
                      else "")
            raise ValueError(
                f"tokenizer={tokenizer!r} could not be loaded ({error}){remote}; pass a hub id, a local "
                "directory with tokenizer files, or a tokenizer object."
            ) from error
    return None


def _cast_state_dict(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's tensors in ``dtype`` (floating point only), leaving modules transformers keeps in float32."""
    keep = [module for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict")
            for module in getattr(model, attr, None) or []]
    state: dict[str, torch.Tensor] = {}
    cast: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}  # tied weights stay one tensor
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not any(part in name.split(".") for part in keep):
            key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
            if key not in cast:
                cast[key] = tensor.to(dtype)
            tensor = cast[key]
        state[name] = tensor
    return state


def save_checkpoint(
    model: nn.Module,
    directory: str | Path,
    *,
    tokenizer: Any | None = None,
    dtype: torch.dtype | str | None = None,
    calibration: str | None = None,
    final_path: str | os.PathLike | None = None,
    write_weights: Callable[[Path], None] | None = None,
    **save_kwargs: Any,
) -> dict[str, Any]:
    """Write ``model`` and everything stock tools need into the (empty, temporary) ``directory``. ``dtype``: on
    disk; ``None`` keeps the source checkpoint's, else the model's. ``final_path``: where ``directory`` will be moved
    (named in the warning). ``write_weights``: writes the weight files instead of ``save_pretrained`` (a model
    without weights, pruned from its source files tensor by tensor); config and the rest are written as for any
    model. Returns ``dtype``, ``tokenizer``, ``remote_code``."""
    directory = Path(directory)
    target = written_dtype(model, dtype)
    current = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    cast = target is not None and current is not None and target != current and "state_dict" not in save_kwargs
    if write_weights is not None:  # the files' tensors as they are: the source's dtype, whatever the skeleton's
        if dtype is not None and _resolve_dtype(dtype) != source_dtype(model):
            raise ValueError(f"A checkpoint written from its source files keeps their dtype ({source_dtype(model)}); "
                             f"got dtype={dtype!r}. Load the model to save it in another dtype.")
        _save_config_like_save_pretrained(model, directory, target or current)
        write_weights(directory)
        cast = False
    else:
        if cast:
            save_kwargs["state_dict"] = _cast_state_dict(model, target)
        with quiet_calls(), parallel_pretrained_writes():  # no "Writing model shards" bar; shards from threads
            model.save_pretrained(directory, **save_kwargs)
    written_tokenizer = resolve_tokenizer(tokenizer, model)
    if written_tokenizer is not None:
        written_tokenizer.save_pretrained(directory)
    else:
        warnings.warn(
            f"No tokenizer was found for the pruned model saved to {final_path or directory} (model source: "
            f"{source_name(model)!r}); stock tools (AutoTokenizer, lm-eval) cannot run it without one: "
            f"{TOKENIZER_HINT}.",
            MissingTokenizerWarning,
            stacklevel=3,
        )
    config = json.loads((directory / "config.json").read_text())
    if cast:
        config["dtype"] = str(target).removeprefix("torch.")  # save_pretrained records the in-memory dtype
        (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    record = config.get("ompmoe") or {}
    remote = bool(record) and not record.get("uniform", True)
    if remote:
        stock_model = _stock_class(type(model))
        write_remote_code(directory, _stock_class(type(model.config)).__name__, stock_model.__name__,
                          architecture_of(model).router_attr, auto_class_names(model.config, stock_model))
    info = {
        "dtype": str(config.get("dtype", "")).removeprefix("torch."),
        "tokenizer": written_tokenizer is not None,
        "remote_code": remote,
    }
    model_id = record.get("plan", {}).get("model_id") or source_name(model)
    (directory / "README.md").write_text(model_card(config, model_id, calibration, info))
    return info


def _save_config_like_save_pretrained(model: nn.Module, directory: Path, dtype: torch.dtype | None) -> None:
    """``config.json`` and ``generation_config.json`` as ``save_pretrained`` writes them (its class as the
    architecture, the weights' ``dtype``), for a model whose weights are written apart."""
    if dtype is not None:
        model.config.dtype = str(dtype).split(".")[1]
    model.config.architectures = [_stock_class(type(model)).__name__]
    model.config.save_pretrained(directory)
    generation = getattr(model, "generation_config", None)
    if generation is not None and callable(getattr(model, "can_generate", None)) and model.can_generate():
        generation.save_pretrained(directory)


def _stock_class(cls: type) -> type:
    """The first transformers class of ``cls``'s MRO (a model loaded with the remote code subclasses it)."""
    return next(base for base in cls.__mro__ if base.__module__.startswith("transformers."))


def _resolve_dtype(dtype: torch.dtype | str | None, option: str = "dtype") -> torch.dtype | None:
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"Unknown {option} {str(dtype)!r} for the saved weights; use e.g. 'bfloat16', 'float16' or "
                         "'float32' (or leave it out: the source's).")
    return resolved


def written_dtype(model: nn.Module, dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The dtype :func:`save_checkpoint` writes ``model``'s floating-point tensors in (``None``: each its own)."""
    return _resolve_dtype(dtype) or source_dtype(model)


def check_save_dtype(dtype: torch.dtype | str | None, option: str = "dtype") -> None:
    """Refuse, before any work, a saved-weights dtype that :func:`~ompmoe.save_pruned` would refuse at the end."""
    _resolve_dtype(dtype, option)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
"""Files of which a local directory holding a tokenizer has at least one."""


def usable_tokenizer(candidates: Iterable[Any]) -> Any | None:
    """The first candidate that is a tokenizer object, or a hub id or path naming one, to save with the model, else
    ``None`` (then :func:`ompmoe.save_pruned` tries the model's source and warns when nothing is found). ``bytes``
    and ``tiny:`` names do not count: they have no files to save; nor does a local directory without tokenizer files
    (a checkpoint calibrated on bytes), which would fail only when the model is saved, after all the work."""
    for value in candidates:
        value = os.fspath(value) if isinstance(value, os.PathLike) else value
        named = isinstance(value, str) and value not in ("", "bytes") and not value.startswith("tiny:")
        if named and os.path.isdir(value) and not any(os.path.exists(os.path.join(value, name))
                                                      for name in TOKENIZER_FILES):
            continue
        if named or hasattr(value, "save_pretrained"):
            return value
    return None
