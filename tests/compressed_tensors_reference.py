"""compressed-tensors checkpoints for the tests, made and read with the compressed-tensors package itself (its
``pack_to_int32`` and its compressors' ``decompress``): the reference ompmoe's own reading is checked against."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationScheme

from quantized_checkpoints import read_tensors, write_checkpoint

INT4_EXPERTS = {  # Kimi K2 Thinking's: the routed experts in INT4, per group of 32; attention, shared experts, dense
    "config_groups": {"group_0": {  # MLPs and the head in bf16
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                    "type": "int"}}},
    "format": "pack-quantized", "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                           "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed"}
LINEAR_PLUS_ATTENTION = {  # an llm-compressor recipe: every linear in INT4 per group of 32, attention in INT8 per
    "config_groups": {  # channel (a pattern ranks above the class name); the head and routers bf16
        "group_0": INT4_EXPERTS["config_groups"]["group_0"],
        "group_1": {"input_activations": None, "output_activations": None, "targets": ["re:.*self_attn\\..*"],
                    "weights": {"dynamic": False, "num_bits": 8, "strategy": "channel", "symmetric": True,
                                "type": "int"}}},
    "format": "pack-quantized", "ignore": ["lm_head", "re:.*mlp\\.gate$"], "kv_cache_scheme": None,
    "quant_method": "compressed-tensors", "quantization_status": "compressed"}
FP8_DYNAMIC = {  # llm-compressor's FP8_DYNAMIC: every linear but the head and routers in FP8 per channel
    "config_groups": {"group_0": {
        "input_activations": {"dynamic": True, "num_bits": 8, "strategy": "token", "symmetric": True,
                              "type": "float"},
        "output_activations": None, "targets": ["Linear"],
        "weights": {"dynamic": False, "num_bits": 8, "observer": "minmax", "strategy": "channel", "symmetric": True,
                    "type": "float"}}},
    "format": "float-quantized", "ignore": ["lm_head", "re:.*mlp\\.gate$"], "kv_cache_scheme": None,
    "quant_method": "compressed-tensors", "quantization_status": "compressed"}
MIXED = {  # two schemes, each group naming its modules: the routed experts in INT4 per group of 32, attention in FP8
    "config_groups": {  # per channel (weights only); the rest bf16
        "attention": {"format": "float-quantized", "input_activations": None, "output_activations": None,
                      "targets": ["re:.*self_attn\\..*"],
                      "weights": {"dynamic": False, "num_bits": 8, "strategy": "channel", "symmetric": True,
                                  "type": "float"}},
        "experts": {**INT4_EXPERTS["config_groups"]["group_0"], "format": "pack-quantized",
                    "targets": ["re:.*mlp\\.experts\\..*"]}},
    "format": "mixed-precision", "ignore": ["lm_head", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*",
                                            "re:.*mlp\\.gate$"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed"}


NVFP4_EXPERTS = {  # llm-compressor's NVFP4A16 preset on the routed experts (FP4 per group of 16, FP8 group scales,
    "config_groups": {"group_0": {  # one float32 global scale per weight); the rest bf16
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"dynamic": False, "group_size": 16, "num_bits": 4, "observer": "minmax",
                    "scale_dtype": "torch.float8_e4m3fn", "strategy": "tensor_group", "symmetric": True,
                    "type": "float"}}},
    "format": "nvfp4-pack-quantized", "ignore": INT4_EXPERTS["ignore"], "kv_cache_scheme": None,
    "quant_method": "compressed-tensors", "quantization_status": "compressed"}


def scheme_for(name: str, tensor: torch.Tensor, settings: dict) -> tuple[dict, str] | None:
    """The scheme and format ``settings`` stores the weight ``name`` with, by a literal rule per setting (``None``:
    full precision): INT4_EXPERTS the routed experts, FP8_DYNAMIC every linear but the head and routers, MIXED the
    routed experts (INT4) and attention (FP8), LINEAR_PLUS_ATTENTION attention (INT8) and every other linear (INT4)."""
    linear = (name.endswith(".weight") and tensor.dim() == 2 and "embed_tokens" not in name
              and not name.startswith("lm_head") and not name.endswith("mlp.gate.weight"))
    groups = settings["config_groups"]
    if not linear:
        return None
    if settings == MIXED:
        group = "experts" if ".mlp.experts." in name else "attention" if ".self_attn." in name else None
        return (groups[group]["weights"], groups[group]["format"]) if group else None
    if settings in (INT4_EXPERTS, NVFP4_EXPERTS) and ".experts." not in name:
        return None
    if settings == LINEAR_PLUS_ATTENTION:
        group = "group_1" if ".self_attn." in name else "group_0"
        return groups[group]["weights"], settings["format"]
    return groups["group_0"]["weights"], settings["format"]


def quantized_names(tensors: dict[str, torch.Tensor], settings: dict) -> list[str]:
    """The weights ``settings`` quantizes (:func:`scheme_for`)."""
    return sorted(name for name, tensor in tensors.items() if scheme_for(name, tensor, settings) is not None)


def compress(weight: torch.Tensor, scheme: dict) -> dict[str, torch.Tensor]:
    """``weight`` (``[rows, cols]``) stored as ``scheme`` stores it (suffix -> tensor): INT per group or channel,
    packed with compressed-tensors' own ``pack_to_int32``; FP8 per channel. Scales are the absolute maximum over the
    quantized range, in bfloat16."""
    rows, cols = weight.shape
    values = weight.float()
    if scheme["type"] == "float" and scheme["num_bits"] == 4:
        return compress_nvfp4(weight, scheme)
    if scheme["type"] == "int":
        size, bits = scheme["group_size"] if scheme["strategy"] == "group" else cols, scheme["num_bits"]
        top = 2 ** (bits - 1) - 1
        groups = values.reshape(rows, cols // size, size)
        scale = (groups.abs().amax(-1) / top).clamp(min=1e-6).to(torch.bfloat16)
        integers = torch.round(groups / scale.float()[..., None]).clamp(-top - 1, top).to(torch.int8)
        return {"_packed": pack_to_int32(integers.reshape(rows, cols), bits), "_scale": scale,
                "_shape": torch.tensor([rows, cols])}
    scale = (values.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-6).to(torch.bfloat16)
    return {"": (values / scale.float()).to(torch.float8_e4m3fn), "_scale": scale}


def compress_nvfp4(weight: torch.Tensor, scheme: dict) -> dict[str, torch.Tensor]:
    """``weight`` stored in NVFP4 as llm-compressor stores it, by compressed-tensors' own functions: the weight's
    global scale (``generate_gparam`` of its range), each group's FP8 scale (``calculate_qparams`` with that global
    scale) and its ``NVFP4PackedCompressor``'s packing."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    args = QuantizationArgs(**{key: value for key, value in scheme.items() if key != "scale_dtype"},
                            scale_dtype=torch.float8_e4m3fn)
    rows, cols = weight.shape
    groups = weight.reshape(rows, cols // scheme["group_size"], scheme["group_size"])
    global_scale = generate_gparam(weight.amin(), weight.amax())
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=global_scale)
    state = {"weight": weight, "weight_scale": scale, "weight_global_scale": global_scale}
    stored = NVFP4PackedCompressor.compress(state, QuantizationScheme(targets=["Linear"], weights=args))
    return {name.removeprefix("weight"): tensor for name, tensor in stored.items()}


