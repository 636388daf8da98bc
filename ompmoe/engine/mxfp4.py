"""Checkpoints whose experts are stored in MXFP4 (gpt-oss's release: ``quant_method`` ``mxfp4``): each fused experts
weight ``<name>`` is ``<name>_blocks`` (``uint8`` ``[experts, out, in / 32, 16]``: two E2M1 codes per byte) beside
``<name>_scales`` (``uint8`` ``[experts, out, in / 32]``: one power-of-two exponent, biased by 127, per 32 values),
the OCP Microscaling format. Layer-by-layer runs compute on the weights as transformers dequantizes them (exactly:
every such value is a bfloat16; :func:`dequantize`) and write the kept experts' blocks and scales as stored; weights a
compensation changed are quantized again as transformers quantizes (:func:`quantize`)."""

from __future__ import annotations

import os
from typing import Any

import torch

from .quantized_files import ComputedSlice, QuantizedCheckpointError

BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
"""A weight ``<name>`` is stored as ``<name>_blocks`` and ``<name>_scales``."""
VALUES_PER_BLOCK = 32
"""Values sharing one scale (16 bytes of two codes each)."""
QUANTIZED = (".experts.gate_up_proj", ".experts.down_proj")
"""The model tensors the format stores in MXFP4 (transformers' ``Mxfp4HfQuantizer.serialized_names``)."""


