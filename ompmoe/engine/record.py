"""The pruning record a pruned model carries in its config (``config.ompmoe``), in its own module so that pruning,
checkpoint loading and adaptive inference can all read it without importing each other."""

from __future__ import annotations

from typing import Any

CONFIG_KEY = "ompmoe"
"""Config attribute of a pruned model: ``{"kept_experts", "original_num_experts", "uniform", ...}``."""
FINETUNE_KEY = "finetune"
"""Key of the fine-tunes' records (a list, oldest first) in a pruned model's ``config.ompmoe``."""
FINETUNE_CONFIG_KEY = "ompmoe_finetune"
"""Config attribute holding that list for a model ompmoe never pruned: its ``config.ompmoe`` would read as a
pruning record without the kept experts, which loading refuses."""


ADAPTIVE_KEY = "ompmoe_adaptive"
"""Config attribute of a model with OMP-MoE+ switched on: ``{"epsilon", "zeta", "alphas"}``
(:mod:`ompmoe.engine.apply.adaptive`; ``ompmoe.load_pruned`` switches it on again)."""


EARLIER_KEY = "earlier"
"""Key of a re-pruned model's record listing the earlier prunings (:func:`earlier_pruning`), oldest first: the record's
own plan and compensation are the last pruning's, its kept ids and counts the original model's."""


def earlier_pruning(record: dict[str, Any]) -> dict[str, Any]:
    """What one pruning did, as a later pruning of the same model keeps it: its plan summary, its compensation (the
    kept experts' weights carry it on), how many routed experts it left of the original's and which (the original's
    ids per layer: the later pruning's plan numbers the experts this one left, :func:`last_pruning_kept`)."""
    kept_experts = {name: [int(i) for i in ids] for name, ids in (record.get("kept_experts") or {}).items()}
    return {"plan": dict(record["plan"]), **({"compensation": dict(record["compensation"])}
                                             if record.get("compensation") else {}),
            "kept": sum(len(ids) for ids in kept_experts.values()),
            "of": sum((record.get("original_num_experts") or {}).values()), "kept_experts": kept_experts}


def last_pruning_kept(record: dict[str, Any]) -> dict[str, list[int]] | None:
    """The experts the last pruning kept, numbered as its plan numbers them (the experts of the model it pruned): the
    original's ids after a first pruning; after a re-pruning, their positions among the experts the earlier pruning
    left. ``None`` for a model re-pruned before earlier prunings recorded their ids (it cannot be told)."""
    kept = {name: [int(i) for i in ids] for name, ids in (record.get("kept_experts") or {}).items()}
    earlier = record.get(EARLIER_KEY) or []
    if not earlier:
        return kept
    before = earlier[-1].get("kept_experts")
    if not isinstance(before, dict) or set(before) != set(kept):
        return None
    positions = {name: {int(expert): position for position, expert in enumerate(ids)} for name, ids in before.items()}
    return {name: [positions[name][i] for i in ids] for name, ids in kept.items()}


def pruning_info(model_or_config: Any) -> dict[str, Any] | None:
    """The ``ompmoe`` record of a pruned model or config, or ``None`` if it was never pruned."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, CONFIG_KEY, None)


def within_tolerance(record: dict[str, Any]) -> str | None:
    """``it raised the loss by 0.0100 nats, within the 0.02-nat tolerance`` when a compensation record's held-out
    check kept a map that raised the loss (``auto`` keeps it: smaller moves are noise on so few tokens), else
    ``None``."""
    raised = record["loss_with"] - record["loss_without"]
    if not record.get("applied", True) or raised <= 0 or record.get("tolerance") is None:
        return None
    amount = f"{raised:.4f}" if raised >= 1e-4 else f"{raised:.1e}"  # never "by 0.0000"
    return f"it raised the loss by {amount} nats, within the {record['tolerance']:g}-nat tolerance"
