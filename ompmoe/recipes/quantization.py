"""Weight-only quantization of a pruned MoE, routed experts included, and what it changes.

``torchao.quantization.quantize_(model, Int8WeightOnlyConfig())`` only touches ``nn.Linear``
modules (its default ``filter_fn``): in a transformers 5.x MoE those are the attention
projections, dense MLPs of dense layers, shared experts and the LM head. The routed experts are
one module per layer holding fused 3-D ``nn.Parameter`` tensors (``gate_up_proj``, ``down_proj``;
``(num_experts, out, in)``, or ``(num_experts, in, out)`` in GPT-OSS), and the routers are plain
modules with a 2-D weight, so neither is quantized, nor are the embeddings.
:func:`quantization_summary` counts exactly what is.

:func:`quantize_experts` quantizes those fused expert weights: symmetric weight-only int8 with one
scale per expert and row of the stored matrix (the row reduced over its last axis), or int4 in
groups of ``group_size`` along that axis, two values packed per byte. The codes and scales
replace the parameter (``torch.nn.utils.parametrize``); the dense weight is rebuilt on the fly
once per forward of the experts module (a forward pre-hook caches it for that call and a
forward hook drops it), so every experts implementation (``eager``, ``grouped_mm``,
``batched_mm``, GPT-OSS's) runs unchanged with at most one MoE layer's dense weights alive at a
time. It needs no torchao. (torchao's own ``Int8Tensor`` on these parameters, through
``FqnToConfig``, runs only with the ``eager`` experts implementation and not for GPT-OSS; see
``docs/recipes.md``.) Biases, routers and shared experts are left as they are.

Quantized models are for inference and evaluation: prune and fine-tune before quantizing.
:func:`check_not_quantized` is what :func:`ompmoe.prune` calls to refuse the other order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..engine.adapters import find_moe_layers
from ..engine.quantized import QUANTIZED_ATTR, QuantizedModelError, _is_quantized_tensor, _sparse_blocks


# ------------------------------------------------------------------------------------ kernels
def _quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.detach().float()
    scale = w.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.round(w / scale.clamp_min(torch.finfo(torch.float32).tiny)).clamp_(-127, 127).to(torch.int8)
    return q, scale.to(weight.dtype)


def _quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.detach().float()
    groups = w.reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    scale = groups.abs().amax(dim=-1, keepdim=True) / 7.0
    q = torch.round(groups / scale.clamp_min(torch.finfo(torch.float32).tiny)).clamp_(-8, 7)
    codes = (q.reshape(w.shape) + 8).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, scale.squeeze(-1).to(weight.dtype)


def _dequantize(qdata: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    if bits == 8:
        return qdata.to(scale.dtype) * scale
    low = (qdata & 0x0F).to(torch.int16) - 8
    high = (qdata >> 4).to(torch.int16) - 8
    codes = torch.stack((low, high), dim=-1).reshape(*qdata.shape[:-1], qdata.shape[-1] * 2)
    groups = codes.reshape(*codes.shape[:-1], -1, group_size).to(scale.dtype)
    return (groups * scale.unsqueeze(-1)).reshape(codes.shape)


class DequantizedExpertWeight(nn.Module):
    """Parametrization: int8 (or packed int4) codes and scales -> the dense 3-D expert weight."""

    def __init__(self, bits: int, group_size: int) -> None:
        super().__init__()
        self.bits = bits
        self.group_size = group_size
        self.cached: torch.Tensor | None = None

    def forward(self, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.cached is not None:
            return self.cached
        return _dequantize(qdata, scale, self.bits, self.group_size)

    def right_inverse(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.bits == 8:
            return _quantize_int8(weight)
        return _quantize_int4(weight, self.group_size)

    def extra_repr(self) -> str:
        return f"bits={self.bits}, group_size={self.group_size}"


def _cache_dense(module: nn.Module, args: Any) -> None:
    for name in getattr(module, QUANTIZED_ATTR):
        parametrization = module.parametrizations[name][0]
        parametrization.cached = None
        parametrization.cached = getattr(module, name)


def _drop_dense(module: nn.Module, args: Any, output: Any) -> None:
    for name in getattr(module, QUANTIZED_ATTR):
        module.parametrizations[name][0].cached = None


def quantize_experts(model: nn.Module, bits: int = 8, group_size: int = 32) -> list[str]:
    """Weight-only quantize the fused routed-expert weights of every MoE layer, in place.

    Args:
        model: A supported transformers 5.x MoE model (pruned or not), not quantized yet.
        bits: 8 (one scale per expert and row) or 4 (one scale per ``group_size`` values of a row,
            packed two per byte).
        group_size: Int4 group size along the last axis; rows whose length it does not divide
            use one group per row.

    Returns the names of the quantized parameters (``model.layers.1.mlp.experts.gate_up_proj``, ...).
    Biases (GPT-OSS), routers and shared experts are not touched; combine with torchao's
    ``quantize_`` for the ``nn.Linear`` modules.
    """
    if bits not in (4, 8):
        raise ValueError(f"quantize_experts supports bits=8 or bits=4; got {bits}.")
    layers = find_moe_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no fused routed-expert weights to quantize.")
    done = []
    for layer in layers:
        experts = layer.experts
        names = [name for name, p in experts.named_parameters(recurse=False) if p.dim() == 3]
        for name in names:
            weight = getattr(experts, name)
            if not weight.is_floating_point():
                raise QuantizedModelError(f"{layer.name}.experts.{name} is already quantized ({weight.dtype}).")
            width = weight.shape[-1]
            groups = group_size if bits == 4 and group_size > 0 and width % group_size == 0 else width
            if bits == 4 and groups % 2:
                raise ValueError(f"int4 packing needs an even group size; {layer.name}.experts.{name} rows have {width}.")
            weight.requires_grad_(False)
            parametrize.register_parametrization(experts, name, DequantizedExpertWeight(bits, groups), unsafe=True)
            done.append(f"{layer.name}.experts.{name}")
        setattr(experts, QUANTIZED_ATTR, {name: bits for name in names})
        experts.register_forward_pre_hook(_cache_dense)
        experts.register_forward_hook(_drop_dense, always_call=True)
    return done


# ------------------------------------------------------------------------------------ inspection
def _inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold a (possibly subclassed, e.g. torchao) tensor's data."""
    if type(tensor) in (torch.Tensor, nn.Parameter) or not hasattr(tensor, "__tensor_flatten__"):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    inner: list[torch.Tensor] = []
    for name in names:
        value = getattr(tensor, name)
        if isinstance(value, torch.Tensor):
            inner.extend(_inner_tensors(value))
    return inner


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's data, counting the inner tensors of quantized tensor subclasses."""
    return sum(t.numel() * t.element_size() for t in _inner_tensors(tensor))


