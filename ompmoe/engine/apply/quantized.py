"""Guards against pruning or saving quantized models: the engine refuses what it would handle wrongly.

Pruning slices fused expert weights along the expert axis, which is wrong for quantized tensors. The
checks live in the engine so that :mod:`ompmoe.engine.apply.pruning` does not depend on the quantization recipe.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..adapters import architecture_of, sparse_blocks


class QuantizedModelError(ValueError):
    """The model is already quantized, and pruning a quantized model is not supported."""


QUANTIZED_ATTR = "_ompmoe_quantized"
"""Attribute of an experts module quantized by :func:`quantize_experts`: ``{name: bits}``."""


def _is_tensor_subclass(tensor: torch.Tensor) -> bool:
    """A wrapper tensor subclass such as torchao's ``Int8Tensor`` (FSDP's DTensor: its local shard)."""
    if type(tensor) in (torch.Tensor, nn.Parameter):
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        DTensor = ()  # noqa: N806
    if isinstance(tensor, DTensor):
        return _is_tensor_subclass(tensor.to_local())
    return hasattr(tensor, "__tensor_flatten__")


def _is_quantized_tensor(tensor: torch.Tensor) -> bool:
    """A tensor subclass, or integer-typed storage where a floating-point weight belongs."""
    return _is_tensor_subclass(tensor) or not (tensor.is_floating_point() or tensor.is_complex())


def _describe(tensor: torch.Tensor) -> str:
    cls = type(tensor)
    if _is_tensor_subclass(tensor):
        return f"a {cls.__module__.split('.')[0]} {cls.__name__}"
    return f"stored as {tensor.dtype}"


def quant_method(config: Any) -> str | None:
    """The ``quant_method`` of ``config.quantization_config`` (a dict or a transformers config object), ``None``
    without one: what a model transformers loaded quantized says it is."""
    quantization = getattr(config, "quantization_config", None)
    if not quantization:
        return None
    method = (quantization.get("quant_method") if isinstance(quantization, dict)
              else getattr(quantization, "quant_method", None))
    return str(getattr(method, "value", method))


def find_quantized(model: nn.Module) -> str | None:
    """Why ``model`` counts as quantized for pruning, or ``None`` if it does not: ``config.quantization_config``
    (transformers integrations), :func:`quantize_experts`, or the routers' and routed experts' tensors (tensor
    subclasses such as torchao's, non-floating parameters)."""
    method = quant_method(getattr(model, "config", None))
    if method is not None:
        return f"config.quantization_config is set (quant_method={method!r})"
    for block_name, _, router, experts in sparse_blocks(model):
        router_attr = architecture_of(model).router_attr
        for owner, part in ((experts, "experts"), (router, router_attr)):
            for module_name, module in owner.named_modules():
                prefix = ".".join(filter(None, (block_name, part, module_name)))
                if getattr(module, QUANTIZED_ATTR, None):
                    name, bits = next(iter(getattr(module, QUANTIZED_ATTR).items()))
                    return f"{prefix}.{name} is quantized by ompmoe.quantize_experts (int{bits})"
                if parametrize.is_parametrized(module):
                    name = next(iter(module.parametrizations))
                    return f"{prefix}.{name} is parametrized ({type(module.parametrizations[name][0]).__name__})"
                for name, tensor in module.named_parameters(recurse=False):
                    if _is_quantized_tensor(tensor):
                        return f"{prefix}.{name} is {_describe(tensor)}"
                for name, tensor in module.named_buffers(recurse=False):
                    if tensor is not None and _is_tensor_subclass(tensor):
                        return f"{prefix}.{name} is {_describe(tensor)}"
    return None


def check_not_quantized(model: nn.Module) -> None:
    """Raise :class:`QuantizedModelError` if ``model`` is quantized (see :func:`find_quantized`)."""
    reason = find_quantized(model)
    if reason is not None:
        raise QuantizedModelError(
            f"ompmoe.prune refuses a quantized model: {reason}. Pruning after quantization is not "
            "supported: prune the full-precision model, save it with ompmoe.save_pruned, then "
            "quantize the pruned model (docs/recipes.md)."
        )


def check_savable(model: nn.Module) -> None:
    """Raise :class:`QuantizedModelError` if ``save_pretrained`` would not write ``model`` faithfully:
    :func:`quantize_experts` weights would be saved under parametrization names that ``from_pretrained`` ignores
    (silently re-initialised), and transformers cannot serialise torchao tensors without a
    ``config.quantization_config`` (with one, the integration saves the model)."""
    if getattr(getattr(model, "config", None), "quantization_config", None):
        return
    by_ompmoe = (
        f"{name}.{next(iter(getattr(module, QUANTIZED_ATTR)))} is quantized by ompmoe.quantize_experts"
        for name, module in model.named_modules() if getattr(module, QUANTIZED_ATTR, None)
    )
    subclasses = (
        f"{name} is {_describe(tensor)}" for name, tensor in model.named_parameters() if _is_tensor_subclass(tensor)
    )
    reason = next(chain(by_ompmoe, subclasses), None)
    if reason is not None:
        raise QuantizedModelError(
            f"ompmoe.save_pruned refuses a quantized model: {reason}. Save the full-precision (pruned, "
            "fine-tuned) model and quantize it after loading (docs/recipes.md)."
        )
