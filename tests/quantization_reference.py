"""A literal reference for ``ompmoe.quantize_experts``: value by value, in plain Python floats rounded to float32.

The layout it pins (the docs claim no compatibility with another tool's format): symmetric, no zero point, scale =
max |w| / 7 (int4) or / 127 (int8); int4 codes offset by 8 and packed two per byte along the row, value ``2k`` in the
low nibble and ``2k + 1`` in the high one. How that compares with other layouts (read in torchao 0.18's source):

- the same nibble order as torchao's KleidiAI int4 path (``intx_opaque_tensor.py``: ``qdata.add(8)``, then
  ``qdata[:, 1::2] << 4 | qdata[:, ::2]``) and as the uint8 that torchao's ``Int4PlainInt32Tensor`` (XPU) hands to
  ``_convert_weight_to_int4pack``;
- the opposite of torchao's CUDA tinygemm packing (``quantization/utils.py``: ``q[:, ::2] << 4 | q[:, 1::2]``);
- GPTQ checkpoints store ``qweight`` as int32 words of 8 unsigned values along the input axis, value ``i`` at bits
  ``4i``: the same low-first order (ompmoe's bytes of a row read as little-endian int32 words give those words), but
  transposed (``[in / 8, out]``) and with per-group zero points and GPTQ's scales, so not a GPTQ checkpoint.
"""

from __future__ import annotations

import struct

import torch


def f32(x: float) -> float:
    """``x`` rounded to the nearest float32. For ``+ - * /`` of float32 values, the exact (double) result rounded
    once to float32 is float32 arithmetic's result, so this reproduces the quantizer's float32 steps exactly."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def group_size_used(bits: int, group_size: int, width: int) -> int:
    """int8: the whole row; int4: ``group_size`` values, or the whole row where ``group_size`` does not divide it."""
    return group_size if bits == 4 and group_size > 0 and width % group_size == 0 else width


def reference_quantize(weight: torch.Tensor, bits: int, group_size: int):
    """Literal, one value at a time: ``(codes, scales, dequantized)`` of a float32 ``(..., width)`` weight.

    - a group: int8, one row of the stored matrix (its last axis); int4, ``group_size`` consecutive values of a row;
    - scale = max |w| of the group / 127 (int8) or / 7 (int4), a float32 division;
    - code = w / scale (float32) rounded half to even, clamped to [-127, 127] (int8) or [-8, 7] (int4); 0 in a group
      of zeros (scale 0);
    - int4 bytes: the codes + 8 (0..15), two per byte along the row, value 2k in the low nibble, 2k + 1 in the high;
    - dequantized = code * scale (float32).
    """
    width = weight.shape[-1]
    size = group_size_used(bits, group_size, width)
    high, low = (127, -127) if bits == 8 else (7, -8)
    codes, scales, dense = [], [], []
    for row in weight.reshape(-1, width).tolist():
        row_codes, row_scales, row_dense = [], [], []
        for start in range(0, width, size):
            group = row[start:start + size]
            scale = f32(max(abs(value) for value in group) / high)
            values = [0 if scale == 0 else min(high, max(low, round(f32(value / scale)))) for value in group]
            row_scales.append(scale)
            row_codes += values
            row_dense += [f32(value * scale) for value in values]
        if bits == 4:
            row_codes = [(row_codes[k] + 8) | ((row_codes[k + 1] + 8) << 4) for k in range(0, width, 2)]
        codes.append(row_codes)
        scales.append(row_scales)
        dense.append(row_dense)
    lead = weight.shape[:-1]
    return (torch.tensor(codes, dtype=torch.int8 if bits == 8 else torch.uint8).reshape(*lead, -1),
            torch.tensor(scales, dtype=torch.float32).reshape(*lead, -1),
            torch.tensor(dense, dtype=torch.float32).reshape(weight.shape))
