"""What makes two evaluation results comparable: same base model (input embeddings, which pruning
keeps), same tokenizer vocabulary, same task versions; ``ompmoe report`` checks them against its baseline.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

NOISY_ITEMS = 100
"""Tasks with fewer items are flagged as noisy in reports (one item moves accuracy by >= 1 point)."""


def weights_fingerprint(model: nn.Module) -> str | None:
    """Hash of the input embeddings in bfloat16: equal for a model and its pruned versions, whatever their dtype."""
    import torch  # here, so that ``ompmoe report`` (which only compares recorded hashes) never loads torch

    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    weight = getattr(embeddings, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.is_meta:
        return None
    data = weight.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def tokenizer_fingerprint(tokenizer: Any) -> str | None:
    """Hash of the vocabulary and special tokens (the same files under another path give the same hash)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if not callable(get_vocab):
        return None
    payload = {
        "vocab": sorted(get_vocab().items()),
        "special": {k: str(v) for k, v in sorted((getattr(tokenizer, "special_tokens_map", None) or {}).items())},
    }
    return hashlib.sha256(json.dumps(payload, default=str).encode()).hexdigest()[:16]


def identity(row: Mapping[str, Any]) -> dict[str, Any]:
    """Base model, tokenizer and task versions recorded in one results JSON (``None`` where not recorded)."""
    model = (row.get("ompmoe") or {}).get("model") or {}
    config = row.get("config") or {}
    return {
        "base_model": model.get("base_model"),
        "weights": model.get("weights_fingerprint"),
        "tokenizer_name": config.get("tokenizer"),
        "tokenizer": config.get("tokenizer_fingerprint"),
        "versions": dict(row.get("versions") or {}),
    }


def problems(rows: Sequence[Mapping[str, Any]], base: int, names: Sequence[str]) -> dict[int, list[str]]:
    """Per row (not the baseline), why it cannot be compared with the baseline; unrecorded facts are listed too."""
    reference = identity(rows[base])
    found: dict[int, list[str]] = {}
    for index, row in enumerate(rows):
        if index == base:
            continue
        mine, issues = identity(row), []
        if mine["weights"] and reference["weights"] and mine["weights"] != reference["weights"]:
            issues.append(
                f"base model differs ({mine['base_model'] or 'unknown'} vs {reference['base_model'] or 'unknown'}: "
                "input embeddings differ, so it is not a pruned version of the baseline)"
            )
        if mine["tokenizer"] and reference["tokenizer"] and mine["tokenizer"] != reference["tokenizer"]:
            issues.append(f"tokenizer differs ({mine['tokenizer_name']} vs {reference['tokenizer_name']})")
        issues += [f"task {task} version differs ({mine['versions'][task]} vs {reference['versions'][task]})"
                   for task in sorted(set(mine["versions"]) & set(reference["versions"]))
                   if str(mine["versions"][task]) != str(reference["versions"][task])]
        if issues:
            found[index] = issues
    return found


def _limit(value: Any) -> str:
    """A recorded ``limit`` as the user typed it: ``none`` for every item."""
    if value is None:
        return "none"
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


SHOWN_TASKS = 3
"""Tasks named in an item-count mismatch before "and N more"."""


def item_problems(rows: Sequence[Mapping[str, Any]], base: int) -> dict[int, str]:
    """Per row (not the baseline), why it was scored on other items than the baseline: a task both scored on a
    different number of items (lm-eval's ``n-samples``, after ``--data.limit``), with the two limits when they
    differ. A retained percentage or speedup between them would compare different questions (a 2-item baseline
    against a 200-item run). Without recorded counts, different recorded limits count as such a row."""
    def counts(row: Mapping[str, Any]) -> dict[str, int]:
        return {task: int(entry.get("effective", entry.get("original", 0)))
                for task, entry in (row.get("n-samples") or {}).items()}

    def limit(row: Mapping[str, Any]) -> tuple[bool, Any]:
        config = row.get("config") or {}
        return "limit" in config, config.get("limit")

    reference, (base_has_limit, base_limit) = counts(rows[base]), limit(rows[base])
    found: dict[int, str] = {}
    for index, row in enumerate(rows):
        if index == base:
            continue
        mine, (has_limit, my_limit) = counts(row), limit(row)
        shared = sorted(set(mine) & set(reference))
        differ = [f"{task}: {mine[task]} vs {reference[task]} items"
                  for task in shared if mine[task] != reference[task]]
        limits_differ = has_limit and base_has_limit and _limit(my_limit) != _limit(base_limit)
        if not differ and (shared or not limits_differ):
            continue  # the same items: the counts agree (a limit above every task's size changes nothing)
        parts = [f"--data.limit {_limit(my_limit)} vs {_limit(base_limit)}"] if limits_differ else []
        if len(differ) > SHOWN_TASKS:
            differ = [*differ[:SHOWN_TASKS], f"and {len(differ) - SHOWN_TASKS} more tasks"]
        found[index] = f"scored on other items ({'; '.join(parts + differ)})"
    return found


def unrecorded(rows: Sequence[Mapping[str, Any]]) -> list[int]:
    """Rows whose base model or tokenizer fingerprint was not recorded (older results files)."""
    return [i for i, row in enumerate(rows) if not (identity(row)["weights"] and identity(row)["tokenizer"])]


def item_count(row: Mapping[str, Any], source: str) -> int | None:
    """Items a task (or the sum over a group's tasks) was scored on, from lm-eval's ``n-samples``."""
    samples = row.get("n-samples") or {}
    if source in samples:
        return int(samples[source].get("effective", samples[source].get("original", 0)))
    counts = [item_count(row, task) for task in (row.get("group_subtasks") or {}).get(source) or ()]
    return sum(counts) if counts and None not in counts else None  # type: ignore[arg-type]


def stderr_of(row: Mapping[str, Any], source: str, metric: str) -> float | None:
    """lm-eval's standard error of ``metric`` (``"name,filter"``) of ``source``, if it computed one."""
    name, _, filter_name = metric.partition(",")
    for section in ("results", "groups"):
        metrics = (row.get(section) or {}).get(source) or {}
        value = metrics.get(f"{name}_stderr,{filter_name}" if filter_name else f"{name}_stderr")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None
