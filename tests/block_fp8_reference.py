"""Block-FP8 checkpoints made here, and their literal dequantization: what DeepSeek-V3's release stores (an
``F8_E4M3`` weight beside a float32 ``<name>_scale_inv``, one multiplier per 128 x 128 block, the last blocks
partial; scale = max |w| of the block / 448, as DeepSeek's ``act_quant``/``weight_quant`` kernels compute it) and
what its reference ``weight_dequant`` reads back (value x the block's multiplier, in float32)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from quantized_checkpoints import read_tensors, write_checkpoint

E4M3_MAX = 448.0
KEPT_FULL = ("embed", "lm_head", "norm", "router", ".gate.weight", "bias", "scale", "conv")
"""What the releases keep in full precision: embeddings, head, norms, routers, biases, convolutions."""


def quantized_in_release(name: str, tensor: torch.Tensor) -> bool:
    """A linear weight (2-D ``*.weight``) or a fused experts tensor (3-D), as DeepSeek-V3's and Qwen3's FP8 releases
    quantize them; what a model keeps in float32 (routers) stays."""
    shaped = (tensor.dim() == 2 and name.endswith(".weight")) or (tensor.dim() == 3 and ".experts." in name)
    return shaped and tensor.dtype == torch.bfloat16 and not any(part in name for part in KEPT_FULL)


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 values, float32 multipliers)`` of ``weight`` ``[..., rows, cols]``, block by block (partial last ones)."""
    rows, cols = weight.shape[-2:]
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    values = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    scales = torch.empty((*weight.shape[:-2], *grid), dtype=torch.float32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = weight[..., i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].float()
            scale = part.abs().amax(dim=(-2, -1)).clamp(min=1e-12) / E4M3_MAX
            scales[..., i, j] = scale
            values[..., i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (
                part / scale[..., None, None]).to(torch.float8_e4m3fn)
    return values, scales


def literal_dequantize(values: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Float32 ``values * multiplier``, one block at a time (DeepSeek's ``weight_dequant``)."""
    out = torch.empty(values.shape, dtype=torch.float32)
    for i in range(scales.shape[-2]):
        for j in range(scales.shape[-1]):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            out[..., rows, cols] = values[..., rows, cols].float() * scales[..., i, j, None, None]
    return out


def to_block_fp8(source: Path, target: Path, block: tuple[int, int]) -> Path:
    """``source`` (a full-precision checkpoint) as a block-FP8 release stores it, in one file."""
    tensors = {}
    for name, tensor in read_tensors(source).items():
        if quantized_in_release(name, tensor):
            tensors[name], tensors[name + "_scale_inv"] = quantize(tensor, block)
        else:
            tensors[name] = tensor
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(block)}
    return write_checkpoint(source, target, tensors, config)


def dequantized_checkpoint(source: Path, target: Path) -> Path:
    """The full-precision checkpoint a block-FP8 ``source`` stands for (each FP8 weight dequantized literally, in the
    dtype its config records), without its quantization_config."""
    config = json.loads((source / "config.json").read_text())
    block = tuple(config.pop("quantization_config")["weight_block_size"])
    dtype = getattr(torch, config.get("dtype") or config.get("torch_dtype") or "float32")
    stored = read_tensors(source)
    tensors = {name: (literal_dequantize(tensor, stored[name + "_scale_inv"], block).to(dtype)
                      if tensor.dtype == torch.float8_e4m3fn else tensor)
               for name, tensor in stored.items() if not name.endswith("_scale_inv")}
    return write_checkpoint(source, target, tensors, config)
