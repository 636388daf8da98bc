"""The two terms the loss-aware sums are made of, shared by the resident pass (:mod:`.statistics`) and the
layer-by-layer backward (:mod:`.layerwise`): the next-token loss a batch is differentiated through, and the routed
atoms its gradient is projected on."""

from __future__ import annotations

import torch
from torch import nn


def next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor, token_weight: torch.Tensor | None) -> torch.Tensor:
    """Summed next-token cross-entropy (nats); a prediction counts with the product of its two tokens' weights."""
    batch, seq = input_ids.shape
    losses = nn.functional.cross_entropy(
        logits[:, :-1].float().flatten(0, 1), input_ids[:, 1:].flatten(), reduction="none"
    ).view(batch, seq - 1)
    if token_weight is None:
        return losses.sum()
    weight = token_weight.view(batch, seq).to(losses.device, losses.dtype)
    pair_weight = weight[:, :-1] * weight[:, 1:]
    return torch.where(pair_weight > 0, losses * pair_weight, 0.0).sum()


def routed_atoms(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, outputs: torch.Tensor,
                 atoms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top_k_index, atoms (T, k, d))`` of one MoE call, detached: ``atoms`` as the block summed them, else ``g F``
    formed in the outputs' dtype."""
    num_tokens, top_k = top_k_index.shape
    if atoms is None or atoms.dtype != outputs.dtype:
        atoms = outputs.detach() * top_k_weights.detach().reshape(-1, 1).to(outputs.dtype)
    return top_k_index.detach(), atoms.detach().view(num_tokens, top_k, -1)


__all__ = ["next_token_loss", "routed_atoms"]
