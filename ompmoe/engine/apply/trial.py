"""Run a model as if a plan had pruned it, without copying it or touching its expert weights: only the routers are
sliced, and a pre-hook on each experts module maps the routers' new ids back to the original experts."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from ..adapters import MoELayer, architecture_of, find_moe_layers
from ..planning.plan import PruningPlan
from ..identity_experts import original_ids
from ..input_weighted import routed_form
from .pruning import restore_module, slice_routing, validate_plan


@contextmanager
def pruned_view(model: nn.Module, plan: PruningPlan) -> Iterator[nn.Module]:
    """Within the context, ``model`` computes what ``ompmoe.prune(copy_of_model, plan)`` would; the plan is checked
    first, and the model is restored after the context, also when its body raises."""
    layers = find_moe_layers(model)
    validate_plan(model, plan, layers)
    spec = architecture_of(model)
    with ExitStack() as stack:
        for layer, layer_plan in zip(layers, plan.layers):
            stack.enter_context(pruned_layer_view(layer, sorted(int(i) for i in layer_plan.kept),
                                                  spec.count_attributes, spec.experts_arguments[1]))
        yield model


@contextmanager
def pruned_layer_view(layer: MoELayer, kept: list[int], count_attributes: tuple[str, ...], ids_argument: str
                      ) -> Iterator[MoELayer]:
    """:func:`pruned_view` of one MoE layer (kept experts ``kept``, ascending): its routing sliced, its experts
    called with the original ids; restored after the context."""
    index = torch.tensor(kept, dtype=torch.long)
    restore: list[tuple[nn.Module, dict[str, Any]]] = []
    hook = None
    form = routed_form([layer])  # Llama 4's experts take ids only in their routed form
    form.__enter__()
    try:
        restore.extend(slice_routing(layer, index, count_attributes))
        hook = layer.experts.register_forward_pre_hook(partial(_original_ids, kept=index, name=ids_argument,
                                                               count=layer.num_experts), with_kwargs=True)
        yield layer
    finally:
        if hook is not None:
            hook.remove()
        for module, saved in restore:
            restore_module(module, saved)
        form.__exit__(None, None, None)


def _original_ids(module: nn.Module, args: tuple, kwargs: dict[str, Any], *, kept: torch.Tensor,
                  name: str, count: int) -> tuple[tuple, dict[str, Any]]:
    """Experts pre-hook: the sliced router's ids ``0..K-1`` (argument ``name``) -> the kept experts' original ids
    (identity experts' ``K..`` -> ``count..``)."""
    if name in kwargs:
        kwargs[name] = original_ids(kept, kwargs[name], count)
    else:
        args = (args[0], original_ids(kept, args[1], count), *args[2:])
    return args, kwargs


__all__ = ["pruned_layer_view", "pruned_view"]
