"""Checkpoints stored in block FP8 (DeepSeek-V3/R1, Kimi K2, MiniMax-M2, Qwen3's -FP8 releases: ``quant_method``
``fp8`` with ``weight_block_size``): each such weight is an ``F8_E4M3`` tensor beside a float32 ``<name>_scale_inv``
holding one multiplier per block. Layer-by-layer runs compute on the weights dequantized (``value * scale`` per
block, as DeepSeek's reference ``weight_dequant`` and transformers' ``Fp8Dequantize`` give them) and write the kept
experts' FP8 tensors and scales as the source stores them, so the pruned checkpoint is the source's format, byte for
byte in every tensor it keeps. A compensation changes the kept experts' down projections: those are quantized again
(:func:`quantize`, as transformers' ``Fp8Quantize`` quantizes), and the run measures them as they are written
(:func:`round_to_grid`)."""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from .quantized_files import ComputedSlice, QuantizedCheckpointError, refuse_other_fp8, refuse_unscaled

SCALE_FILE_DTYPE = "F32"
"""The safetensors dtype of their scales (one float32 multiplier per block)."""
E4M3_MAX = 448.0
"""The largest E4M3 value: a block's largest magnitude is quantized to it."""
SCALE_FORMATS = (None, "float", "ue8m0")
"""``scale_fmt`` values :func:`quantize` writes: float32 multipliers (none, or ``float``: what transformers'
``FineGrainedFP8Config`` records), or powers of two (DeepSeek-V3.1's ``ue8m0``)."""
SCALE_SUFFIX = "_scale_inv"
"""A weight ``<name>``'s block multipliers are ``<name>_scale_inv`` (``x.weight`` -> ``x.weight_scale_inv``)."""


