"""The quantized formats a checkpoint's files may store its weights in, and which ompmoe reads layer by layer: block
FP8 (:mod:`.block_fp8`: DeepSeek-V3/R1, Kimi K2, MiniMax-M2, Qwen3 -FP8), MXFP4 experts (:mod:`.mxfp4`:
gpt-oss), compressed-tensors (:mod:`.compressed_tensors_format`: Kimi K2 Thinking's INT4 experts, llm-compressor's
requants) and FBGEMM's row-wise FP8 (:mod:`.fbgemm_fp8`: Llama 4 Maverick's -FP8 release). A run computes on the weights dequantized and writes the kept experts' tensors as the files store them,
so the pruned checkpoint keeps its source's format; any other quantization is refused before anything is read. A
compensation changes the kept experts' down projections, which are quantized again in the checkpoint's format
(:func:`requantizes`, :func:`stored_again`): block FP8 as transformers' ``Fp8Quantize``, MXFP4 as transformers'
``quantize_to_mxfp4``, compressed-tensors integers and FP8 as llm-compressor's round to nearest; compressed-tensors'
NVFP4 and FBGEMM's row-wise FP8 are written as stored only, so a compensation of them is refused."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .block_fp8 import (SCALE_FORMATS, SCALE_SUFFIX, DequantizedSlice, block_fp8_settings, block_size, pair_scales,
                        quantize, round_to_grid)
from .compressed_tensors_format import PACKED as CT_PACKED
from .compressed_tensors_format import SCALE as CT_SCALE
from .compressed_tensors_format import SCALE_TORCH_DTYPES
from .compressed_tensors_format import SHAPE as CT_SHAPE
from .compressed_tensors_format import (CompressedSlice, compressed_tensors_settings, pack, pair_compressed,
                                        experts_fp4, scheme_of)
from .compressed_tensors_format import dequantize as compressed_dequantize
from .compressed_tensors_format import quantize as compressed_quantize
from .fbgemm_fp8 import SCALE_SUFFIX as ROWWISE_SCALE
from .fbgemm_fp8 import RowwiseSlice, fbgemm_fp8_settings, pair_channel_scales
from .mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX, Mxfp4Slice, mxfp4_settings, pair_blocks
from .mxfp4 import quantize as mxfp4_quantize
from .mxfp4 import round_to_grid as mxfp4_round_to_grid
from .quantized_files import ComputedSlice, QuantizedCheckpointError

FORMATS = {"fp8": ("block-FP8", "a", block_fp8_settings), "mxfp4": ("MXFP4", "an", mxfp4_settings),
           "compressed-tensors": ("compressed-tensors", "a", compressed_tensors_settings),
           "fbgemm_fp8": ("row-wise FP8 (fbgemm_fp8)", "a", fbgemm_fp8_settings)}
"""``quant_method`` -> (its name in messages, that name's article, the check of its settings)."""
STORED_ATTR = "_ompmoe_stored_quantization"
"""Attribute of a skeleton built from a quantized checkpoint: its ``quantization_config`` (the files' format)."""
COMPENSATION_STORED = ("{source} stores {format} weights, which ompmoe writes as stored; a compensation changes "
                       "the kept experts' weights, which would have to be quantized again (ompmoe quantizes again "
                       "block-FP8 weights whose scale_fmt is none, 'float' or 'ue8m0', MXFP4 and compressed-tensors "
                       "integer and FP8 ones). Prune it with compensation='off' (the paper's setting), or compensate "
                       "its full-precision checkpoint.")
"""Why a compensation is refused for a quantized source (``format``: :func:`format_name`) ompmoe does not
quantize again."""


def stored_settings(config: Any) -> dict[str, Any] | None:
    """The ``quantization_config`` of a quantized checkpoint's config (object or ``config.json`` dict), checked;
    ``None`` for a checkpoint without one. A format ompmoe does not read is refused here, before anything is read."""
    settings = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config",
                                                                                          None)
    if not settings:
        return None
    if not isinstance(settings, dict):
        settings = settings.to_dict() if callable(getattr(settings, "to_dict", None)) else vars(settings)
    method = settings.get("quant_method")
    method = str(getattr(method, "value", method))
    if method not in FORMATS:
        raise QuantizedCheckpointError(
            f"The checkpoint is quantized (quant_method={method!r}); ompmoe reads block-FP8 checkpoints (quant_method "
            "'fp8' with a weight_block_size: DeepSeek-V3, Kimi K2, Qwen3's -FP8 releases), MXFP4 experts "
            "(quant_method 'mxfp4': gpt-oss), compressed-tensors ones (quant_method 'compressed-tensors': "
            "pack-quantized integers, FP8), row-wise FP8 (quant_method 'fbgemm_fp8': Llama 4 Maverick's -FP8 "
            "release) and full-precision ones. Prune the full-precision checkpoint, then "
            "quantize the pruned model.")
    return FORMATS[method][2]({**settings, "quant_method": method})


