"""Weight-only quantization of a pruned MoE, routed experts included, and what it changes.

torchao's ``quantize_`` only touches ``nn.Linear``, so it misses the fused 3-D routed-expert weights of
transformers 5.x MoEs: :func:`quantization_summary` counts what is quantized, :func:`quantize_experts` quantizes
those weights itself (int8 per row, int4 in groups) under every experts implementation. Quantize last (pruning
refuses a quantized model): docs/recipes.md, "Quantization after pruning".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..engine.adapters import find_moe_layers, sparse_blocks
from ..engine.apply.quantized import QUANTIZED_ATTR, QuantizedModelError, _is_quantized_tensor


def _quantize(weight: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric codes (int8, or int4 packed two per byte) and scales: per row (int8) or per ``group_size`` (int4)."""
    w = weight.detach().float()
    size = group_size if bits == 4 else w.shape[-1]
    groups = w.reshape(*w.shape[:-1], w.shape[-1] // size, size)
    low, high = (-127, 127) if bits == 8 else (-8, 7)
    scale = groups.abs().amax(dim=-1, keepdim=True) / high
    q = torch.round(groups / scale.clamp_min(torch.finfo(torch.float32).tiny)).clamp_(low, high).reshape(w.shape)
    if bits == 8:
        codes = q.to(torch.int8)
    else:
        unsigned = (q + 8).to(torch.uint8)
        codes = unsigned[..., 0::2] | (unsigned[..., 1::2] << 4)
    return codes, scale.squeeze(-1).to(weight.dtype)


def _dequantize(qdata: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    if bits == 4:  # low nibble first
        qdata = torch.stack((qdata & 0x0F, qdata >> 4), dim=-1).flatten(-2).to(torch.int16) - 8
    size = group_size if bits == 4 else qdata.shape[-1]
    groups = qdata.reshape(*qdata.shape[:-1], -1, size).to(scale.dtype)
    return (groups * scale.unsqueeze(-1)).reshape(qdata.shape)


class DequantizedExpertWeight(nn.Module):
    """Parametrization: int8 (or packed int4) codes and scales -> the dense 3-D expert weight."""

    def __init__(self, bits: int, group_size: int) -> None:
        super().__init__()
        self.bits = bits
        self.group_size = group_size
        self.cached: torch.Tensor | None = None

    def forward(self, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.cached if self.cached is not None else _dequantize(qdata, scale, self.bits, self.group_size)

    def right_inverse(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _quantize(weight, self.bits, self.group_size)

    def extra_repr(self) -> str:
        return f"bits={self.bits}, group_size={self.group_size}"


def _cache_dense(module: nn.Module, args: Any) -> None:
    for name in getattr(module, QUANTIZED_ATTR):
        parametrization = module.parametrizations[name][0]
        parametrization.cached = None  # so that the read below dequantizes the current codes
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
        group_size: Int4 group size along the last axis (even); rows whose length it does not divide,
            and ``0``, use one group per row.

    Returns the names of the quantized parameters. Codes and scales replace each weight
    (``torch.nn.utils.parametrize``); the dense weight is rebuilt once per forward of its experts module,
    so at most one layer's dense weights are alive. Biases, routers and shared experts are not touched.
    """
    if bits not in (4, 8):
        raise ValueError(f"quantize_experts supports bits=8 or bits=4; got {bits}.")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 0:
        raise ValueError(f"group_size must be an int >= 0 (0: one group per row); got {group_size!r}.")
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
                raise ValueError(
                    f"int4 packing needs an even group size; {layer.name}.experts.{name} would use groups of "
                    f"{groups} (group_size={group_size}, rows of {width})."
                )
            weight.requires_grad_(False)
            parametrize.register_parametrization(experts, name, DequantizedExpertWeight(bits, groups), unsafe=True)
            done.append(f"{layer.name}.experts.{name}")
        setattr(experts, QUANTIZED_ATTR, {name: bits for name in names})
        experts.register_forward_pre_hook(_cache_dense)
        experts.register_forward_hook(_drop_dense, always_call=True)
    return done


def _inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold a (possibly subclassed, e.g. torchao) tensor's data."""
    if type(tensor) in (torch.Tensor, nn.Parameter) or not hasattr(tensor, "__tensor_flatten__"):
        return [tensor]
    values = [getattr(tensor, name) for name in tensor.__tensor_flatten__()[0]]
    return [inner for value in values if isinstance(value, torch.Tensor) for inner in _inner_tensors(value)]


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's data, counting the inner tensors of quantized tensor subclasses."""
    return sum(t.numel() * t.element_size() for t in _inner_tensors(tensor))


def model_size_bytes(model: nn.Module) -> int:
    """Bytes of all parameters and buffers (shared tensors once), quantized ones at their real size."""
    sizes: dict[tuple[int, int, torch.Size], int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        for inner in _inner_tensors(tensor):
            storage = inner.untyped_storage().data_ptr() if inner.device.type != "meta" else id(inner)
            sizes.setdefault((storage, inner.storage_offset(), inner.shape), inner.numel() * inner.element_size())
    return sum(sizes.values())


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
    modules_q = {name: module for name, module in model.named_modules()
                 if isinstance(module, (nn.Linear, nn.Embedding)) and _module_quantized(module)}
    names = [f"{name}.weight" for name in modules_q]
    linear = sum(isinstance(module, nn.Linear) for module in model.modules())
    linear_q = sum(isinstance(module, nn.Linear) for module in modules_q.values())  # the rest are embeddings
    experts = experts_q = routers = routers_q = 0
    for block_name, _, router, expert_module in sparse_blocks(model):
        routers += 1
        if _module_quantized(router):
            routers_q += 1
            names.append(f"{block_name}.router.weight")
        fused = [(name, tensor) for name, tensor in expert_module.named_parameters(recurse=False) if tensor.dim() == 3]
        by_ompmoe = list(getattr(expert_module, QUANTIZED_ATTR, {}))
        quantized = [name for name, tensor in fused if _is_quantized_tensor(tensor)] + by_ompmoe
        experts += len(fused) + len(by_ompmoe)
        experts_q += len(quantized)
        names += [f"{block_name}.experts.{name}" for name in quantized]
    return QuantizationSummary(
        linear=linear, linear_quantized=linear_q,
        expert_weights=experts, expert_weights_quantized=experts_q, routers=routers, routers_quantized=routers_q,
        embeddings_quantized=len(modules_q) - linear_q, size_bytes=model_size_bytes(model), quantized_names=names,
    )
