"""Apply a plan to a model, save it, and load it back with per-layer expert counts.

Pruning slices every tensor indexed by expert (fused expert weights and biases, router rows,
router bias, score-correction bias) and updates every attribute that stores the count; the
native router code is untouched, so its score function, top-k, normalization and scaling
are exactly the original ones over the kept experts.

The saved ``config.json`` records the kept original ids per layer under ``ompmoe``. A uniform
plan also sets the config's expert count, so plain ``AutoModelForCausalLM.from_pretrained``
loads it; non-uniform plans need :func:`load_pruned`, which builds each layer at its own size
before transformers loads (and converts) the weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from .adapters import MoELayer, architecture_of, find_moe_layers
from .io import atomic_path
from .plan import PruningPlan
from .quantization import check_not_quantized, check_savable
from .statistics import FingerprintMismatchError, model_fingerprint

CONFIG_KEY = "ompmoe"
COUNT_ATTRIBUTES = ("num_experts", "n_routed_experts", "num_local_experts")


def _slice_layer(layer: MoELayer, index: torch.Tensor) -> None:
    """Keep experts ``index`` (ascending) in the router and experts of ``layer``."""
    old = layer.num_experts
    for module in (layer.router, layer.experts):
        for name, tensor in list(module.named_parameters(recurse=False)):
            if tensor.shape[0] == old:
                sliced = tensor.detach().index_select(0, index.to(tensor.device))
                setattr(module, name, nn.Parameter(sliced, requires_grad=tensor.requires_grad))
        for name, tensor in list(module.named_buffers(recurse=False)):
            if tensor is not None and tensor.dim() > 0 and tensor.shape[0] == old:
                module._buffers[name] = tensor.index_select(0, index.to(tensor.device))
        for attr in COUNT_ATTRIBUTES:
            if getattr(module, attr, None) == old:
                setattr(module, attr, int(index.numel()))
    layer.num_experts = int(index.numel())


def _record_counts(model: nn.Module, kept: dict[str, list[int]], original: dict[str, int]) -> None:
    """Write per-layer kept ids into the config and set the global count to what loading needs."""
    spec = architecture_of(model)
    counts = {len(ids) for ids in kept.values()}
    count = max(counts)
    setattr(model.config, spec.expert_count_key, count)
    if getattr(model, "num_experts", None) is not None:
        model.num_experts = count
    record = {"kept_experts": kept, "original_num_experts": original, "uniform": len(counts) == 1}
    if len(counts) > 1 and getattr(model.config, "output_router_logits", False):
        # transformers' load-balancing loss needs one expert count for all layers; a non-uniform
        # model would fail every forward. ompmoe's FinetuneModule uses a per-layer loss instead.
        model.config.output_router_logits = False
        record["router_aux_loss"] = True
    elif (pruning_info(model) or {}).get("router_aux_loss"):
        record["router_aux_loss"] = True
    setattr(model.config, CONFIG_KEY, record)


def pruning_info(model_or_config: Any) -> dict[str, Any] | None:
    """The ``ompmoe`` record of a pruned model or config, or ``None`` if it was never pruned."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, CONFIG_KEY, None)


def prune(model: nn.Module, plan: PruningPlan) -> nn.Module:
    """Remove the experts ``plan`` drops, in place, and return ``model``.

    A quantized model is refused before anything changes (:class:`ompmoe.quantization.QuantizedModelError`):
    prune first, then quantize.
    """
    check_not_quantized(model)
    layers = find_moe_layers(model)
    actual = model_fingerprint(model)
    if actual != plan.fingerprint:
        raise FingerprintMismatchError(
            f"This plan was made for a different model (fingerprint {plan.fingerprint}, "
            f"model_id={plan.model_id!r}); this model has fingerprint {actual}. Collect statistics "
            "and plan on this model, or load the model the plan was made for."
        )
    previous = pruning_info(model) or {}
    kept_original: dict[str, list[int]] = {}
    original_counts: dict[str, int] = dict(previous.get("original_num_experts", {}))
    for layer, layer_plan in zip(layers, plan.layers):
        kept = sorted(layer_plan.kept)
        earlier = previous.get("kept_experts", {}).get(layer.name, list(range(layer.num_experts)))
        original_counts.setdefault(layer.name, layer.num_experts)
        kept_original[layer.name] = [earlier[i] for i in kept]
        _slice_layer(layer, torch.tensor(kept, dtype=torch.long))
    _record_counts(model, kept_original, original_counts)
    return model


def save_pruned(
    model: nn.Module,
    path: str | os.PathLike,
    tokenizer: Any | None = None,
    overwrite: bool = False,
    **save_kwargs: Any,
) -> Path:
    """``save_pretrained`` into ``path`` atomically (with the tokenizer, if given).

    Models quantized after loading (:func:`ompmoe.quantize_experts`, torchao tensors) are refused:
    save the full-precision model and quantize after loading.
    """
    check_savable(model)
    with atomic_path(path, overwrite=overwrite, directory=True) as tmp:
        model.save_pretrained(tmp, **save_kwargs)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(path)


def _resize_to_record(model: nn.Module, record: dict[str, Any]) -> None:
    for layer in find_moe_layers(model):
        count = len(record["kept_experts"][layer.name])
        if layer.num_experts != count:
            _slice_layer(layer, torch.arange(count))


def _causal_lm_class(config: Any) -> type:
    for name in getattr(config, "architectures", None) or []:
        if hasattr(transformers, name):
            return getattr(transformers, name)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def load_pruned(path: str | os.PathLike, **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a model saved after :func:`prune`, whatever number of experts each layer kept.

    Keyword arguments go to ``from_pretrained`` (``dtype``, ``device_map``, ...). A model that
    was never pruned loads as usual. Adaptive inference saved with the model (OMP-MoE+,
    ``config.ompmoe_adaptive``) is switched back on.
    """
    config = transformers.AutoConfig.from_pretrained(path)
    base = _causal_lm_class(config)
    record = pruning_info(config)
    if record is None:
        return _with_adaptive(base.from_pretrained(path, config=config, **from_pretrained_kwargs))

    def __init__(self: nn.Module, config: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, config, *args, **kwargs)
        _resize_to_record(self, record)

    sized = type(base.__name__, (base,), {"__init__": __init__, "__module__": base.__module__})
    model = sized.from_pretrained(path, config=config, **from_pretrained_kwargs)
    model.__class__ = base
    return _with_adaptive(model)


def _with_adaptive(model: nn.Module) -> nn.Module:
    """Re-apply OMP-MoE+ adaptive inference saved in ``config.ompmoe_adaptive``, if any."""
    from .adaptive import restore_adaptive

    restore_adaptive(model)
    return model