def checkpoint_stored_settings(path: str | os.PathLike) -> dict[str, Any] | None:
    """:func:`stored_settings` of the checkpoint directory at ``path`` (``None`` without a ``config.json``)."""
    config = Path(path) / "config.json"
    return stored_settings(json.loads(config.read_text(encoding="utf-8"))) if config.is_file() else None


def format_name(settings: dict[str, Any]) -> str:
    """How messages and the model card name the format of ``settings`` (``"block-FP8"``, ``"MXFP4"``,
    ``"compressed-tensors NVFP4"``)."""
    if settings["quant_method"] == "compressed-tensors" and experts_fp4(settings):
        return "compressed-tensors NVFP4"
    return FORMATS[settings["quant_method"]][0]


def with_article(settings: dict[str, Any]) -> str:
    """:func:`format_name` with its indefinite article (``a block-FP8``, ``an MXFP4``)."""
    return f"{FORMATS[settings['quant_method']][1]} {format_name(settings)}"


def compute_config(config: Any) -> Any:
    """``config`` as the model that computes on the dequantized weights is built from: a copy without its
    ``quantization_config`` (the skeleton's modules are plain; the files' tensors are dequantized into them)."""
    if stored_settings(config) is None:
        return config
    plain = copy.deepcopy(config)
    del plain.quantization_config
    return plain


def stored_quantization(model: Any) -> dict[str, Any] | None:
    """The ``quantization_config`` of the quantized checkpoint ``model`` (a skeleton) was built from, else ``None``."""
    return getattr(model, STORED_ATTR, None)


def requantizes(settings: dict[str, Any] | None) -> bool:
    """Whether a compensation of a checkpoint stored as ``settings`` says (``None``: full precision) is written:
    full precision, block FP8 with a scale format :func:`~.block_fp8.quantize` writes, MXFP4 or compressed-tensors
    integers and FP8 (its compensated down projections quantized again, :func:`stored_again`); not compressed-tensors
    NVFP4 experts, which ompmoe writes as stored only."""
    if settings is None:
        return True
    method = settings["quant_method"]
    return (method == "mxfp4" or (method == "compressed-tensors" and not experts_fp4(settings))
            or (method == "fp8" and settings.get("scale_fmt") in SCALE_FORMATS))


def quantized_in_model_layout(settings: dict[str, Any]) -> bool:
    """Whether the format of ``settings`` reads its weights into the model's layout, transposed or not (MXFP4 reads
    gpt-oss's transposed experts), so that a compensated weight is quantized again from the model's layout whatever
    it is; the others store a weight as the model holds an untransposed one."""
    return settings["quant_method"] == "mxfp4"


def _check_requantizes(settings: dict[str, Any]) -> None:
    """Refuse quantizing a weight again in a format :func:`requantizes` says ompmoe does not write."""
    if not requantizes(settings):
        raise QuantizedCheckpointError(f"ompmoe does not quantize {with_article(settings)} weight again.")


def stored_again(weight: str, source: str, values: torch.Tensor, parts: dict[str, Any], settings: dict[str, Any]
                 ) -> dict[str, torch.Tensor]:
    """``{file tensor: tensor}`` storing ``values`` (the files' layout) as ``weight``, a weight the files store as
    ``source`` with ``parts`` (``{suffix: safetensors slice}``), quantized again as the checkpoint's format quantizes
    (block FP8: transformers' ``Fp8Quantize``; MXFP4: transformers' ``quantize_to_mxfp4``, the model's ``[experts,
    in, out]`` stored as ``[experts, out, in]``; compressed-tensors: llm-compressor's min-max round to nearest, in the
    stored scales' dtype and layout)."""
    _check_requantizes(settings)
    if settings["quant_method"] == "mxfp4":
        blocks, scales = mxfp4_quantize(values.transpose(-1, -2))
        return {weight + BLOCKS_SUFFIX: blocks, weight + SCALES_SUFFIX: scales}
    if settings["quant_method"] == "fp8":
        fp8, scale_inv = quantize(values, block_size(settings), settings.get("scale_fmt"))
        return {weight: fp8, weight + SCALE_SUFFIX: scale_inv}
    scheme = scheme_of(source[:-len(".weight")], settings)
    scale_part = parts[CT_SCALE]
    quantized, scale = compressed_quantize(values, scheme, SCALE_TORCH_DTYPES[scale_part.get_dtype()])
    scale = scale.reshape(scale_part.get_shape())
    if CT_PACKED not in parts:
        return {weight: quantized, weight + CT_SCALE: scale}
    shape = parts[CT_SHAPE][:]
    return {weight + CT_PACKED: pack(quantized, int(scheme["num_bits"])), weight + CT_SCALE: scale,
            weight + CT_SHAPE: torch.tensor(list(values.shape), dtype=shape.dtype)}


