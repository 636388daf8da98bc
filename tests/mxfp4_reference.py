"""MXFP4 checkpoints made here, and their literal dequantization: what gpt-oss's release stores for each fused
experts weight ``<name>`` (``[experts, out, in]`` after the model's transpose): ``<name>_blocks``, ``uint8``
``[experts, out, in / 32, 16]``, two E2M1 codes per byte (the lower nibble first), and ``<name>_scales``, ``uint8``
``[experts, out, in / 32]``, one E8M0 exponent (biased by 127) per 32 values (the OCP Microscaling format); a value
is ``FP4[code] * 2 ** (scale - 127)``, one at a time."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from quantized_checkpoints import read_tensors, write_checkpoint

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
"""The 16 values of an E2M1 code (sign bit, 2 exponent bits, 1 mantissa bit)."""
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
"""gpt-oss's ``modules_to_not_convert``: only the experts are MXFP4."""


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, scales)`` of a model-layout experts tensor ``[experts, in, out]``: per 32 input values the shared
    exponent floor(log2(max |w|)) - 2 (E2M1's largest exponent), each value rounded to the nearest code."""
    rows = weight.float().transpose(1, 2)  # [experts, out, in]: the file's layout
    groups = rows.reshape(*rows.shape[:-1], -1, 32)
    largest = groups.abs().amax(dim=-1).clamp(min=2.0 ** -100)
    exponent = torch.floor(torch.log2(largest)) - 2
    scaled = groups / torch.pow(2.0, exponent)[..., None]
    grid = torch.tensor(E2M1)
    codes = (scaled[..., None] - grid).abs().argmin(dim=-1).to(torch.uint8)  # the nearest of the 16 values
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8).contiguous()


def literal_requantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, exponents)`` (``uint8``, one code per value and one biased exponent per 32) of ``rows`` (``[rows,
    in]``, the files' layout) as transformers' ``quantize_to_mxfp4`` writes them, one value at a time in Python
    floats: the values in bfloat16; per group, its largest magnitude over 6 in float32 rounded up to a power of two,
    at least the smallest normal float32 (none for a group of zeros); each value over it to the nearest E2M1
    magnitude, a tie to the larger; the sign bit kept, -0 included."""
    values = rows.to(torch.bfloat16).float()
    codes = torch.empty(values.shape, dtype=torch.uint8)
    exponents = torch.empty(values.shape[0], values.shape[1] // 32, dtype=torch.uint8)
    magnitudes = E2M1[:8]
    for r in range(values.shape[0]):
        for g in range(values.shape[1] // 32):
            group = [float(v) for v in values[r, 32 * g:32 * (g + 1)]]
            largest = float(torch.tensor(max(abs(v) for v in group)) / torch.tensor(6.0))  # float32 division
            if largest == 0:
                power, exponents[r, g] = 0.0, 0
            else:
                mantissa, exponent = math.frexp(largest)  # largest = mantissa * 2 ** exponent, mantissa in [0.5, 1)
                power = max(largest if mantissa == 0.5 else 2.0 ** exponent, 2.0 ** -126)
                exponents[r, g] = int(math.log2(power)) + 127
            for i, value in enumerate(group):
                scaled = value / power if power else 0.0 * value
                distances = [abs(abs(scaled) - m) for m in magnitudes]
                nearest = max(k for k, d in enumerate(distances) if d == min(distances))  # a tie: the larger
                codes[r, 32 * g + i] = nearest + (8 if math.copysign(1.0, scaled) < 0 else 0)
    return codes, exponents


def literal_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 model-layout tensor ``[experts, in, out]`` of ``blocks`` and ``scales``, one byte at a time."""
    experts, out_rows, groups, _ = blocks.shape
    values = torch.empty(experts, out_rows, groups * 32)
    for e in range(experts):
        for r in range(out_rows):
            for g in range(groups):
                multiplier = 2.0 ** (int(scales[e, r, g]) - 127)
                for b in range(16):
                    byte = int(blocks[e, r, g, b])
                    values[e, r, g * 32 + 2 * b] = E2M1[byte & 0x0F] * multiplier
                    values[e, r, g * 32 + 2 * b + 1] = E2M1[byte >> 4] * multiplier
    return values.transpose(1, 2).contiguous()


def to_mxfp4(source: Path, target: Path) -> Path:
    """``source`` (a full-precision gpt-oss checkpoint) as its release stores it: the experts' projections in MXFP4,
    everything else (biases, routers, attention) as it was."""
    tensors = {}
    for name, tensor in read_tensors(source).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name + "_blocks"], tensors[name + "_scales"] = quantize(tensor)
        else:
            tensors[name] = tensor
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"modules_to_not_convert": NOT_CONVERTED, "quant_method": "mxfp4"}
    return write_checkpoint(source, target, tensors, config)


def dequantized_checkpoint(source: Path, target: Path) -> Path:
    """The full-precision checkpoint an MXFP4 ``source`` stands for (each MXFP4 weight dequantized literally, in the
    dtype its config records), without its quantization_config."""
    config = json.loads((source / "config.json").read_text())
    del config["quantization_config"]
    dtype = getattr(torch, config.get("dtype") or config.get("torch_dtype") or "float32")
    stored = read_tensors(source)
    tensors = {name: tensor for name, tensor in stored.items() if not name.endswith(("_blocks", "_scales"))}
    for name in [name.removesuffix("_blocks") for name in stored if name.endswith("_blocks")]:
        tensors[name] = literal_dequantize(stored[name + "_blocks"], stored[name + "_scales"]).to(dtype)
    return write_checkpoint(source, target, tensors, config)
