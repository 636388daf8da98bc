"""Check a ``.safetensors`` file's header before any tensor is read: sizes, offsets, shapes and dtypes.

The safetensors library trusts the header (a length of 2**62 is read as given) and reports a truncated file
without naming it; checking first gives one error naming the file and what is wrong.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FLOATING = {"F8_E5M2", "F8_E4M3", "F16", "BF16", "F32", "F64"}
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors format's own limit


class CorruptSafetensorsError(ValueError):
    """A ``.safetensors`` file whose header does not describe its own contents."""


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """The validated header of ``path``: ``{tensor name: {"dtype", "shape", "data_offsets"}}`` (metadata left out)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise CorruptSafetensorsError(
                f"{path} is not a safetensors file: it has {size} bytes, fewer than its 8-byte header length")
        length = int.from_bytes(prefix, "little")
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise CorruptSafetensorsError(f"{path} is truncated or not a safetensors file: its header claims "
                                          f"{length} bytes but the file has {size}")
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CorruptSafetensorsError(f"{path} has a header that is not valid JSON ({error})") from None
    if not isinstance(header, dict):
        raise CorruptSafetensorsError(f"{path} has a header that is not a JSON object")
    data_bytes = size - 8 - length
    tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
    for name, entry in tensors.items():
        problem = _entry_problem(entry, data_bytes)
        if problem:
            raise CorruptSafetensorsError(f"{path}: tensor {name!r} {problem}")
    return tensors


def _entry_problem(entry: Any, data_bytes: int) -> str | None:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        return "has no dtype, shape and data_offsets"
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_BYTES:
        return f"has unknown dtype {dtype!r}"
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        return f"has an invalid shape {shape!r}"
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(n, int) for n in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        return f"has invalid data_offsets {offsets!r}"
    if offsets[1] > data_bytes:
        return f"ends at byte {offsets[1]} of the data, but the file holds {data_bytes} (truncated?)"
    needed = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != needed:
        return f"of shape {shape} and dtype {dtype} needs {needed} bytes but its offsets span {offsets[1] - offsets[0]}"
    return None