def block_fp8_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` (a ``quantization_config`` with ``quant_method`` ``fp8``) checked: a block size, FP8 experts and
    dynamic activations, what ompmoe reads right; any other FP8 variant is refused here, before anything is read."""
    block = settings.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2):
        raise QuantizedCheckpointError(
            f"The checkpoint is quantized in FP8 without blocks (weight_block_size={block!r}); ompmoe reads "
            "block-FP8 checkpoints (a weight_block_size, as DeepSeek-V3, Kimi K2 and Qwen3's -FP8 releases store "
            "them). Prune the full-precision checkpoint, then quantize the pruned model.")
    if settings.get("expert_dtype", "fp8") != "fp8":
        raise QuantizedCheckpointError(
            f"The checkpoint's experts are stored as {settings.get('expert_dtype')!r} (quantization_config."
            "expert_dtype), not block FP8; ompmoe reads block-FP8 checkpoints whose experts are FP8 too. Prune the "
            "full-precision checkpoint instead.")
    if settings.get("activation_scheme", "dynamic") != "dynamic":
        raise QuantizedCheckpointError(
            f"The checkpoint's FP8 activations are statically scaled (activation_scheme="
            f"{settings.get('activation_scheme')!r}): their scales were calibrated for the unpruned model. ompmoe "
            "reads block-FP8 checkpoints with dynamic activations (DeepSeek-V3's format); prune the full-precision "
            "checkpoint instead.")
    return dict(settings)


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The float32 values of an FP8 ``weight`` (``[..., rows, cols]``) with one multiplier per ``block`` in
    ``scale_inv`` (``[..., ceil(rows / b0), ceil(cols / b1)]``; the last blocks may be partial, as DeepSeek's)."""
    rows, cols = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return weight.float() * scale


def quantize(values: torch.Tensor, block: tuple[int, int], scale_fmt: str | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(E4M3 weight, float32 multipliers)`` of ``values`` (``[..., rows, cols]``) per ``block`` (the last blocks may
    be partial, as DeepSeek's): each block divided by its largest magnitude over 448, computed as transformers'
    ``Fp8Quantize`` computes it (a block of zeros gets multiplier 1; ``scale_fmt="ue8m0"``: the multiplier rounded up
    to a power of two first), so :func:`dequantize` reads back the values within E4M3's rounding."""
    if scale_fmt not in SCALE_FORMATS:
        raise QuantizedCheckpointError(f"scale_fmt={scale_fmt!r}: ompmoe writes block-FP8 multipliers as float32 or "
                                       "ue8m0 (powers of two).")
    rows, cols = values.shape[-2:]
    lead = values.shape[:-2]
    tiles = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    padded = values.new_zeros((*lead, tiles[0] * block[0], tiles[1] * block[1]), dtype=torch.float32)
    padded[..., :rows, :cols] = values.to(torch.float32)
    reshaped = padded.reshape(*lead, tiles[0], block[0], tiles[1], block[1])
    max_abs = reshaped.abs().amax(dim=(-3, -1))
    scales = torch.where(max_abs > 0, E4M3_MAX / torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs)),
                         torch.ones_like(max_abs))
    inverse = (1.0 / scales).to(torch.float32)
    if scale_fmt == "ue8m0":
        inverse = torch.pow(2.0, torch.ceil(torch.log2(inverse.clamp(min=torch.finfo(torch.float32).tiny))))
        scales = 1.0 / inverse
    scaled = reshaped * scales.unsqueeze(-1).unsqueeze(-3)
    weight = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(padded.shape)[..., :rows, :cols]
    return weight.contiguous(), inverse


def round_to_grid(values: torch.Tensor, block: tuple[int, int], scale_fmt: str | None = None) -> torch.Tensor:
    """``values`` as a checkpoint that stores them :func:`quantize`-d is read back (:func:`dequantize`), in their
    dtype: what a run measures for weights it will write quantized."""
    return dequantize(*quantize(values, block, scale_fmt), block).to(values.dtype)


class DequantizedSlice(ComputedSlice):
    """A block-FP8 tensor of the files read as its dequantized float32 values (what transformers' loading reads
    from a safetensors slice: ``slice[...]``, its shape and dtype)."""

    def __init__(self, weight: Any, scale_inv: Any, block: tuple[int, int]) -> None:
        self.weight, self.scale_inv, self.block = weight, scale_inv, block

    def get_shape(self) -> list[int]:
        return list(self.weight.get_shape())

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, index: Any) -> torch.Tensor:
        return dequantize(self.weight[:], self.scale_inv[:], self.block)[index]


def pair_scales(headers: dict[str, str], shapes: dict[str, list[int]], settings: dict[str, Any] | None,
                source: str | os.PathLike) -> dict[str, str]:
    """``{FP8 weight: its scale tensor}`` over the files' tensors (``headers``: name -> safetensors dtype), every
    pairing checked: an FP8 tensor without a ``quantization_config`` (its values would be read unscaled), without
    its scales, or with a scale grid that does not cover it in ``weight_block_size`` blocks is refused by name."""
    fp8 = sorted(name for name, dtype in headers.items() if dtype.startswith("F8_") and not name.endswith(SCALE_SUFFIX))
    refuse_other_fp8(headers, fp8, source, "ompmoe reads block-FP8 checkpoints in E4M3 (DeepSeek-V3's format)")
    if fp8 and settings is None:
        raise QuantizedCheckpointError(
            f"{source} stores {len(fp8)} tensors in FP8 ({fp8[0]}, ...) but its config.json has no "
            "quantization_config saying how they are scaled; they would be read as wrong values. Add the "
            "quantization_config the checkpoint was released with.")
    if settings is not None and not fp8:
        raise QuantizedCheckpointError(
            f"{source}'s config.json says its weights are FP8 (quantization_config), but no tensor of its files is "
            "FP8; remove the quantization_config from config.json if the weights are full precision.")
    if not fp8:
        return {}
    block = block_size(settings)
    pairs, wrong = {}, []
    for name in fp8:
        scale = name + SCALE_SUFFIX
        if scale not in headers:
            wrong.append(f"{name} has no {scale}")
            continue
        expected = [*shapes[name][:-2], *(math.ceil(size / b) for size, b in zip(shapes[name][-2:], block))]
        if headers[scale] != SCALE_FILE_DTYPE:
            wrong.append(f"{scale} is {headers[scale]}, not float32 multipliers (F32)")
        elif list(shapes[scale]) != expected:
            wrong.append(f"{scale} {list(shapes[scale])} does not cover {name} {shapes[name]} in {list(block)} "
                         f"blocks (expected {expected})")
        pairs[name] = scale
    refuse_unscaled(source, wrong)
    return pairs


def block_size(settings: dict[str, Any]) -> tuple[int, int]:
    """``weight_block_size`` as ``(rows, cols)``."""
    rows, cols = settings["weight_block_size"]
    return int(rows), int(cols)


__all__ = ["SCALE_SUFFIX", "DequantizedSlice", "block_fp8_settings", "block_size", "dequantize", "pair_scales",
           "quantize", "round_to_grid"]
