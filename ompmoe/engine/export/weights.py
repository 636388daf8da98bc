"""Refuse weight files that would load silently wrong: corrupt, non-floating, missing, unexpected or mis-shaped.

transformers initialises a missing tensor at random and only logs it; an integer tensor is cast without a word.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..lazy_checkpoint import weight_files
from ..safetensors_header import FLOATING, CorruptSafetensorsError, read_header

SHOWN = 5
"""Tensor names listed in a message (the count says how many more)."""
FIX = "Re-save the model (ompmoe.save_pruned) or copy the checkpoint again."


class CheckpointWeightsError(ValueError):
    """The weight files of a checkpoint do not match its model."""


def _names(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def check_weight_files(path: str | os.PathLike, integer_tensors: Callable[[], set[str]] | None = None) -> None:
    """Every weight file's header is consistent and every tensor is floating point, except those the model itself
    holds as integers (``integer_tensors()``, asked only when a file has any: DeepSeek-V4's token-to-expert table)."""
    for file in weight_files(path):
        try:
            tensors = read_header(file)
        except CorruptSafetensorsError as error:
            raise CheckpointWeightsError(f"{error}. {FIX}") from None
        integral = [name for name, entry in tensors.items() if entry["dtype"] not in FLOATING]
        if integral and integer_tensors is not None:
            held = integer_tensors()
            integral = [name for name in integral if name not in held]
        if integral:
            kinds = sorted({tensors[name]["dtype"] for name in integral})
            raise CheckpointWeightsError(
                f"{file} stores {len(integral)} tensors in a non-floating dtype ({', '.join(kinds)}): {_names(integral)}; "
                f"the model's weights are floating point and would load as wrong values. {FIX}")


def check_loading_info(path: str | os.PathLike, info: dict[str, Any]) -> None:
    """Nothing missing, unexpected or mis-shaped in what ``from_pretrained(..., output_loading_info=True)`` read."""
    files = ", ".join(str(file) for file in weight_files(path)) or str(path)
    labels = {"missing_keys": "missing (would be random)", "unexpected_keys": "not in the model"}
    problems = [f"{label}: {_names(list(info[key]))}" for key, label in labels.items() if info.get(key)]
    if info.get("mismatched_keys"):
        shapes = [f"{key} {list(saved)} (model: {list(expected)})" for key, saved, expected in info["mismatched_keys"]]
        problems.append(f"of the wrong shape: {_names(shapes)}")
    if problems:
        raise CheckpointWeightsError(f"{files} does not match the model: tensors {'; '.join(problems)}. {FIX}")
