"""Repeated, warmed-up timing of an evaluation (the report's Speedup) and when a speedup is told apart from 1.

The evaluation loop runs every batch once; its time (the report's Cost) includes the first batches' warm-up
(kernel selection, allocator growth, caches) and whatever else ran on the machine at that moment, so two
runs of the same model can differ by far more than pruning changes (on a loaded CPU the demo's Cost ratio
was 0.75x in one pair of runs and 1.60x in the next). After the loop, :class:`ompmoe.eval.EvalModule`
re-runs a *timing probe*: up to ``timing_batches`` of its batches, evenly spaced over the length-sorted
order (short and long inputs, every kind of request), ``timing_warmup`` times untimed, then
``timing_repeats`` times timed, each repeat one pass over all of them. The results file records every
repeat's wall and CPU time (``ompmoe.cost.timing``, :func:`timing_record`).

:func:`speedup` compares two such records. With the baseline's repeats ``b`` and a row's repeats ``r``:

- ``speedup = median(b) / median(r)``;
- ``interval = (min(b) / max(r), max(b) / min(r))``: the lowest and highest ratio of any baseline repeat to
  any row repeat (no pairing is assumed: the two files were timed at different moments);
- the speedup is *significant* when the interval excludes 1 (``low > 1`` or ``high < 1``) **and** its
  half-width ``(high - low) / 2`` is smaller than the speedup's distance from 1, ``|speedup - 1|``.
  Otherwise the report prints ``n.s.`` instead of a number. Both records need at least
  :data:`MIN_REPEATS` repeats; with fewer (or none: files written before the probe existed) the speedup
  is *unrated*.
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