def compress_as_llm_compressor(weight: torch.Tensor, scheme: dict) -> dict[str, torch.Tensor]:
    """``weight`` (``[rows, cols]``, in its dtype) stored as llm-compressor stores it (suffix -> tensor): the min-max
    observer's range per group, row or tensor, compressed-tensors' own ``calculate_qparams`` and ``quantize``, and its
    ``pack_to_int32`` for integers."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = QuantizationArgs(**{key: value for key, value in scheme.items() if value is not None})
    rows, cols = weight.shape
    if scheme["strategy"] == "group":
        grouped = weight.reshape(rows, cols // scheme["group_size"], scheme["group_size"])
        low, high = grouped.amin(-1), grouped.amax(-1)
    elif scheme["strategy"] == "channel":
        low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
    else:
        low, high = weight.amin().reshape(1), weight.amax().reshape(1)
    scale, zero_point = calculate_qparams(low, high, args)
    if scheme["type"] == "int":
        integers = quantize(weight, scale, zero_point, args, dtype=torch.int8)
        return {"_packed": pack_to_int32(integers, scheme["num_bits"]), "_scale": scale,
                "_shape": torch.tensor([rows, cols])}
    return {"": quantize(weight, scale, zero_point, args, dtype=torch.float8_e4m3fn), "_scale": scale}


def decompress(parts: dict[str, torch.Tensor], scheme: dict, format: str) -> torch.Tensor:
    """compressed-tensors' own reading of one stored weight (``parts``: suffix -> tensor, as :func:`compress`)."""
    state = {"weight" + suffix: tensor for suffix, tensor in parts.items()}
    return BaseCompressor.get_value_from_registry(format).decompress(
        state, QuantizationScheme(targets=["Linear"], weights=scheme))["weight"]


def to_compressed(source: Path, target: Path, settings: dict) -> Path:
    """``source`` (a full-precision checkpoint) stored in compressed-tensors as ``settings`` says."""
    tensors, config = read_tensors(source), json.loads((source / "config.json").read_text())
    stored = dict(tensors)
    for name in quantized_names(tensors, settings):
        scheme, _ = scheme_for(name, tensors[name], settings)
        stored.update({name + suffix: part for suffix, part in compress(stored.pop(name), scheme).items()})
    return write_checkpoint(source, target, stored, {**config, "quantization_config": settings})


def dequantized_checkpoint(source: Path, target: Path, original: Path) -> Path:
    """The full-precision checkpoint a compressed-tensors ``source`` (made from ``original``) stands for: each weight
    read by compressed-tensors itself, in the checkpoint's dtype, without ``quantization_config``."""
    tensors, config = read_tensors(source), json.loads((source / "config.json").read_text())
    settings = config.pop("quantization_config")
    originals = read_tensors(original)
    for name in quantized_names(originals, settings):
        scheme, format = scheme_for(name, originals[name], settings)
        suffixes = (("_packed", "_scale", "_shape") if scheme["type"] == "int" else
                    ("_packed", "_scale", "_global_scale") if scheme["num_bits"] == 4 else ("", "_scale"))
        parts = {suffix: tensors.pop(name + suffix) for suffix in suffixes}
        tensors[name] = decompress(parts, scheme, format).to(torch.bfloat16)
    return write_checkpoint(source, target, tensors, config)
