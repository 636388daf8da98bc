"""Read the config of a saved pruned checkpoint without running its remote code."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import transformers

from ..hub import cache_only_where_unreachable
from ..adapters import MODEL_TYPE_ALIASES, ArchitectureSpec, UnsupportedModelError, architecture_for_config, known_spec
from ..record import CONFIG_KEY, FINETUNE_CONFIG_KEY, FINETUNE_KEY
from ..lazy_checkpoint import checkpoint_config
from ..model_classes import broken_container, left_out_towers, runnable_config
from .hub_code import is_non_uniform, stock_config_dict



def add_finetune_record(config: Any, record: dict[str, Any]) -> None:
    """Append ``record`` (JSON-able: method, steps, data, recovery) to the fine-tunes ``config`` carries, so that
    ``config.json`` and the model card say how the saved weights were trained."""
    pruning = getattr(config, CONFIG_KEY, None)
    if isinstance(pruning, dict):
        setattr(config, CONFIG_KEY, {**pruning, FINETUNE_KEY: [*pruning.get(FINETUNE_KEY, []), record]})
    else:
        setattr(config, FINETUNE_CONFIG_KEY, [*(getattr(config, FINETUNE_CONFIG_KEY, None) or []), record])


def finetune_records(config_dict: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The fine-tunes a saved ``config.json`` (as a dict) records, oldest first, each with when it ran: ``before
    pruning`` (a model fine-tuned, then pruned), ``after pruning`` or ``""`` (a model never pruned)."""
    pruning = config_dict.get(CONFIG_KEY)
    pruned = isinstance(pruning, dict)
    earlier = [("before pruning" if pruned else "", record) for record in config_dict.get(FINETUNE_CONFIG_KEY) or []]
    later = [("after pruning", record) for record in (pruning.get(FINETUNE_KEY) if pruned else None) or []]
    return [(stage, record) for stage, record in earlier + later if isinstance(record, dict)]


def refuse_earlier_format(config_dict: dict[str, Any], count_key: str | None, path: str | os.PathLike) -> None:
    """One clear error for a checkpoint of an earlier ompmoe (the expert count stored as a mapping)."""
    if count_key is not None and isinstance(config_dict.get(count_key), dict):
        raise ValueError(
            f"{path} was pruned by an earlier ompmoe version (config.json stores {count_key!r} as a mapping), "
            "which this version does not read. Re-create it from the statistics of that run: ompmoe prune --stats "
            "STATS.safetensors --ratio R --model ORIGINAL_MODEL --output_dir NEW_DIR."
        )


def _spec_of(config_dict: dict[str, Any]) -> ArchitectureSpec | None:
    """The spec of a saved config: registered, or, for a pruned checkpoint of a type recognized by its modules,
    recognized again on a skeleton without weights (a fresh process has not seen the model)."""
    model_type = config_dict.get("model_type")
    if (spec := known_spec(model_type)) is not None:
        return spec
    if CONFIG_KEY not in config_dict or model_type not in transformers.CONFIG_MAPPING:
        return None
    try:
        return architecture_for_config(transformers.CONFIG_MAPPING[model_type].from_dict(stock_config_dict(config_dict)))
    except UnsupportedModelError:
        return None


def load_stock_config(path: str | os.PathLike, trust_remote_code: bool = False) -> Any:
    """The stock transformers config of ``path``, for a non-uniform checkpoint without what refuses stock models,
    and for a type transformers knows under another name (:data:`~ompmoe.engine.adapters.MODEL_TYPE_ALIASES`: Kimi K2)
    that name's, without its remote code. A cached hub id is read from the cache alone where the hub does not answer."""
    with cache_only_where_unreachable(path):
        config_dict, _ = transformers.PreTrainedConfig.get_config_dict(path)
        model_type = config_dict.get("model_type")
        if model_type in MODEL_TYPE_ALIASES:
            return checkpoint_config(path)
        spec = _spec_of(config_dict)
        key = spec.expert_count_key if spec is not None else None
        refuse_earlier_format(config_dict, key, path)
        if key is not None and is_non_uniform(config_dict):
            config_class = transformers.CONFIG_MAPPING[model_type]
            return config_class.from_dict(stock_config_dict(config_dict), name_or_path=str(path))
        return runnable_config(transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))


def read_as_text_model(path: str | os.PathLike, local_files_only: bool = False) -> tuple[str, ...] | None:
    """For a checkpoint at ``path`` that is a container ompmoe reads as its text model (:func:`runnable_config`), the
    container's other parts (:func:`~ompmoe.engine.model_classes.left_out_towers`), whose tensors are in the files
    and not in the model; ``None`` for any other checkpoint."""
    config_dict, _ = transformers.PreTrainedConfig.get_config_dict(path, local_files_only=local_files_only)
    model_type = config_dict.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING or model_type in MODEL_TYPE_ALIASES:
        return None
    config = transformers.CONFIG_MAPPING[model_type].from_dict(config_dict)
    return left_out_towers(config) if broken_container(config) is not None else None


def non_uniform_config(path: str | os.PathLike) -> Any | None:
    """The stock config of a local non-uniform checkpoint (written with remote code), else ``None``."""
    try:
        config_dict = json.loads(Path(path, "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    spec = _spec_of(config_dict) if isinstance(config_dict, dict) else None
    if spec is None:
        return None
    refuse_earlier_format(config_dict, spec.expert_count_key, path)
    return load_stock_config(path) if is_non_uniform(config_dict) else None


def _aliased_config(path: str | os.PathLike) -> Any | None:
    """The stock config of a local checkpoint of an aliased type (:func:`~ompmoe.engine.adapters.with_stock_type`),
    else ``None``."""
    try:
        config_dict = json.loads(Path(path, "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    aliased = isinstance(config_dict, dict) and config_dict.get("model_type") in MODEL_TYPE_ALIASES
    return checkpoint_config(path) if aliased else None


def load_tokenizer(name: str | os.PathLike, **kwargs: Any) -> Any:
    """``AutoTokenizer.from_pretrained``, handed the stock config of a non-uniform pruned checkpoint or of an aliased
    type (Kimi K2: so that transformers does not ask to run its config's remote code); a tokenizer's own remote code
    runs only where ``trust_remote_code=True`` is passed (transformers would otherwise ask on a terminal). A hub id is
    read from the cache alone where the hub does not answer (no minute of retries)."""
    kwargs.setdefault("trust_remote_code", False)
    config = (non_uniform_config(name) or _aliased_config(name)) if "config" not in kwargs else None
    if config is not None:
        kwargs["config"] = config
    with cache_only_where_unreachable(name):
        return transformers.AutoTokenizer.from_pretrained(name, **kwargs)
