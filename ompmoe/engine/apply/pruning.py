"""Apply a plan to a model, save it, and load it back with per-layer expert counts. Only tensors and counts indexed
by expert change: the native router code routes exactly as before over the kept experts."""

from __future__ import annotations

import copy
import numbers
import warnings
from typing import Any

import torch
from torch import nn

from ..adapters import (EXTRA_CLASS_KEYS, MoELayer, architecture_of, block_expert_tensors, find_moe_layers,
                        hash_routed_blocks, router_extra_rows)
from ..collect.statistics import FingerprintMismatchError, model_fingerprint
from ..model_classes import text_config
from ..names import loaded_name, same_model
from ..planning.allocation import minimum_kept
from ..planning.plan import PlanMismatchError, PruningPlan
from ..record import CONFIG_KEY, EARLIER_KEY, FINETUNE_CONFIG_KEY, FINETUNE_KEY, earlier_pruning, pruning_info
from .quantized import check_not_quantized


def slice_module(module: nn.Module, index: torch.Tensor, old: int, count_attributes: tuple[str, ...],
                 extra: int = 0) -> dict[str, Any]:
    """Keep experts ``index`` (ascending) in ``module``'s own tensors indexed by expert (on their first axis, or on
    the second of a ``(1, experts)`` row such as ERNIE's correction bias) and set its counts; a router's ``extra``
    rows past the experts (Inkling's shared experts, Zaya's skip class) are kept. Returns what was replaced
    (``parameters``, ``buffers``, ``attributes``), so :func:`restore_module` can put it back."""
    saved: dict[str, Any] = {"parameters": {}, "buffers": {}, "attributes": {}}
    trailing = torch.arange(old, old + extra, device=index.device, dtype=index.dtype)
    for name, tensor in list(module.named_parameters(recurse=False)):
        if (axis := _expert_axis(tensor, old, extra)) is not None:
            saved["parameters"][name] = tensor
            sliced = tensor.detach().index_select(axis, _rows(tensor, axis, old, index, trailing))
            setattr(module, name, nn.Parameter(sliced, requires_grad=tensor.requires_grad))
    for name, tensor in list(module.named_buffers(recurse=False)):
        if tensor is not None and (axis := _expert_axis(tensor, old, extra)) is not None:
            saved["buffers"][name] = tensor
            module._buffers[name] = tensor.index_select(axis, _rows(tensor, axis, old, index, trailing))
    for attr in count_attributes:
        if getattr(module, attr, None) == old:
            saved["attributes"][attr] = old
            setattr(module, attr, int(index.numel()))
    for attr in EXTRA_CLASS_KEYS if extra else ():
        if getattr(module, attr, None) == old + extra:
            saved["attributes"][attr] = old + extra
            setattr(module, attr, int(index.numel()) + extra)
    return saved


def _rows(tensor: torch.Tensor, axis: int, old: int, index: torch.Tensor, trailing: torch.Tensor) -> torch.Tensor:
    """The rows to keep: the kept experts, then (on a tensor with rows past the experts) those rows."""
    rows = index if tensor.shape[axis] == old else torch.cat([index, trailing])
    return rows.to(tensor.device)


def _expert_axis(tensor: torch.Tensor, old: int, extra: int = 0) -> int | None:
    if tensor.dim() > 0 and tensor.shape[0] in {old, old + extra}:
        return 0
    return 1 if tensor.dim() == 2 and tensor.shape[0] == 1 and tensor.shape[1] == old else None


def restore_module(module: nn.Module, saved: dict[str, Any]) -> None:
    """Undo :func:`slice_module`."""
    module._buffers.update(saved["buffers"])
    for name, value in {**saved["parameters"], **saved["attributes"]}.items():
        setattr(module, name, value)


def slice_router(router: nn.Module, index: torch.Tensor, old: int, count_attributes: tuple[str, ...]
                 ) -> list[tuple[nn.Module, dict[str, Any]]]:
    """:func:`slice_module` on the router and every module inside it (a router's projection may be a child
    ``nn.Linear``, HunYuan's ``gate.wg``); ``(module, saved)`` pairs for :func:`restore_module`."""
    extra = router_extra_rows(router, old)
    return [(module, slice_module(module, index, old, count_attributes, extra)) for module in router.modules()]


def slice_routing(layer: MoELayer, index: torch.Tensor, count_attributes: tuple[str, ...]
                  ) -> list[tuple[nn.Module, dict[str, Any]]]:
    """:func:`slice_router`, plus the block's own tensors indexed by expert (a routing bias the block passes into the
    router, MiniMax-M2's); ``(module, saved)`` pairs for :func:`restore_module`."""
    saved = slice_router(layer.router, index, layer.num_experts, count_attributes)
    if block_expert_tensors(layer.block, layer.num_experts):
        saved.append((layer.block, slice_module(layer.block, index, layer.num_experts, ())))
    return saved


