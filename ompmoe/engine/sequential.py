"""Sequential calibration: choose layer ``l``'s experts on the outputs of the already pruned layers before it.

One statistics pass sees every layer's input as the unpruned model produces it, but after pruning
layer ``l`` receives what the pruned layers ``0..l-1`` produce. :func:`sequential_plan` keeps the
kept counts of a plan made from the ordinary statistics and re-selects each layer's experts, in
model order, with the same method on statistics collected from a copy of the model whose earlier
layers are already pruned to their final sets: ``L`` more calibration passes (``L`` MoE layers).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

from .collect import collect_stats
from .methods import SubsetSelection, get_method
from .plan import LayerPlan, PruningPlan
from .pruning import prune
from .selection import prefix_residual, routing_coverage


def _keep_all(layer: LayerPlan) -> LayerPlan:
    everything = list(range(layer.num_experts))
    return dataclasses.replace(layer, order=everything, kept=everything)


def sequential_plan(
    model: nn.Module,
    batches: Iterable[Any],
    plan: PruningPlan,
    loss_aware: bool = False,
) -> PruningPlan:
    """``plan`` (same counts, method and options) with every layer re-selected after its predecessors are pruned.

    ``batches`` must be re-iterable (a list or a DataLoader); ``loss_aware`` collects the
    loss-aware sums too (needed by the loss-aware methods). ``model`` is not modified.
    """
    batches = batches if isinstance(batches, Sequence) else list(batches)
    method = get_method(plan.method, (plan.extra or {}).get("method_options"))
    final: list[LayerPlan] = []
    for index, layer_plan in enumerate(plan.layers):
        if index == 0:
            final.append(layer_plan)  # layer 0 sees the same inputs either way
            continue
        partial = dataclasses.replace(plan, layers=final + [_keep_all(p) for p in plan.layers[index:]])
        pruned = prune(copy.deepcopy(model), partial)
        stats = collect_stats(pruned, batches, loss_aware=loss_aware)
        del pruned
        layer = stats.layers[index]
        selection = method.select([layer])[0]
        count = layer_plan.num_kept
        if isinstance(selection, SubsetSelection):
            order = selection.order_at(count)
            residual, coverage = selection.residual(layer.gram), selection.coverage(layer.routing_mass)
        else:
            order = selection
            residual, coverage = prefix_residual(layer.gram, order), routing_coverage(layer.routing_mass, order)
        final.append(dataclasses.replace(
            layer_plan,
            order=order.tolist(),
            residual=residual.tolist(),
            coverage=coverage.tolist(),
            kept=sorted(order[:count].tolist()),
        ))
    extra = {**(plan.extra or {}), "sequential": True}
    return dataclasses.replace(plan, layers=final, extra=extra)


__all__ = ["sequential_plan"]
