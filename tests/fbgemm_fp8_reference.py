"""Row-wise FP8 checkpoints made here (``quant_method`` ``fbgemm_fp8``, Llama 4 Maverick's -FP8 release), and their
literal dequantization. The quantizer follows transformers' ``FbgemmFp8Quantize.convert`` step for step (its
transposes, reshapes and the layout of the scales it returns), with FBGEMM's ``quantize_fp8_per_row`` (a GPU kernel)
taken as each row divided by its largest magnitude over 448: a linear's rows; Llama 4's fused experts' output
channels."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from quantized_checkpoints import read_tensors, write_checkpoint

E4M3_MAX = 448.0
QUANTIZED = (".experts.gate_up_proj", ".experts.down_proj", "feed_forward.gate_proj.weight",
             "feed_forward.up_proj.weight", "feed_forward.down_proj.weight", "shared_expert.gate_proj.weight",
             "shared_expert.up_proj.weight", "shared_expert.down_proj.weight")
"""What the release quantizes: the routed and shared experts and the dense feed-forward layers (attention, routers,
embeddings, norms and the head stay bfloat16)."""


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 rows, float32 multiplier per row)``: each row over its largest magnitude / 448."""
    scale = rows.float().abs().amax(dim=-1).clamp(min=1e-12) / E4M3_MAX
    return (rows.float() / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def quantize(name: str, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 weight, its scale tensor)`` as transformers' ``FbgemmFp8Quantize.convert`` lays them out."""
    if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        transposed = value.transpose(1, 2)
        shape = transposed.shape
        flat, scale = quantize_rows(transposed.reshape(-1, shape[-1]))
        weight = flat.reshape(shape).transpose(1, 2).contiguous()
        if name.endswith("gate_up_proj"):
            return weight, scale.reshape(shape[0], 1, shape[1])
        return weight, scale.reshape(shape[0], shape[1], 1)
    weight, scale = quantize_rows(value)
    return weight, scale.view(scale.shape[0], 1)


def literal_dequantize(name: str, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 ``value x its output channel's multiplier``: a linear row by row, an experts tensor column by column
    (its last axis is the output), as the row-wise kernels multiply."""
    out = torch.empty(weight.shape, dtype=torch.float32)
    if weight.dim() == 2:
        for row in range(weight.shape[0]):
            out[row] = weight[row].float() * scale[row, 0]
        return out
    per_channel = scale.reshape(weight.shape[0], weight.shape[2])
    for expert in range(weight.shape[0]):
        for column in range(weight.shape[2]):
            out[expert, :, column] = weight[expert, :, column].float() * per_channel[expert, column]
    return out


def to_fbgemm_fp8(source: Path, target: Path) -> Path:
    """``source`` (a full-precision checkpoint) as the row-wise FP8 release stores it, in one file."""
    tensors = {}
    for name, tensor in read_tensors(source).items():
        if name.endswith(QUANTIZED):
            tensors[name], tensors[name + "_scale"] = quantize(name, tensor)
        else:
            tensors[name] = tensor
    config = json.loads((source / "config.json").read_text())
    layers = config["text_config"]["num_hidden_layers"]
    kept_full = [f"language_model.model.layers.{i}.{part}" for i in range(layers)
                 for part in ("self_attn", "feed_forward.router")]  # what stays bf16, as the release lists it
    config["quantization_config"] = {"activation_scale_ub": 1200.0, "quant_method": "fbgemm_fp8",
                                     "modules_to_not_convert": [*kept_full, "language_model.lm_head", "vision_model",
                                                                "multi_modal_projector"]}
    return write_checkpoint(source, target, tensors, config)


def dequantized_checkpoint(source: Path, target: Path) -> Path:
    """The full-precision checkpoint a row-wise FP8 ``source`` stands for (each FP8 weight dequantized literally, in
    the dtype its config records), without its quantization_config."""
    config = json.loads((source / "config.json").read_text())
    del config["quantization_config"]
    dtype = getattr(torch, config.get("dtype") or config.get("torch_dtype") or "float32")
    stored = read_tensors(source)
    tensors = {name: (literal_dequantize(name, tensor, stored[name + "_scale"]).to(dtype)
                      if tensor.dtype == torch.float8_e4m3fn else tensor)
               for name, tensor in stored.items() if not name.endswith("_scale")}
    return write_checkpoint(source, target, tensors, config)