def _slice_layer(layer: MoELayer, index: torch.Tensor, count_attributes: tuple[str, ...]) -> None:
    """Keep experts ``index`` (ascending) in the router, the block's routing tensors and the experts of ``layer``
    (with their rows past the routed experts: LongCat-Flash's identity experts)."""
    slice_routing(layer, index, count_attributes)
    slice_module(layer.experts, index, layer.num_experts, count_attributes,
                 router_extra_rows(layer.experts, layer.num_experts))
    layer.num_experts = int(index.numel())


def _check_ids(where: str, ids: Any, num_experts: int, fix: str) -> list[int]:
    """``ids`` as a list of ints after checking each is an int in ``[0, num_experts)`` and unique."""
    if not isinstance(ids, (list, tuple)):
        raise PlanMismatchError(f"{where}: kept experts must be a list of ids, got {type(ids).__name__}. {fix}")
    if not ids:
        raise PlanMismatchError(f"{where}: keeps no expert (empty list); every MoE layer needs experts. {fix}")
    seen: set[int] = set()
    for value in ids:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise PlanMismatchError(f"{where}: expert id {value!r} is a {type(value).__name__}, not an int. {fix}")
        if not 0 <= int(value) < num_experts:
            raise PlanMismatchError(f"{where}: expert id {int(value)} is out of range for {num_experts} experts "
                                    f"(valid ids 0..{num_experts - 1}). {fix}")
        if int(value) in seen:
            raise PlanMismatchError(f"{where}: expert id {int(value)} is listed twice. {fix}")
        seen.add(int(value))
    return [int(value) for value in ids]


