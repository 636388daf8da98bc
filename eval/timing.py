"""Repeated, warmed-up timing of an evaluation (the report's Speedup) and when a speedup is told apart from 1.

One pass (the report's Cost) includes warm-up and the machine's other load, so :class:`ompmoe.eval.EvalModule`
re-runs a *timing probe* after the loop, warmed up and repeated (:func:`timing_record`). :func:`speedup` compares two
files' repeats: median ratio ``s``, rated only when its min/max interval excludes 1 and is narrower than 2|s - 1|.
The rule, the probe and measurements: docs/evaluation.md, "Reports" and "Inference cost".
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MIN_REPEATS = 3
"""Fewest timed repeats (in both files) for a rated speedup."""

TIMES = ("seconds", "cpu_seconds")
"""What each repeat records: wall-clock seconds (slowest rank) and process CPU seconds (summed over ranks)."""


def probe_indices(total: int, count: int) -> list[int]:
    """``count`` batch indices of ``0..total-1``, evenly spaced from the first to the last (all when fewer)."""
    if total <= 0 or count <= 0:
        return []
    if count >= total:
        return list(range(total))
    if count == 1:
        return [total // 2]
    return sorted({round(i * (total - 1) / (count - 1)) for i in range(count)})


def inputs_fingerprint(batches: Sequence[Mapping[str, Any]]) -> str:
    """Hash of the probe's input token ids, in order: equal when two runs timed the same inputs."""
    sha = hashlib.sha256()
    for batch in batches:
        ids = batch["input_ids"]
        sha.update(repr(tuple(ids.shape)).encode())
        sha.update(ids.detach().to("cpu").contiguous().numpy().tobytes())
    return sha.hexdigest()[:16]


def summary(samples: Sequence[float]) -> dict[str, float]:
    """Median, lowest and highest of one time's repeats."""
    return {"median": float(statistics.median(samples)), "min": float(min(samples)), "max": float(max(samples))}


def timing_record(wall: Sequence[float], cpu: Sequence[float], *, warmup: int, batches: int, tokens: int,
                  inputs: str | None) -> dict[str, Any]:
    """The results file's ``ompmoe.cost.timing``: every repeat's times, their median and range, and the probe."""
    record: dict[str, Any] = {"repeats": len(wall), "warmup": int(warmup), "batches": int(batches),
                              "tokens": int(tokens), "inputs": inputs}
    for name, samples in zip(TIMES, (wall, cpu)):
        record[name] = [float(value) for value in samples]
        if samples:
            record[f"{name}_summary"] = summary(samples)
    return record


def samples_of(timing: Any, time: str = "seconds") -> list[float] | None:
    """The recorded repeats of ``time`` (``seconds`` or ``cpu_seconds``), or ``None`` when not usable
    (no record, too few repeats, or a value that is not a finite positive number)."""
    values = timing.get(time) if isinstance(timing, Mapping) else None
    if not isinstance(values, list) or len(values) < MIN_REPEATS or any(
            isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0
            for value in values):
        return None
    return [float(value) for value in values]


@dataclass(frozen=True)
class Speedup:
    """A speedup with its interval (see the module docstring for the rule)."""

    value: float
    low: float
    high: float

    @property
    def significant(self) -> bool:
        excludes_one = self.low > 1 or self.high < 1
        return excludes_one and (self.high - self.low) / 2 < abs(self.value - 1)

    def __str__(self) -> str:
        return f"{self.value:.2f}× ({self.low:.2f}-{self.high:.2f})"


def speedup(baseline: Sequence[float], row: Sequence[float]) -> Speedup:
    """The row's speedup over the baseline from their repeated times (seconds, lower is faster)."""
    if not baseline or not row:
        raise ValueError("speedup needs at least one time of each.")
    return Speedup(statistics.median(baseline) / statistics.median(row), min(baseline) / max(row),
                   max(baseline) / min(row))
