"""Name the real mistake when one of ompmoe's inputs is given where another is expected (a plan as statistics, a
run's folder as a model, results as a plan): a cheap look at the file tells what it is, so the error says "this is a
plan; pass stats.safetensors" instead of a parser's complaint about a truncated or invalid file."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..safetensors_header import read_header

KINDS = {
    "statistics": "ompmoe statistics (stats.safetensors)",
    "plan": "a pruning plan (plan.json)",
    "model": "a model folder (config.json)",
    "results": "an lm-eval results file",
    "run": "the output folder of an ompmoe run",
    "weights": "a safetensors file of weights",
}
"""What each kind of input is called in a message."""

RUN_FILES = {"statistics": "stats.safetensors", "plan": "plan.json", "model": "model"}
"""Where a run's output folder keeps each kind (``ExpertPruning``, ``PruningRun``, ``ompmoe-demo``)."""

FILE_NOUNS = {"statistics": "statistics file", "plan": "plan file"}
"""The kinds that are always local files, as a message names a missing one."""

MAX_JSON_BYTES = 64 * 2**20


def input_kind(path: str | os.PathLike) -> str | None:
    """What ``path`` holds (a key of :data:`KINDS`), or ``None`` when it is none of them or cannot be read."""
    path = Path(path)
    try:
        if path.is_dir():
            if (path / "config.json").is_file():
                return "model"
            return "run" if any((path / RUN_FILES[kind]).is_file() for kind in ("statistics", "plan")) else None
        with open(path, "rb") as handle:
            start = handle.read(8)
            if start.lstrip()[:1] in (b"{", b"["):
                data = json.loads(path.read_text()) if path.stat().st_size <= MAX_JSON_BYTES else None
                if isinstance(data, dict) and "layers" in data and "ratio" in data:
                    return "plan"
                return "results" if isinstance(data, dict) and "results" in data else None
            length = int.from_bytes(start, "little") if len(start) == 8 else 0
            if not 0 < length <= min(MAX_JSON_BYTES, path.stat().st_size - 8):
                return None
            header = json.loads(handle.read(length))
    except (OSError, ValueError):
        return None
    if not isinstance(header, dict):
        return None
    metadata = header.get("__metadata__") or {}
    if isinstance(metadata, dict) and "ompmoe" in metadata:
        return "statistics"
    try:  # weights only when the header describes the file: a damaged one gets the loader's own error
        read_header(path)
    except (OSError, ValueError):
        return None
    return "weights"


def check_input_kind(path: str | os.PathLike, expected: str) -> None:
    """Refuse ``path`` in one line when it is recognisably another kind of input than ``expected``, naming what
    it is and what to pass instead (the run folder's own file when there is one). A statistics file or plan that
    does not exist, next to a file of a close name, is refused with that name (a mistyped ``--stats``); otherwise
    its loader says that it is missing."""
    if expected in FILE_NOUNS and not Path(path).exists():
        from ..names import nearest_path_hint

        hint = nearest_path_hint(os.fspath(path))
        if hint.startswith("; did you mean"):
            raise FileNotFoundError(f"{FILE_NOUNS[expected]} {os.fspath(path)!r} does not exist{hint}")
        return
    kind = input_kind(path)
    if kind is None or kind == expected:
        return
    path = Path(path)
    folder = path if kind == "run" else path.parent if kind in ("statistics", "plan") else None
    beside = folder / RUN_FILES[expected] if folder is not None and expected in RUN_FILES else None
    fix = f"pass {beside} instead" if beside is not None and beside.exists() else f"pass {KINDS[expected]}"
    raise ValueError(f"{path} is {KINDS[kind]}, not {KINDS[expected]}; {fix}")


__all__ = ["KINDS", "check_input_kind", "input_kind"]