def model_size_bytes(model: nn.Module) -> int:
    """Bytes of all parameters and buffers (shared tensors once), quantized ones at their real size."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        for inner in _inner_tensors(tensor):
            key = inner.untyped_storage().data_ptr() if inner.device.type != "meta" else id(inner)
            key = hash((key, inner.storage_offset(), inner.shape))
            if key in seen:
                continue
            seen.add(key)
            total += inner.numel() * inner.element_size()
    return total


@dataclass
class QuantizationSummary:
    """What is quantized in a model: counts per kind of weight, and its size."""

    linear: int
    """``nn.Linear`` modules."""
    linear_quantized: int
    expert_weights: int
    """Fused 3-D routed-expert weights (two or three per MoE layer)."""
    expert_weights_quantized: int
    routers: int
    routers_quantized: int
    embeddings_quantized: int
    size_bytes: int
    quantized_names: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return (
            f"nn.Linear {self.linear_quantized}/{self.linear}, routed-expert weights "
            f"{self.expert_weights_quantized}/{self.expert_weights}, routers {self.routers_quantized}/{self.routers}, "
            f"embeddings quantized {self.embeddings_quantized}, {self.size_bytes:,} bytes"
        )


def _module_quantized(module: nn.Module, name: str = "weight") -> bool:
    if parametrize.is_parametrized(module, name):
        return True
    tensor = getattr(module, name, None)
    return isinstance(tensor, torch.Tensor) and _is_quantized_tensor(tensor)


def quantization_summary(model: nn.Module) -> QuantizationSummary:
    """Count quantized ``nn.Linear`` weights, routed-expert weights, routers and embeddings."""
    names: list[str] = []
    linear = linear_q = 0
    embeddings_q = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            linear += 1
            if _module_quantized(module):
                linear_q += 1
                names.append(f"{name}.weight")
        elif isinstance(module, nn.Embedding) and _module_quantized(module):
            embeddings_q += 1
            names.append(f"{name}.weight")
    experts = experts_q = routers = routers_q = 0
    for block_name, _, router, expert_module in _sparse_blocks(model):
        routers += 1
        if _module_quantized(router):
            routers_q += 1
            names.append(f"{block_name}.router.weight")
        bits = getattr(expert_module, QUANTIZED_ATTR, {})
        for pname, tensor in expert_module.named_parameters(recurse=False):
            if tensor.dim() == 3:
                experts += 1
                if _is_quantized_tensor(tensor):
                    experts_q += 1
                    names.append(f"{block_name}.experts.{pname}")
        for pname in bits:
            experts += 1
            experts_q += 1
            names.append(f"{block_name}.experts.{pname}")
    return QuantizationSummary(
        linear=linear,
        linear_quantized=linear_q,
        expert_weights=experts,
        expert_weights_quantized=experts_q,
        routers=routers,
        routers_quantized=routers_q,
        embeddings_quantized=embeddings_q,
        size_bytes=model_size_bytes(model),
        quantized_names=names,
    )


