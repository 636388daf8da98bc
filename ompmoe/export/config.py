"""Read the config of a saved pruned checkpoint, old or new, without running its remote code."""

from __future__ import annotations

import os
from typing import Any

import transformers

from ..adapters import ARCHITECTURES
from .hub_code import stock_config_dict


def load_stock_config(path: str | os.PathLike, trust_remote_code: bool = False) -> Any:
    """The stock transformers config of ``path``; a non-uniform checkpoint's count marker becomes the largest count.

    Checkpoints written before the remote code existed (an int count) load through ``AutoConfig`` as before.
    """
    config_dict, _ = transformers.PreTrainedConfig.get_config_dict(path)
    spec = ARCHITECTURES.get(config_dict.get("model_type"))
    if spec is not None and isinstance(config_dict.get(spec.expert_count_key), dict):
        config_class = transformers.CONFIG_MAPPING[config_dict["model_type"]]
        return config_class.from_dict(stock_config_dict(config_dict, spec.expert_count_key), name_or_path=str(path))
    return transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