def regrid(source: str, parts: dict[str, Any], settings: dict[str, Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    """What values ``[rows, cols]`` (block FP8: ``[..., rows, cols]``) of a weight stored as ``source`` (with
    ``parts``) are read back as once :func:`stored_again` has written them: what a run measures for weights it
    writes quantized (MXFP4: values ``[in, out]`` in the model's layout)."""
    _check_requantizes(settings)
    if settings["quant_method"] == "mxfp4":
        return lambda values: mxfp4_round_to_grid(values.transpose(-1, -2)).transpose(-1, -2)
    if settings["quant_method"] == "fp8":
        block, scale_fmt = block_size(settings), settings.get("scale_fmt")
        return lambda values: round_to_grid(values, block, scale_fmt)
    scheme = scheme_of(source[:-len(".weight")], settings)
    scale_dtype = SCALE_TORCH_DTYPES[parts[CT_SCALE].get_dtype()]

    return lambda values: compressed_dequantize(*compressed_quantize(values, scheme, scale_dtype), scheme).to(
        values.dtype)


def pair_stored(headers: dict[str, str], shapes: dict[str, list[int]], settings: dict[str, Any] | None,
                source: str | os.PathLike) -> dict[str, dict[str, str]]:
    """``{weight: {suffix: file tensor}}``: each quantized weight of the files (``headers``: name -> safetensors
    dtype) and the tensors that store it, ``weight + suffix`` (block FP8: the weight itself and its scales; MXFP4:
    its blocks and scales; compressed-tensors: its packed values, scales and shape, or FP8 weight and scales), every
    pairing checked by its format (:func:`.block_fp8.pair_scales`, :func:`.mxfp4.pair_blocks`,
    :func:`.compressed_tensors_format.pair_compressed`)."""
    method = settings["quant_method"] if settings is not None else None
    if method == "fbgemm_fp8":  # its FP8 weights are scaled per output channel
        return {weight: {"": weight, ROWWISE_SCALE: scale}
                for weight, scale in pair_channel_scales(headers, shapes, settings, source).items()}
    compressed = pair_compressed(headers, shapes, settings if method == "compressed-tensors" else None, source)
    if method == "compressed-tensors":  # its FP8 weights are its own (scaled per row, tensor or block)
        return compressed
    fp8 = pair_scales(headers, shapes, settings if method == "fp8" else None, source)
    mxfp4 = pair_blocks(headers, shapes, settings if method == "mxfp4" else None, source)
    return {**{weight: {"": weight, SCALE_SUFFIX: scale} for weight, scale in fp8.items()},
            **{weight: {BLOCKS_SUFFIX: weight + BLOCKS_SUFFIX, SCALES_SUFFIX: weight + SCALES_SUFFIX}
               for weight in mxfp4}}


def dequantized_slice(weight: str, parts: dict[str, Any], settings: dict[str, Any]) -> ComputedSlice:
    """``weight``, whose stored tensors are ``parts`` (``{suffix: safetensors slice}``, :func:`pair_stored`'s), read
    as its dequantized values, in the model's layout."""
    if settings["quant_method"] == "compressed-tensors":
        return CompressedSlice(weight, parts, scheme_of(weight[:-len(".weight")], settings))
    if settings["quant_method"] == "fp8":
        return DequantizedSlice(parts[""], parts[SCALE_SUFFIX], block_size(settings))
    if settings["quant_method"] == "fbgemm_fp8":
        return RowwiseSlice(parts[""], parts[ROWWISE_SCALE])
    return Mxfp4Slice(parts[BLOCKS_SUFFIX], parts[SCALES_SUFFIX])


__all__ = ["COMPENSATION_STORED", "QuantizedCheckpointError", "checkpoint_stored_settings", "compute_config",
           "dequantized_slice", "format_name", "pair_stored", "quantized_in_model_layout", "regrid", "requantizes",
           "stored_again", "stored_quantization", "stored_settings", "with_article"]
