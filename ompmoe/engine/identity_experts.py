"""LongCat-Flash's zero-computation experts: router ids past the routed experts whose "expert" returns its input.

They cost nothing at inference and hold no weights of their own (their ``gate_up_proj`` rows are never read), so
ompmoe treats them as shared experts: never pruned, never measured. Their pairs' contribution ``g x`` stays in the
block's output as a fixed part; statistics see them as "no expert" pairs (id ``num_experts``, weight, output and atom
zero) that add nothing to any sum; pruning keeps their router rows (and ``gate_up_proj`` rows) after the kept experts,
so a pruned router's ids ``K ..`` are still the identity experts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def as_unmeasured(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, outputs: torch.Tensor,
                  atoms: torch.Tensor, num_experts: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One experts call's ``(ids (T, k), weights (T, k), outputs (T*k, d), atoms (T*k, d))`` as the statistics take
    them: each identity pair (id ``>= num_experts``) as id ``num_experts`` with weight, output and atom zero."""
    identity = top_k_index >= num_experts
    rows = identity.reshape(-1, 1)
    return (top_k_index.masked_fill(identity, num_experts), top_k_weights.masked_fill(identity, 0),
            outputs.masked_fill(rows, 0), atoms.masked_fill(rows, 0))


def measured_ids(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, measured)``: the pairs' ids with the "no expert" id folded onto a real one (its values are zero, so it
    adds nothing) and the mask of the pairs that are experts', for the counts."""
    measured = top_k_index < num_experts
    return top_k_index.clamp(max=num_experts - 1), measured


def original_ids(kept: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """A pruned router's ids ``ids`` (``0 .. K-1``: the kept experts ``kept``, ascending; ``K ..``: the identity
    experts, kept after them) as the unpruned layer's ids (``kept[i]``; ``num_experts + i - K``)."""
    count = kept.numel()
    kept = kept.to(ids.device)
    return torch.where(ids < count, kept[ids.clamp(max=count - 1)], ids - count + num_experts)


def split_identity_pairs(ids: torch.Tensor, count: int, contributions: torch.Tensor, outputs: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pruned routing's pairs (``ids`` ``(T, k')`` among ``count`` kept experts, then identity experts) split for a
    compensation fit: ``(ids, fixed (T, d), contributions, outputs, measured (T, k'))`` with the identity pairs'
    ``g' x`` summed into ``fixed`` (no expert's down projection can correct it) and their contributions and outputs
    zeroed under a kept id, so they add nothing to the fit's sums."""
    identity = ids >= count
    fixed = (contributions * identity.unsqueeze(-1)).sum(1)
    rows = identity.unsqueeze(-1)
    return (ids.clamp(max=count - 1), fixed, contributions.masked_fill(rows, 0), outputs.masked_fill(rows, 0),
            ~identity)


def identity_slot(ids: torch.Tensor, weights: torch.Tensor, identity: int | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One pair per row (``ids``, ``weights`` ``(P, 1)``) as an experts call takes it: with identity experts (their
    first id ``identity``) each row gets a second slot, that expert at weight 0, which adds exactly 0. LongCat-Flash's
    forward cannot take one slot per row (it squeezes that axis away); the identity expert costs nothing."""
    if identity is None:
        return ids, weights
    return torch.cat([ids, torch.full_like(ids, identity)], 1), torch.cat([weights, torch.zeros_like(weights)], 1)


def pair_call(native: Callable[..., torch.Tensor], hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              identity: int | None = None) -> torch.Tensor:
    """``native(hidden, ids, weights)`` for one pair per row, through :func:`identity_slot`."""
    return native(hidden, *identity_slot(ids, weights, identity))


def first_identity(num_experts: int, identity_experts: int) -> int | None:
    """The id of a layer's first identity expert, ``None`` without them."""
    return num_experts if identity_experts else None


__all__ = ["as_unmeasured", "first_identity", "identity_slot", "pair_call", "measured_ids", "original_ids", "split_identity_pairs"]