def validate_plan(model: nn.Module, plan: PruningPlan, layers: list[MoELayer] | None = None) -> None:
    """Check every layer of ``plan`` against ``model`` before anything is sliced (prune is all-or-nothing): layer
    names, order and expert counts, and kept ids (ints, in range, unique, enough for the router, group-balanced)."""
    layers = find_moe_layers(model) if layers is None else layers
    fix = "Make the plan with ompmoe.plan_pruning on statistics of this model."
    if len(plan.layers) != len(layers):
        raise PlanMismatchError(f"The plan has {len(plan.layers)} MoE layers but this model has {len(layers)} "
                                f"({layers[0].name} .. {layers[-1].name}). {fix}")
    for position, (layer, layer_plan) in enumerate(zip(layers, plan.layers)):
        if layer_plan.name != layer.name:
            raise PlanMismatchError(f"MoE layer {position} of the plan is {layer_plan.name!r} but this model's is "
                                    f"{layer.name!r} (plans apply by name, in model order). {fix}")
        where = f"Plan layer {layer.name}"
        if layer_plan.num_experts != layer.num_experts:
            raise PlanMismatchError(f"{where} was made for {layer_plan.num_experts} experts but the model's layer "
                                    f"has {layer.num_experts}. {fix}")
        kept = _check_ids(where, layer_plan.kept, layer.num_experts, fix)
        floor = minimum_kept(**layer.routing)
        if len(kept) < floor:
            raise PlanMismatchError(f"{where}: keeps {len(kept)} experts but its router (top_k={layer.top_k}, "
                                    f"{layer.num_groups} groups) needs at least {floor}. {fix}")
        size = layer.num_experts // layer.num_groups
        per_group = [sum(1 for e in kept if e // size == g) for g in range(layer.num_groups)]
        if len(set(per_group)) != 1:
            raise PlanMismatchError(f"{where}: keeps {per_group} experts in its {layer.num_groups} groups; a "
                                    f"group-limited router needs the same count in every group. {fix}")
    _check_record(pruning_info(model), layers)


def _check_record(record: Any, layers: list[MoELayer], saved: bool = False) -> None:
    """A pruning record must match the model's MoE layers: same names, ids unique and in range of the original counts,
    as many as the layer has (``saved``: at most, as config.json builds every layer at the largest count)."""
    if record is None:
        return
    if saved:
        where, built = "config.json's ompmoe record", "the model built from config.json has"
        fix = "The saved pruning record is corrupt: prune and save the original model again."
    else:
        where, built = "this model's config.ompmoe", "this model has"
        fix = "The pruning record is corrupt: prune the original model again."
    record = record if isinstance(record, dict) else {}
    kept, original = record.get("kept_experts"), record.get("original_num_experts")
    if not isinstance(kept, dict) or not isinstance(original, dict):
        raise PlanMismatchError(f"{where} needs 'kept_experts' and 'original_num_experts' mappings. {fix}")
    names = [layer.name for layer in layers]
    # A JSON object is unordered (config.json is written with sorted keys: layers.10 before layers.2): names count.
    if sorted(kept) != sorted(names) or sorted(original) != sorted(names):
        raise PlanMismatchError(f"{where} lists layers {list(kept)} but {built} MoE layers {names}. {fix}")
    for layer in layers:
        count = original[layer.name]
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise PlanMismatchError(f"{where}: original_num_experts of {layer.name} is {count!r}. {fix}")
        ids = _check_ids(f"{where}, layer {layer.name}", kept[layer.name], count, fix)
        if len(ids) > layer.num_experts or (not saved and len(ids) != layer.num_experts):
            raise PlanMismatchError(f"{where}, layer {layer.name}: keeps {len(ids)} experts but the layer has "
                                    f"{layer.num_experts}. {fix}")


def require_plan_model(model: nn.Module, plan: PruningPlan, fix: str) -> None:
    """Refuse ``model`` unless ``plan`` was made for it (same fingerprint); ``fix`` says what to do instead."""
    actual = model_fingerprint(model)
    if actual != plan.fingerprint:
        raise FingerprintMismatchError(
            f"This plan was made for a different model (fingerprint {plan.fingerprint}, "
            f"model_id={plan.model_id!r}); this model has fingerprint {actual}. {fix}")


def own_config(model: nn.Module) -> None:
    """Give ``model`` a copy of its config (and of its sub-configs: a container's text config, per-layer configs) in
    every module that holds it, before pruning changes the counts and the record: transformers models built from one
    config object share it, so a sweep building each model from the same config would build the next one pruned."""
    copies: dict[int, Any] = {}  # deepcopy's memo: every object of the config's graph -> its copy
    copy.deepcopy(model.config, copies)
    for module in model.modules():
        held = module.__dict__.get("config")
        if held is not None and id(held) in copies:
            module.config = copies[id(held)]


def prune(model: nn.Module, plan: PruningPlan) -> nn.Module:
    """Remove the experts ``plan`` drops, in place, and return ``model``; a plan that does not fit
    (:class:`PlanMismatchError`) or a quantized model (prune first, then quantize) leaves the model untouched."""
    check_not_quantized(model)
    layers = find_moe_layers(model)
    require_plan_model(model, plan, "Collect statistics and plan on this model, or load the model the plan was "
                                    "made for.")
    validate_plan(model, plan, layers)
    spec = architecture_of(model)
    own_config(model)
    previous = pruning_info(model) or {}
    kept_original: dict[str, list[int]] = {}
    original_counts: dict[str, int] = dict(previous.get("original_num_experts", {}))
    for layer, layer_plan in zip(layers, plan.layers):
        kept = sorted(int(i) for i in layer_plan.kept)
        earlier = previous.get("kept_experts", {}).get(layer.name, list(range(layer.num_experts)))
        original_counts.setdefault(layer.name, layer.num_experts)
        kept_original[layer.name] = [earlier[i] for i in kept]
        _slice_layer(layer, torch.tensor(kept, dtype=torch.long), spec.count_attributes)
    # Blocks routed by token id keep every expert, so the stored count must still build them (then per-layer counts).
    counts = {len(ids) for ids in kept_original.values()} | set(hash_routed_blocks(model).values())
    # Loading builds every layer at the largest count (a multimodal container's count is its text config's).
    setattr(text_config(model.config), spec.expert_count_key, max(counts))
    if getattr(model, "num_experts", None) is not None:
        model.num_experts = max(counts)
    record = {"kept_experts": kept_original, "original_num_experts": original_counts, "uniform": len(counts) == 1}
    if len(counts) > 1 and getattr(model.config, "output_router_logits", False):
        # transformers' load-balancing loss needs one expert count for all layers; a non-uniform
        # model would fail every forward. ompmoe's FinetuneModule uses a per-layer loss instead.
        model.config.output_router_logits = False
        record["router_aux_loss"] = True
    elif previous.get("router_aux_loss"):
        record["router_aux_loss"] = True
    # The card and the record name the model that was pruned; statistics collected under another name say so.
    loaded = loaded_name(getattr(model.config, "_name_or_path", None))
    record["plan"] = {  # what the model card reports about the plan
        "method": plan.method, "ratio": plan.ratio, "allocation": plan.allocation,
        "num_tokens": plan.num_tokens, "model_id": loaded or plan.model_id}
    if isinstance(plan.extra.get("calibration"), dict):  # how the statistics were gathered (layer by layer)
        record["plan"]["calibration_mode"] = plan.extra["calibration"].get("mode")
    if loaded and plan.model_id and not same_model(plan.model_id, loaded):
        record["plan"]["statistics_model_id"] = plan.model_id
        warnings.warn(f"The statistics were collected as {plan.model_id!r} but the model pruned was loaded from "
                      f"{loaded!r}; the model card and config.json name {loaded!r}.", stacklevel=2)
    if previous.get("plan"):  # a pruned model pruned again: what each earlier pruning did, oldest first
        record[EARLIER_KEY] = [*previous.get(EARLIER_KEY, []), earlier_pruning(previous)]
    if previous.get(FINETUNE_KEY):  # fine-tunes after the earlier pruning came before this one: kept, in order
        earlier = list(getattr(model.config, FINETUNE_CONFIG_KEY, None) or [])
        setattr(model.config, FINETUNE_CONFIG_KEY, earlier + list(previous[FINETUNE_KEY]))
    setattr(model.config, CONFIG_KEY, record)
    return model
