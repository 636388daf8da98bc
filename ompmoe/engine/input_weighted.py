"""Sparse blocks whose routing weights scale the experts' input (Llama 4), in the form the rest of ompmoe reads.

Llama 4's block runs every expert on every token: its router returns every expert's score (the sigmoid of its logit
for the top-k, zero elsewhere) with the logits, and its experts take the expert-major stack of the hidden states
scaled by those scores, ``experts(hidden_states)``. A routed pair so contributes ``F_e(g x)``, not ``g F_e(x)``, and
that is its atom (an expert never routed contributes ``F_e(0) = 0``).

While ompmoe instruments such a block (statistics, the trial of a plan, a pruned view), :func:`routed_form` gives it
the form every other block has: the router's top-k ids and weights, and experts called as ``(hidden_states, ids,
weights)`` that run only the routed pairs, expert by expert (the stock call computes every expert on every token:
``num_experts / top_k`` times the work), and return their sum. The block computes what the stock one computes (equal
to float rounding, tested); the pruned model is saved and runs as the stock class.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ROUTED_FORM = "_ompmoe_routed_form"
"""Attribute of a block in the routed form: its :class:`_Form` (the last of its users gives the stock forwards
back)."""


def routed_pairs(scores: torch.Tensor, logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids (T, k), weights (T, k))`` of a router that returns every expert's score: its top-k by logit (the
    router's own ``topk`` call on the same logits) and their scores."""
    ids = torch.topk(logits, top_k, dim=1).indices
    return ids, scores.gather(1, ids)


def per_unit_weight(atoms: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``F_e(g x) / g`` in float32 (0 where ``g`` is 0): a pair's output as the other layouts give their unweighted
    ``F_e(x)``, which the per-expert sums (``alpha_e``, REAP, rerouting) read; ``weights`` shaped as ``atoms[..., 0]``."""
    gates = weights.detach().float().unsqueeze(-1)
    return torch.where(gates > 0, atoms.detach().float() / torch.where(gates > 0, gates, 1.0), 0.0)


def intermediate(experts: nn.Module, rows: torch.Tensor, expert: int) -> torch.Tensor:
    """The down projection's input for ``rows`` (already scaled by their routing weights) of one expert, as the stock
    experts compute it: ``gate_up_proj`` of shape ``(E, d, 2 * i)``, gate then up, ``act(gate) * up``."""
    gate, up = (rows @ experts.gate_up_proj[expert]).chunk(2, dim=-1)
    return up * experts.act_fn(gate)


def pair_intermediates(experts: nn.Module, hidden_states: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                       ) -> torch.Tensor:
    """``h_e(g x)`` of every routed pair, ``(T * k, i)`` token-major: the down projection's input, expert by
    expert on its scaled tokens only."""
    return _by_expert(experts, hidden_states, ids, weights, down=False)


def pair_outputs(experts: nn.Module, hidden_states: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                 ) -> torch.Tensor:
    """``F_e(g x)`` of every routed pair, ``(T, k, d)``: :func:`intermediate` times ``down_proj`` (``(E, i, d)``),
    expert by expert on its scaled tokens only."""
    return _by_expert(experts, hidden_states, ids, weights, down=True).view(*ids.shape, experts.down_proj.shape[-1])


def _by_expert(experts: nn.Module, hidden_states: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               down: bool) -> torch.Tensor:
    flat_ids = ids.reshape(-1)
    scaled = hidden_states.repeat_interleave(ids.shape[1], dim=0) * weights.reshape(-1, 1).to(hidden_states.dtype)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=experts.gate_up_proj.shape[0]).tolist()
    chunks = []
    for expert, rows in enumerate(scaled.index_select(0, order).split(counts)):
        if rows.shape[0]:
            inner = intermediate(experts, rows, expert)
            chunks.append(inner @ experts.down_proj[expert] if down else inner)
    width = experts.down_proj.shape[-1 if down else 1]
    outputs = torch.cat(chunks) if chunks else scaled.new_zeros(0, width)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return outputs.index_select(0, inverse)


def _experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """The routed form's experts call: the sum of the routed pairs' ``F_e(g x)`` per token."""
    return pair_outputs(experts, hidden_states, top_k_index, top_k_weights).sum(dim=1).to(hidden_states.dtype)


def _block_forward(block: nn.Module, router_attr: str, top_k: int, hidden_states: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The stock block's forward (shared expert plus the routed sum, and the router logits) over the routed pairs."""
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    scores, logits = getattr(block, router_attr)(flat)[:2]
    ids, weights = routed_pairs(scores, logits, top_k)
    routed = block.experts(flat, ids, weights)
    shared = getattr(block, "shared_expert", None)
    output = routed if shared is None else shared(flat) + routed
    return output, logits


@dataclass
class _Form:
    """A block in the routed form: how many users hold it, and the forwards put on the block and its experts."""

    users: int
    block_forward: Any
    experts_forward: Any


def enter_routed_form(layer: Any) -> bool:
    """Put an input-weighted block (``MoELayer``) in its routed form, or count one more user of the form it is in;
    whether it is such a block (then :func:`leave_routed_form` once for each call)."""
    block = layer.block
    if not getattr(layer, "input_weighted", False):
        return False
    form = getattr(block, ROUTED_FORM, None)
    if form is not None:
        form.users += 1
        return True
    router_attr = next(name for name, module in block.named_children() if module is layer.router)
    form = _Form(1, types.MethodType(
        lambda self, hidden, attr=router_attr, k=layer.top_k: _block_forward(self, attr, k, hidden), block),
        types.MethodType(_experts_forward, layer.experts))
    block.forward, layer.experts.forward = form.block_forward, form.experts_forward
    setattr(block, ROUTED_FORM, form)
    return True


def leave_routed_form(layer: Any) -> None:
    """One user of the routed form is done; the last gives the block and its experts their stock forwards back
    (a forward something else put there since is left to it)."""
    form = getattr(layer.block, ROUTED_FORM, None)
    if form is None:
        return
    form.users -= 1
    if form.users > 0:
        return
    for module, installed in ((layer.block, form.block_forward), (layer.experts, form.experts_forward)):
        if module.__dict__.get("forward") is installed:
            del module.forward
    del layer.block.__dict__[ROUTED_FORM]


@contextmanager
def routed_form(layers: Iterable[Any]) -> Iterator[None]:
    """Within the context, every input-weighted block of ``layers`` (``MoELayer``) routes through ``(hidden_states,
    ids, weights)`` experts; the stock forwards are back after it unless another user still holds the form."""
    held: list[Any] = []
    try:
        for layer in layers:
            if enter_routed_form(layer):
                held.append(layer)
        yield
    finally:
        for layer in held:
            leave_routed_form(layer)


__all__ = ["enter_routed_form", "intermediate", "leave_routed_form", "pair_intermediates", "pair_outputs",
           "per_unit_weight", "routed_form", "routed_pairs"]
