"""Checkpoints stored in block FP8 (DeepSeek-V3/R1, Kimi K2, MiniMax-M2, Qwen3's -FP8 releases: ``quant_method``
``fp8`` with ``weight_block_size``): each such weight is an ``F8_E4M3`` tensor beside a float32 ``<name>_scale_inv``
holding one multiplier per block. Layer-by-layer runs compute on the weights dequantized (``value * scale`` per
block, as DeepSeek's reference ``weight_dequant`` and transformers' ``Fp8Dequantize`` give them) and write the kept
experts' FP8 tensors and scales as the source stores them, so the pruned checkpoint is the source's format, byte for
byte in every tensor it keeps."""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

FP8_FILE_DTYPE = "F8_E4M3"
"""The safetensors dtype of block-FP8 weights (E4M3, the format of every such release); other 8-bit float dtypes
(E5M2, E8M0) are refused by name."""
SCALE_FILE_DTYPE = "F32"
"""The safetensors dtype of their scales (one float32 multiplier per block)."""
SCALE_SUFFIX = "_scale_inv"
"""A weight ``<name>``'s block multipliers are ``<name>_scale_inv`` (``x.weight`` -> ``x.weight_scale_inv``)."""


STORED_ATTR = "_ompmoe_block_fp8"
"""Attribute of a skeleton built from a block-FP8 checkpoint: its ``quantization_config`` (the files' format)."""
COMPENSATION_FP8 = ("{source} stores its weights in block FP8, which ompmoe writes as stored; a compensation changes "
                    "the kept experts' weights, which would have to be quantized again. Prune it with "
                    "compensation='off' (the paper's setting), or compensate its full-precision checkpoint.")
"""Why a compensation is refused for a block-FP8 source."""


class QuantizedCheckpointError(ValueError):
    """A checkpoint stored in a quantized format ompmoe does not read (or stored inconsistently)."""


def block_fp8_settings(config: Any) -> dict[str, Any] | None:
    """The ``quantization_config`` of a block-FP8 checkpoint's config (object or ``config.json`` dict); ``None`` for a
    checkpoint without one. Any other quantization is refused here, before anything is read."""
    settings = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config",
                                                                                          None)
    if not settings:
        return None
    if not isinstance(settings, dict):
        settings = settings.to_dict() if callable(getattr(settings, "to_dict", None)) else vars(settings)
    method, block = settings.get("quant_method"), settings.get("weight_block_size")
    if method != "fp8" or not (isinstance(block, (list, tuple)) and len(block) == 2):
        raise QuantizedCheckpointError(
            f"The checkpoint is quantized (quant_method={method!r}, weight_block_size={block!r}); ompmoe reads "
            "block-FP8 checkpoints (quant_method 'fp8' with a weight_block_size, as DeepSeek-V3, Kimi K2 and "
            "Qwen3's -FP8 releases store them) and full-precision ones. Prune the full-precision checkpoint, then "
            "quantize the pruned model.")
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


def checkpoint_block_fp8(path: str | os.PathLike) -> dict[str, Any] | None:
    """:func:`block_fp8_settings` of the checkpoint directory at ``path`` (``None`` without a ``config.json``)."""
    config = Path(path) / "config.json"
    return block_fp8_settings(json.loads(config.read_text(encoding="utf-8"))) if config.is_file() else None


def compute_config(config: Any) -> Any:
    """``config`` as the model that computes on the dequantized weights is built from: a copy without its
    ``quantization_config`` (the skeleton's modules are plain; the files' FP8 tensors are dequantized into them)."""
    if block_fp8_settings(config) is None:
        return config
    plain = copy.deepcopy(config)
    del plain.quantization_config
    return plain


def stored_block_fp8(model: Any) -> dict[str, Any] | None:
    """The ``quantization_config`` of the block-FP8 checkpoint ``model`` (a skeleton) was built from, else ``None``."""
    return getattr(model, STORED_ATTR, None)


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The float32 values of an FP8 ``weight`` (``[..., rows, cols]``) with one multiplier per ``block`` in
    ``scale_inv`` (``[..., ceil(rows / b0), ceil(cols / b1)]``; the last blocks may be partial, as DeepSeek's)."""
    rows, cols = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return weight.float() * scale


class DequantizedSlice:
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


class UnreadSlice:
    """A block-FP8 weight the pruned writer never reads into the model: a placeholder of its shape, all NaN (what is
    written is the stored tensor, :meth:`~ompmoe.engine.lazy_checkpoint.LazyCheckpoint.as_stored`, which refuses to
    write a placeholder it did not replace), so that the kept experts' bytes are read once, not also dequantized."""

    def __init__(self, shape: list[int]) -> None:
        self.shape = list(shape)

    def get_shape(self) -> list[int]:
        return self.shape

    def get_dtype(self) -> str:
        return "BF16"

    def __getitem__(self, index: Any) -> torch.Tensor:
        return torch.full(self.shape, float("nan"), dtype=torch.bfloat16)[index]


def pair_scales(headers: dict[str, str], shapes: dict[str, list[int]], settings: dict[str, Any] | None,
                source: str | os.PathLike) -> dict[str, str]:
    """``{FP8 weight: its scale tensor}`` over the files' tensors (``headers``: name -> safetensors dtype), every
    pairing checked: an FP8 tensor without a ``quantization_config`` (its values would be read unscaled), without
    its scales, or with a scale grid that does not cover it in ``weight_block_size`` blocks is refused by name."""
    fp8 = sorted(name for name, dtype in headers.items() if dtype.startswith("F8_") and not name.endswith(SCALE_SUFFIX))
    other = [f"{name} ({headers[name]})" for name in fp8 if headers[name] != FP8_FILE_DTYPE]
    if other:
        raise QuantizedCheckpointError(
            f"{source} stores {len(other)} weights in an 8-bit float other than E4M3 ({', '.join(other[:2])}"
            f"{', ...' if len(other) > 2 else ''}); ompmoe reads block-FP8 checkpoints in E4M3 (DeepSeek-V3's "
            "format). Prune the full-precision checkpoint instead.")
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
    if wrong:
        raise QuantizedCheckpointError(f"{source} stores FP8 weights ompmoe cannot scale: {'; '.join(wrong[:3])}"
                                       f"{'; ...' if len(wrong) > 3 else ''}. Its files are incomplete or in "
                                       "another FP8 layout.")
    return pairs


def block_size(settings: dict[str, Any]) -> tuple[int, int]:
    """``weight_block_size`` as ``(rows, cols)``."""
    rows, cols = settings["weight_block_size"]
    return int(rows), int(cols)


__all__ = ["COMPENSATION_FP8", "DequantizedSlice", "QuantizedCheckpointError", "UnreadSlice", "block_fp8_settings",
           "checkpoint_block_fp8", "compute_config", "dequantize", "pair_scales", "stored_block_fp8"]