def mxfp4_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` (a ``quantization_config`` with ``quant_method`` ``mxfp4``) checked: the stored format has no
    variant ompmoe would read wrong, so there is nothing to refuse yet."""
    return dict(settings)


def stored_names(saved: list[str]) -> set[str]:
    """The ``uint8`` tensor names a checkpoint in this format stores for the model tensors ``saved`` (as
    ``save_pretrained`` names them): each experts projection's blocks and scales."""
    return {name + suffix for name in saved if name.endswith(QUANTIZED) for suffix in (BLOCKS_SUFFIX, SCALES_SUFFIX)}


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each 4-bit E2M1 code (sign, two exponent bits, one mantissa bit)."""


MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The magnitude of each E2M1 code's lower three bits; the fourth is the sign."""
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
"""Halfway between consecutive magnitudes: a value on one rounds away from zero (the quantizer rounds its truncated
mantissa half up)."""


def _codes_and_exponents(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The E2M1 codes (``uint8`` ``[..., in]``, one per value) and biased exponents (``uint8`` ``[..., in / 32]``) of
    ``rows`` (``[..., in]``, groups of 32 along the last axis), as transformers' ``quantize_to_mxfp4`` quantizes
    (triton_kernels' ``downcast_to_mxfp_torch``, its default rounding): the values taken in bfloat16, each group's
    multiplier its largest magnitude over 6 rounded up to a power of two (nothing saturates; an all-zero group gets
    exponent 0), each value over it to the nearest E2M1 magnitude, ties away from zero, its sign kept (-0 included)."""
    if rows.shape[-1] % VALUES_PER_BLOCK:
        raise QuantizedCheckpointError(f"MXFP4 groups {VALUES_PER_BLOCK} values along a row; these rows hold "
                                       f"{rows.shape[-1]}, not a multiple of {VALUES_PER_BLOCK}.")
    values = rows.to(torch.bfloat16).float().contiguous()  # a transposed view: searched row by row
    if not bool(torch.isfinite(values).all()):
        raise QuantizedCheckpointError("MXFP4 stores finite values only; these rows hold an infinity or NaN.")
    groups = values.reshape(*values.shape[:-1], -1, VALUES_PER_BLOCK)
    bits = (groups.abs().amax(dim=-1) / MAGNITUDES[-1]).view(torch.int32)
    exponents = (bits + 0x7FFFFF) >> 23  # the float32 multiplier's exponent field, rounded up to a power of two
    multipliers = (exponents << 23).view(torch.float32)
    scaled = groups * torch.where(multipliers == 0, 0.0, 1.0 / multipliers)[..., None]
    magnitude = torch.bucketize(scaled.abs(), torch.tensor(MIDPOINTS, device=scaled.device), right=True)
    codes = magnitude + 8 * torch.signbit(scaled).to(magnitude.dtype)
    return codes.reshape(values.shape).to(torch.uint8), exponents.to(torch.uint8)


def quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, scales)`` storing ``rows`` (``[..., out, in]``: the files' layout, groups of 32 along ``in``) as the
    format stores them, quantized as transformers' ``quantize_to_mxfp4`` quantizes (:func:`_codes_and_exponents`):
    ``blocks`` ``[..., out, in / 32, 16]`` (two codes per byte, the lower nibble first), ``scales`` ``[..., out,
    in / 32]``."""
    codes, exponents = _codes_and_exponents(rows)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.reshape(*exponents.shape, VALUES_PER_BLOCK // 2).contiguous(), exponents.contiguous()


def round_to_grid(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (``[..., out, in]``) as they read back once :func:`quantize` has stored them, in their dtype (exact:
    every such value is a bfloat16)."""
    codes, exponents = _codes_and_exponents(rows)
    magnitude = torch.tensor(MAGNITUDES, device=codes.device)[(codes & 0x07).long()]
    signed = torch.where(codes >= 8, -magnitude, magnitude).reshape(*exponents.shape, VALUES_PER_BLOCK)
    multipliers = (exponents.to(torch.int32) << 23).view(torch.float32)
    return (signed * multipliers[..., None]).reshape(rows.shape).to(rows.dtype)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The bfloat16 model-layout tensor (``[experts, in, out]``) of ``blocks`` and ``scales``: the values
    transformers' ``from_pretrained`` gives gpt-oss, bit for bit (code value x 2 ** (scale - 127), exact in bfloat16),
    one expert at a time, so that reading a layer holds its bfloat16 experts and one expert's values, not the several
    full-size intermediates of transformers' function (gpt-oss-120b: 4 GiB each), and twice as fast. Each byte's two
    values are one lookup; the power of two is applied as two exact halves (2 ** 128 is not a bfloat16, 0.5 * 2 **
    128 is), each product exact in bfloat16 or rounded once, as transformers' float32 product is."""
    experts, rows, groups, width = blocks.shape
    out = torch.empty(experts, groups * width * 2, rows, dtype=torch.bfloat16)
    lut = torch.tensor(E2M1, dtype=torch.float32)
    byte = torch.arange(256)
    pairs = torch.stack((lut[byte & 0x0F], lut[byte >> 4]), dim=-1).to(torch.bfloat16)  # the lower nibble first
    for expert in range(experts):
        exponent = scales[expert].to(torch.int32) - 127
        half = torch.div(exponent, 2, rounding_mode="floor")
        codes = blocks[expert].reshape(-1).to(torch.int32)
        values = pairs.index_select(0, codes).reshape(rows, groups, width * 2)
        values *= torch.exp2(half.float()).to(torch.bfloat16)[..., None]
        values *= torch.exp2((exponent - half).float()).to(torch.bfloat16)[..., None]
        out[expert].copy_(values.reshape(rows, groups * width * 2).t())
    return out


class Mxfp4Slice(ComputedSlice):
    """An MXFP4 weight of the files read as its dequantized bfloat16 values, in the model's layout."""

    def __init__(self, blocks: Any, scales: Any) -> None:
        self.blocks, self.scales = blocks, scales

    def get_shape(self) -> list[int]:
        experts, rows, groups, width = self.blocks.get_shape()
        return [experts, groups * width * 2, rows]

    def get_dtype(self) -> str:
        return "BF16"

    def __getitem__(self, index: Any) -> torch.Tensor:
        return dequantize(self.blocks[:], self.scales[:])[index]


def pair_blocks(headers: dict[str, str], shapes: dict[str, list[int]], settings: dict[str, Any] | None,
                source: str | os.PathLike) -> list[str]:
    """The MXFP4 weights of the files (``headers``: name -> safetensors dtype), each ``<name>_blocks`` checked against
    its ``<name>_scales``: MXFP4 tensors without a ``quantization_config`` saying so (they would not load), or one
    whose partner is missing, of another dtype or not covering it, are refused by name."""
    suffixes = (BLOCKS_SUFFIX, SCALES_SUFFIX)
    present = sorted(name for name, dtype in headers.items() if dtype == "U8" and name.endswith(suffixes))
    names = sorted({name[:-len(next(suffix for suffix in suffixes if name.endswith(suffix)))] for name in present})
    if names and settings is None:
        raise QuantizedCheckpointError(
            f"{source} stores {len(names)} weights in MXFP4 ({present[0]}, ...) but its config.json has "
            "no quantization_config with quant_method 'mxfp4'; they would not be read as weights. Add the "
            "quantization_config the checkpoint was released with.")
    if settings is None:
        return []
    if not names:
        raise QuantizedCheckpointError(
            f"{source}'s config.json says its experts are MXFP4 (quantization_config), but its files hold no "
            f"<name>{BLOCKS_SUFFIX} / <name>{SCALES_SUFFIX} pair; remove the quantization_config from config.json if "
            "the weights are full precision.")
    wrong = []
    for name in names:
        parts = [name + suffix for suffix in suffixes]
        absent = [part for part in parts if part not in headers]
        other = [f"{part} is {headers[part]}" for part in parts if part in headers and headers[part] != "U8"]
        if absent or other:
            wrong.append(f"{name} has no {absent[0]}" if absent else f"{other[0]}, not 8-bit codes or exponents (U8)")
            continue
        blocks, scales = shapes[parts[0]], shapes[parts[1]]
        if len(blocks) != 4 or blocks[-1] != VALUES_PER_BLOCK // 2 or list(scales) != list(blocks[:-1]):
            wrong.append(f"{parts[0]} {list(blocks)} and {parts[1]} {list(scales)} are not "
                         f"[experts, rows, groups, {VALUES_PER_BLOCK // 2}] and [experts, rows, groups]")
    if wrong:
        raise QuantizedCheckpointError(f"{source} stores MXFP4 weights ompmoe cannot read: {'; '.join(wrong[:3])}"
                                       f"{'; ...' if len(wrong) > 3 else ''}. Its files are incomplete or in another "
                                       "MXFP4 layout (ompmoe reads gpt-oss's).")
    return names


__all__ = ["BLOCKS_SUFFIX", "SCALES_SUFFIX", "Mxfp4Slice", "dequantize", "mxfp4_settings", "pair_blocks", "quantize",
           "round_to_grid", "stored_names"]
