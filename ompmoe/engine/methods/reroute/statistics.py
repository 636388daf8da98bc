"""Rerouting-aware statistics: what each token's output becomes when one of its experts is pruned.

After pruning, a token's next expert by routing score (rank ``k + 1``) takes the free slot, so removing ``e`` changes
the output by ``D_e(x) = Y_x - Y'_e(x)``, not ``V_e(x)``; the Grams of ``D`` replace the paper's Gram in
``u^T G u``. The sums, the renormalized weights and the cost: docs/methods.md.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ...adapters import MoELayer
from ...collect.extensions import StatisticsExtension, register_statistics
from ...input_weighted import pair_outputs, per_unit_weight, routed_pairs

if TYPE_CHECKING:
    from .metric import RerouteStatsMetric

REROUTE_TENSORS = ("gram_reroute", "gram_reroute_normalized")
"""Optional :class:`~ompmoe.engine.collect.statistics.LayerStats` fields filled by ``collect_stats(..., reroute=True)``."""


class RerouteError(ValueError):
    """Rerouting-aware statistics cannot be collected on this model."""


def check_reroutable(layers: list[MoELayer]) -> None:
    """Refuse layers whose router has no ``top_k`` attribute or no expert left to take over."""
    for layer in layers:
        if not isinstance(getattr(layer.router, "top_k", None), int):
            raise RerouteError(f"reroute=True needs a router with an integer `top_k` attribute; the router of "
                               f"{layer.name} ({type(layer.router).__name__}) has none. Collect without reroute.")
        if layer.identity_experts:
            raise RerouteError(f"reroute=True is not supported on zero-computation (identity) experts: {layer.name} "
                               f"has {layer.identity_experts}, which may take a pruned expert's slot. Collect without "
                               "reroute.")
        if layer.num_experts <= layer.top_k:
            raise RerouteError(f"reroute=True needs more experts than top_k in every layer; {layer.name} has "
                               f"{layer.num_experts} experts and top_k {layer.top_k}. Collect without reroute.")


def removal_deltas(expert_out: torch.Tensor, gates: torch.Tensor, ids: torch.Tensor, ext_ids: torch.Tensor,
                   ext_weights: torch.Tensor, next_out: torch.Tensor) -> torch.Tensor:
    """``D (T, k, d)``: ``D[x, j] = Y_x - Y'_j(x)``, the output change when slot ``j``'s expert is removed, from
    ``expert_out`` ``(T, k, d)``, ``gates`` and ``ids`` ``(T, k)``: the native slots; ``ext_ids``/``ext_weights``
    ``(T, k + 1)``: the ``top_k + 1`` call; ``next_out`` ``(T, d)``: ``F_n`` of its expert not in ``ids``."""
    matches = ids.unsqueeze(-1) == ext_ids.unsqueeze(-2)  # (T, k, k + 1)
    ext_native = (ext_weights.unsqueeze(1) * matches).sum(-1)  # w^+ of the native slots, (T, k)
    next_weight = (ext_weights * ~matches.any(1)).sum(-1)  # w^+ of the next expert, (T,)
    renormalized = bool(((ext_native - gates).abs() > 1e-6 * gates.abs().sum(-1, keepdim=True)).any())
    outputs = gates.unsqueeze(-1) * expert_out
    full = outputs.sum(1)  # Y_x
    if renormalized:
        scale = gates.sum(-1, keepdim=True)  # sum of the native weights (routed scaling factor)
        denominator = ext_native.sum(-1, keepdim=True) - ext_native + next_weight.unsqueeze(-1)  # (T, k)
        factor = scale / denominator.clamp(min=torch.finfo(denominator.dtype).tiny)
        kept_part = (ext_native.unsqueeze(-1) * expert_out).sum(1, keepdim=True) - ext_native.unsqueeze(-1) * expert_out
        rerouted = factor.unsqueeze(-1) * (kept_part + (next_weight.unsqueeze(-1) * next_out).unsqueeze(1))
    else:
        rerouted = full.unsqueeze(1) - outputs + (next_weight.unsqueeze(-1) * next_out).unsqueeze(1)
    return full.unsqueeze(1) - rerouted


class RerouteRecorder:
    """Hooks that add each layer's rerouting-aware sums during the statistics forward: each router is re-run with
    ``top_k + 1`` (its own code), the experts' input is kept, and :meth:`callback` evaluates the next expert ``F_n``
    and adds :func:`removal_deltas` to the metric."""

    def __init__(self, layers: list[MoELayer], metric: RerouteStatsMetric,
                 token_weight: Callable[[], torch.Tensor | None]) -> None:
        check_reroutable(layers)
        self.layers = layers
        self.metric = metric
        self.token_weight = token_weight
        self._extended: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._hidden: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []

    def attach(self) -> None:
        for index, layer in enumerate(self.layers):
            self._handles.append(layer.router.register_forward_hook(partial(self._router_hook, index)))
            pre_hook = partial(self._experts_pre_hook, index)
            self._handles.append(layer.experts.register_forward_pre_hook(pre_hook, with_kwargs=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._extended, self._hidden = [], {}, {}

    def _router_hook(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        module.top_k += 1
        try:
            with torch.no_grad():
                extended = module.forward(*args)
        finally:
            module.top_k -= 1
        if self.layers[index].input_weighted:  # Llama 4's (scores, logits): its top k + 1 by logit
            ids, weights = routed_pairs(extended[0], extended[1], module.top_k + 1)
            self._extended[index] = (ids.detach(), weights.detach())
        else:
            self._extended[index] = (extended[2].detach(), extended[1].detach())  # (logits, weights, ids, ...)

    def _experts_pre_hook(self, index: int, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        self._hidden[index] = (args[0] if args else next(iter(kwargs.values()))).detach()

    def callback(self, update: Callable[..., None]) -> Callable[..., None]:
        """``update`` (the statistics callback), then this layer's rerouting-aware sums."""

        def chained(index: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, outputs: torch.Tensor,
                    *atoms: torch.Tensor) -> None:
            update(index, top_k_index, top_k_weights, outputs, *atoms)
            self.add(index, top_k_index, top_k_weights, outputs)

        return chained

    @torch.no_grad()
    def add(self, index: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, outputs: torch.Tensor) -> None:
        ext_ids, ext_weights = self._extended.pop(index)
        hidden = self._hidden.pop(index)
        num_tokens, top_k = top_k_index.shape
        ids = top_k_index.detach()
        outside = ~(ext_ids.unsqueeze(-1) == ids.unsqueeze(-2)).any(-1)  # (T, k + 1): the next expert's slot
        next_ids = (ext_ids * outside).sum(-1)
        experts = self.layers[index].experts
        if self.layers[index].input_weighted:  # F_n(g_n x) / g_n: the next expert's output as the others' are given
            next_weight = (ext_weights * outside).sum(-1, keepdim=True)
            next_out = per_unit_weight(pair_outputs(experts, hidden, next_ids.view(-1, 1), next_weight),
                                       next_weight)[:, 0]
        else:
            unit = torch.ones(num_tokens, 1, dtype=top_k_weights.dtype, device=top_k_weights.device)
            next_out = type(experts).forward(experts, hidden, next_ids.view(-1, 1), unit)
        expert_out = outputs.detach().view(num_tokens, top_k, -1).float()
        weight = self.token_weight()
        gates, ext_w, next_out = top_k_weights.detach().float(), ext_weights.float(), next_out.float()
        if weight is not None:
            keep = weight.to(ids.device) > 0
            expert_out, gates, ids, ext_ids, ext_w, next_out = (
                t[keep] for t in (expert_out, gates, ids, ext_ids, ext_w, next_out))
            weight = weight.to(ids.device)[keep]
        deltas = removal_deltas(expert_out, gates, ids, ext_ids, ext_w, next_out)
        self.metric.update(index, ids, deltas, gates.unsqueeze(-1) * expert_out, weight)


@register_statistics
class RerouteStatistics(StatisticsExtension):
    """The rerouting-aware Grams: one more router call and one expert evaluation per token, same forward."""

    name: ClassVar[str] = "reroute"
    kind: ClassVar[str] = "rerouting-aware"
    option: ClassVar[str] = "reroute=True"
    prefix: ClassVar[str] = "reroute"
    tensors: ClassVar[tuple[str, ...]] = REROUTE_TENSORS

    def __init__(self, model: nn.Module, layers: list[MoELayer],
                 token_weight: Callable[[], torch.Tensor | None]) -> None:
        super().__init__(model, layers, token_weight)
        from .metric import RerouteStatsMetric  # torchmetrics on the first collection only

        self.metric = RerouteStatsMetric(layers, REROUTE_TENSORS)
        self.recorder = RerouteRecorder(layers, self.metric, token_weight)

    def wrap(self, update: Callable[..., None]) -> Callable[..., None]:
        return self.recorder.callback(update)
