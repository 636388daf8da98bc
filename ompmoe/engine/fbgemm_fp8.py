"""Checkpoints stored in FBGEMM's row-wise FP8 (``quant_method`` ``fbgemm_fp8``: Llama 4 Maverick's -FP8 release).
Each such weight is an ``F8_E4M3`` tensor beside a float32 ``<name>_scale`` holding one multiplier per output
channel, as transformers' ``FbgemmFp8Linear`` and ``FbgemmFp8Llama4TextExperts`` store them:

- a linear's ``weight`` ``[out, in]`` with ``weight_scale`` ``[out, 1]``;
- Llama 4's fused experts (``[experts, in, out]``): ``gate_up_proj`` with ``gate_up_proj_scale`` ``[experts, 1, out]``
  and ``down_proj`` with ``down_proj_scale`` ``[experts, out, 1]``.

Layer-by-layer runs compute on the weights dequantized (each value times its output channel's multiplier, what the
row-wise kernels multiply by) and write the kept experts' FP8 tensors and scales as the files store them. The format
is quantized by FBGEMM's GPU kernel, which ompmoe does not reproduce here, so a compensation of such a checkpoint is
refused (its weights are written as stored only)."""

from __future__ import annotations

import os
from typing import Any

import torch

from .quantized_files import ComputedSlice, QuantizedCheckpointError, refuse_other_fp8, refuse_unscaled

SCALE_FILE_DTYPE = "F32"
"""The safetensors dtype of their multipliers."""
SCALE_SUFFIX = "_scale"
"""A weight ``<name>``'s multipliers are ``<name>_scale`` (``x.weight`` -> ``x.weight_scale``)."""


def fbgemm_fp8_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` (a ``quantization_config`` with ``quant_method`` ``fbgemm_fp8``) checked: its
    ``activation_scale_ub`` bounds the activations' dynamic scales at inference, which ompmoe does not quantize, so
    nothing is read wrong and nothing is refused."""
    return dict(settings)


def channel_scales(weight_shape: list[int], scale_shape: list[int]) -> list[int] | None:
    """The shape ``weight``'s multipliers broadcast as over it (one per output channel: a linear's rows, a fused
    experts tensor's last axis), or ``None`` where ``scale_shape`` is not one per output channel."""
    if len(weight_shape) == 2 and list(scale_shape) == [weight_shape[0], 1]:
        return [weight_shape[0], 1]
    if len(weight_shape) == 3 and list(scale_shape) in ([weight_shape[0], 1, weight_shape[2]],
                                                        [weight_shape[0], weight_shape[2], 1]):
        return [weight_shape[0], 1, weight_shape[2]]
    return None


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values of an FP8 ``weight``: each value times its output channel's multiplier in ``scale``."""
    shape = channel_scales(list(weight.shape), list(scale.shape))
    if shape is None:
        raise QuantizedCheckpointError(f"Multipliers {list(scale.shape)} are not one per output channel of an FP8 "
                                       f"weight {list(weight.shape)}.")
    return weight.float() * scale.float().reshape(shape)


ONE_COUNT = ("{source} stores row-wise FP8 (fbgemm_fp8) weights, which transformers builds at the config's expert "
             "count in every layer (FbgemmFp8Llama4TextExperts), so a plan with per-layer counts would be written "
             "unloadable. Plan with allocation uniform (ompmoe fit --allocation uniform, ompmoe prune --allocation "
             "uniform).")
"""Why a plan with per-layer counts is refused for a row-wise FP8 source (``source``: its path)."""
GPU_ONLY = ("{path} stores row-wise FP8 (fbgemm_fp8) weights, which transformers loads only on a GPU with fbgemm_gpu. "
            "ompmoe prunes such a checkpoint layer by layer (ompmoe fit --layer_by_layer true, ompmoe prune --model), "
            "which reads its weights dequantized on any machine.")
"""Why loading a row-wise FP8 checkpoint whole is refused where transformers cannot load it."""


def check_uniform(counts: list[int], source: Any) -> None:
    """Refuse per-layer expert ``counts`` for the row-wise FP8 checkpoint ``source`` (:data:`ONE_COUNT`)."""
    if len(set(counts)) > 1:
        raise QuantizedCheckpointError(ONE_COUNT.format(source=source))


def loadable_here() -> bool:
    """Whether transformers can load row-wise FP8 weights in this process (a GPU and fbgemm_gpu)."""
    import importlib.util

    return torch.cuda.is_available() and importlib.util.find_spec("fbgemm_gpu") is not None


class RowwiseSlice(ComputedSlice):
    """A row-wise FP8 tensor of the files read as its dequantized float32 values (what transformers' loading reads
    from a safetensors slice: ``slice[...]``, its shape and dtype)."""

    def __init__(self, weight: Any, scale: Any) -> None:
        self.weight, self.scale = weight, scale

    def get_shape(self) -> list[int]:
        return list(self.weight.get_shape())

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, index: Any) -> torch.Tensor:
        weight, scale = self.weight[:], self.scale[:]
        if weight.dim() < 3:
            return dequantize(weight, scale)[index]
        out = torch.empty(weight.shape, dtype=torch.float32)  # one expert at a time: one float32 copy, not two
        for expert in range(weight.shape[0]):
            out[expert] = dequantize(weight[expert:expert + 1], scale[expert:expert + 1])[0]
        return out[index]


def pair_channel_scales(headers: dict[str, str], shapes: dict[str, list[int]], settings: dict[str, Any],
                        source: str | os.PathLike) -> dict[str, str]:
    """``{FP8 weight: its multipliers}`` over the files' tensors (``headers``: name -> safetensors dtype), every pairing
    checked: an 8-bit float other than E4M3, a weight without its multipliers, or multipliers that are not float32
    or not one per output channel are refused by name; so is a ``quantization_config`` over files without FP8."""
    fp8 = sorted(name for name, dtype in headers.items() if dtype.startswith("F8_"))
    refuse_other_fp8(headers, fp8, source, "FBGEMM's row-wise FP8 is E4M3")
    if not fp8:
        raise QuantizedCheckpointError(
            f"{source}'s config.json says its weights are FP8 (quantization_config, quant_method 'fbgemm_fp8'), but "
            "no tensor of its files is FP8; remove the quantization_config from config.json if the weights are full "
            "precision.")
    pairs, wrong = {}, []
    for name in sorted(headers):  # multipliers beside a weight that is not FP8 would be left unread
        base = name.removesuffix(SCALE_SUFFIX)
        if base != name and base in headers and not headers[base].startswith("F8_"):
            wrong.append(f"{name} scales {base}, which is {headers[base]}, not FP8")
    for name in fp8:
        scale = name + SCALE_SUFFIX
        if scale not in headers:
            wrong.append(f"{name} has no {scale}")
        elif headers[scale] != SCALE_FILE_DTYPE:
            wrong.append(f"{scale} is {headers[scale]}, not float32 multipliers (F32)")
        elif channel_scales(shapes[name], shapes[scale]) is None:
            wrong.append(f"{scale} {list(shapes[scale])} is not one multiplier per output channel of {name} "
                         f"{list(shapes[name])}")
        else:
            pairs[name] = scale
    refuse_unscaled(source, wrong)
    return pairs


__all__ = ["GPU_ONLY", "ONE_COUNT", "SCALE_SUFFIX", "RowwiseSlice", "channel_scales", "check_uniform", "dequantize",
           "fbgemm_fp8_settings", "loadable_here", "pair_channel_scales"]
