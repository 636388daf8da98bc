"""Inference cost of an evaluation (the paper's Table 6 "Cost"): wall time, tokens and requests.

Each batch's measured seconds are spread over its work items by their share of its tokens (the
positions the model computed: a shared input counts once, a generation row counts every position up
to the batch's end), then over the requests that use each item, and summed per task.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .requests import SCORE

ItemCost = tuple[float, float]
"""(seconds, tokens) of one work item."""


def batch_item_costs(batch: Mapping[str, Any], outputs: Mapping[int, Any], seconds: float) -> dict[int, ItemCost]:
    """Each item's share of one batch's ``seconds`` and tokens (``outputs``: the batch's results)."""
    if batch["kind"] == SCORE:
        rows = batch["target_rows"].tolist()
        sharing = Counter(rows)
        lengths = batch["lengths"].tolist()
        tokens = {item: lengths[row] / sharing[row] for item, row in zip(batch["target_items"].tolist(), rows)}
    else:
        contexts = batch["attention_mask"].sum(dim=1).tolist()
        tokens = {item: float(context + len(outputs[item]))
                  for item, context in zip(batch["items"].tolist(), contexts)}
    total = sum(tokens.values()) or 1.0
    return {item: (seconds * count / total, count) for item, count in tokens.items()}


def cost_record(requests: Sequence[Any], items: Mapping[int, ItemCost], seconds: float,
                **settings: Any) -> dict[str, Any]:
    """The results file's ``ompmoe.cost``: totals, per task, and the run's ``settings``; ``seconds`` is the
    measured wall time of the evaluation loop, ``requests`` the work plan's."""
    users = Counter(item for request in requests for item in request.items)
    tasks: dict[str, dict[str, float]] = defaultdict(lambda: {"seconds": 0.0, "tokens": 0.0, "requests": 0})
    for request in requests:
        entry = tasks[request.instance.task_name]
        entry["requests"] += 1
        for item in request.items:
            item_seconds, item_tokens = items.get(item, (0.0, 0.0))
            entry["seconds"] += item_seconds / users[item]
            entry["tokens"] += item_tokens / users[item]
    return {
        "seconds": float(seconds),
        "model_seconds": float(sum(cost[0] for cost in items.values())),
        "tokens": int(round(sum(cost[1] for cost in items.values()))),
        "requests": len(requests),
        **settings,
        "tasks": {
            task: {"seconds": entry["seconds"], "tokens": int(round(entry["tokens"])), "requests": entry["requests"]}
            for task, entry in sorted(tasks.items())
        },
    }


def device_name(device: torch.device) -> str:
    """``cpu`` or ``cuda:0 (NVIDIA H100 80GB HBM3)``: what a cost was measured on."""
    if device.type == "cuda" and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)
