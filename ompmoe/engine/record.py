"""The pruning record a pruned model carries in its config (``config.ompmoe``), in its own module so that pruning,
checkpoint loading and adaptive inference can all read it without importing each other."""

from __future__ import annotations

from typing import Any

CONFIG_KEY = "ompmoe"
"""Config attribute of a pruned model: ``{"kept_experts", "original_num_experts", "uniform", ...}``."""


def pruning_info(model_or_config: Any) -> dict[str, Any] | None:
    """The ``ompmoe`` record of a pruned model or config, or ``None`` if it was never pruned."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, CONFIG_KEY, None)
