"""Choose among candidate plans by the pruned model's loss on held-out calibration blocks: no single method and
allocation is best on every softmax-routed MoE (docs/quality/intervals.md), so ``auto`` tries its settings."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..perplexity import perplexity
from ..planning.plan import PruningPlan
from .trial import pruned_view

CHOICE_TOKENS = 2048
"""Held-out calibration tokens ``auto`` tries its candidates on by default: what the measurements used
(docs/quality/intervals.md), at a cost that does not grow with the calibration set."""


def default_choice_blocks(seq_len: int) -> int:
    """Blocks of ``seq_len`` tokens that hold at least :data:`CHOICE_TOKENS` tokens."""
    return -(-CHOICE_TOKENS // seq_len)


@dataclass(frozen=True)
class PlanChoice:
    """The chosen plan and every candidate's mean next-token loss (nats) on the choice blocks."""

    plan: PruningPlan
    index: int
    """Position of ``plan`` among the candidates."""
    losses: dict[str, float]
    """``{"method + allocation": loss}`` per candidate, in candidate order."""

    def summary(self) -> str:
        """``chose omp_normalized + loss by held-out calibration loss (omp + waterfill 3.951, ...)``."""
        losses = ", ".join(f"{name} {loss:.4f}" for name, loss in self.losses.items())
        return f"chose {setting_name(self.plan)} by its loss on held-out calibration blocks ({losses})"


def setting_name(plan: PruningPlan) -> str:
    """``method + allocation`` of a plan, as logs and the candidates' losses name it."""
    return f"{plan.method} + {plan.allocation}"


def choose_plan(model: nn.Module, candidates: Sequence[PruningPlan], blocks: torch.Tensor,
                batch_size: int = 4) -> PlanChoice:
    """The candidate whose pruned model has the lowest mean next-token loss on ``blocks`` (``(num_blocks, seq_len)``
    held-out token ids; first on ties). Candidates with the same kept experts are measured once."""
    check_choice_arguments(candidates, blocks)
    measured: dict[tuple, float] = {}
    for plan in candidates:
        key = kept_key(plan)
        if key not in measured:
            with pruned_view(model, plan):
                measured[key] = math.log(perplexity(model, blocks, batch_size))
    return chosen(candidates, measured)


def check_choice_arguments(candidates: Sequence[PruningPlan], blocks: torch.Tensor) -> None:
    if not candidates:
        raise ValueError("choose_plan needs at least one candidate plan.")
    if blocks.dim() != 2 or blocks.shape[0] == 0 or blocks.shape[1] < 2:
        raise ValueError(f"choose_plan needs (num_blocks, seq_len) token ids with seq_len >= 2; got shape "
                         f"{tuple(blocks.shape)}.")


def kept_key(plan: PruningPlan) -> tuple[tuple[int, ...], ...]:
    """What tells two candidates' pruned models apart: their kept experts, per layer (measured once each)."""
    return tuple(tuple(sorted(layer.kept)) for layer in plan.layers)


def chosen(candidates: Sequence[PruningPlan], measured: dict[tuple, float]) -> PlanChoice:
    """The candidate with the lowest loss in ``measured`` (by :func:`kept_key`), first on ties."""
    losses = {setting_name(plan): measured[kept_key(plan)] for plan in candidates}
    best = min(range(len(candidates)), key=lambda i: losses[setting_name(candidates[i])])
    return PlanChoice(candidates[best], best, losses)


__all__ = ["CHOICE_TOKENS", "PlanChoice", "check_choice_arguments", "choose_plan", "chosen", "default_choice_blocks",
           "kept_key", "setting_name"]
