"""Per-count set methods (optima are not nested, hence a :class:`~.registry.SubsetSelection`): the exact optimum of
the reconstruction objective, and OMP + 1-swap refinement. With groups, only group-balanced sets compete."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..collect.statistics import LayerStats
from ..planning.method_registry import (
    Selection,
    SelectionMethod,
    SubsetSelection,
    kept_masks,
    register_method,
    removed_energy,
)
from .omp import omp_orderings

EXACT_MAX_SUBSETS = 2_000_000
"""Default limit on the subsets the ``exact`` method may enumerate per layer (``2^N``)."""


class TooManySubsetsError(ValueError):
    """Exact enumeration of a layer's expert subsets would exceed the configured limit."""


def _tolerance(gram: torch.Tensor) -> float:
    """Energies closer than this count as equal (ties, and swaps that do not really improve)."""
    g = gram.to(torch.float64)
    return 1e-12 * max(float(g.sum()), float(g.diagonal().sum()), float(torch.finfo(torch.float64).tiny))


def _balanced(kept: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Whether each kept set has per-group counts differing by at most one."""
    per_group = kept.reshape(*kept.shape[:-1], num_groups, -1).sum(-1)
    return per_group.amax(-1) - per_group.amin(-1) <= 1


def check_exact_size(name: str, num_experts: int, max_subsets: int = EXACT_MAX_SUBSETS) -> None:
    """Refuse a layer whose ``2^N`` subsets exceed ``max_subsets`` (before any enumeration)."""
    if 2**num_experts > max_subsets:
        raise TooManySubsetsError(f"Method 'exact' would enumerate 2^{num_experts} = {2**num_experts:,} expert "
                                  f"subsets in layer {name}, more than max_subsets={max_subsets:,}. Raise "
                                  "max_subsets (time and memory grow as 2^N) or use method 'omp_swap' (local search "
                                  "from the greedy set).")


def exact_subsets(gram: torch.Tensor, num_groups: int = 1, max_subsets: int = EXACT_MAX_SUBSETS,
                  name: str = "layer", chunk: int = 1 << 15) -> torch.Tensor:
    """``kept[k]`` = a set of ``k`` experts minimizing ``u^T G u``, from all ``2^N`` subsets (the allocation needs every
    count; :class:`TooManySubsetsError` above ``max_subsets``); ties go to the lexicographically smallest ids."""
    n = gram.shape[0]
    if n % num_groups:
        raise ValueError(f"{n} experts cannot be split into {num_groups} equal groups.")
    check_exact_size(name, n, max_subsets)
    g = gram.to("cpu", torch.float64)
    # Code c encodes the kept set {e : bit (n - 1 - e) of c}; among sets of one size the
    # lexicographically smallest id list has the largest code.
    shifts = torch.arange(n - 1, -1, -1, dtype=torch.long)
    best_energy = torch.full((n + 1,), float("inf"), dtype=torch.float64)
    codes = torch.arange(2**n, dtype=torch.long)
    parts = []
    for part in codes.split(chunk):
        kept = ((part.unsqueeze(1) >> shifts) & 1).bool()
        energy = removed_energy(g, kept)
        count = kept.sum(1)
        valid = _balanced(kept, num_groups)
        best_energy.scatter_reduce_(0, count[valid], energy[valid], reduce="amin")
        parts.append((energy, count, valid))
    energy, count, valid = (torch.cat(column) for column in zip(*parts))
    tied = valid & (energy <= best_energy[count] + _tolerance(g))
    best_code = torch.full((n + 1,), -1, dtype=torch.long).scatter_reduce_(0, count[tied], codes[tied], reduce="amax")
    assert bool((best_code >= 0).all()), "every count has a group-balanced set"
    return ((best_code.unsqueeze(1) >> shifts) & 1).bool()


def swap_refine(gram: torch.Tensor, kept: torch.Tensor, num_groups: int = 1,
                max_rounds: int | None = None) -> torch.Tensor:
    """Best-improvement 1-swap local search on ``u^T G u`` for every row of ``kept`` (``(K, N)`` bool): swaps within a
    group (ties to the lowest ``i``, then ``j``) while one lowers the energy by more than ``1e-12`` of its scale, so the
    result is never worse than the input."""
    g = gram.to("cpu", torch.float64)
    n = g.shape[0]
    size = n // num_groups
    state = kept.clone().to("cpu", torch.bool)
    diagonal = g.diagonal()
    # Dropping kept i and keeping dropped j (same group) changes the energy by delta[g, i, j] = a_i + b_j - 2 G_ij,
    # a = 2 c + diag(G), b = diag(G) - 2 c with c = G u; +inf in a or b marks swaps that are not allowed.
    pair = -2.0 * torch.stack([g[k * size:(k + 1) * size, k * size:(k + 1) * size] for k in range(num_groups)])
    tolerance = _tolerance(g)
    active = torch.arange(state.shape[0])
    rounds = 0
    while active.numel() and (max_rounds is None or rounds < max_rounds):
        rounds += 1
        rows = state[active]
        c = (~rows).to(torch.float64) @ g  # (A, N); G is symmetric
        a = (2.0 * c + diagonal).masked_fill_(~rows, float("inf"))  # i must be kept
        b = (diagonal - 2.0 * c).masked_fill_(rows, float("inf"))  # j must be left out
        a, b = a.view(-1, num_groups, size, 1), b.view(-1, num_groups, 1, size)
        delta = a + b + pair
        best, flat = delta.view(active.numel(), -1).min(dim=1)  # first minimum: lowest (i, j)
        improve = best < -tolerance
        if not bool(improve.any()):
            break
        active, flat = active[improve], flat[improve]
        block, within = flat // (size * size), flat % (size * size)
        state[active, block * size + within // size] = False
        state[active, block * size + within % size] = True
    return state


@register_method
@dataclass
class Exact(SelectionMethod):
    """the exact minimum of `||Y - sum_{kept} V_e||^2`, by enumerating all `2^N` subsets (refused above `max_subsets`, i.e. beyond 20 experts, before calibration)"""

    name: ClassVar[str] = "exact"
    max_subsets: int = EXACT_MAX_SUBSETS

    def validate(self, routings: Sequence[tuple[str, dict[str, int]]]) -> None:
        for name, routing in routings:
            check_exact_size(name, routing["num_experts"], self.max_subsets)

    def select(self, layers: Sequence[LayerStats]) -> list[Selection]:
        self.validate([(layer.name, layer.routing) for layer in layers])  # every layer, before any enumeration
        return [SubsetSelection(exact_subsets(layer.gram, layer.num_groups, self.max_subsets, name=layer.name), order)
                for layer, order in zip(layers, omp_orderings(layers))]


@register_method
@dataclass
class OMPSwap(SelectionMethod):
    """the greedy set improved by best-improvement 1-swaps until no single swap lowers the residual (never worse than OMP)"""

    name: ClassVar[str] = "omp_swap"

    def select(self, layers: Sequence[LayerStats]) -> list[Selection]:
        return [
            SubsetSelection(swap_refine(layer.gram, kept_masks(order, layer.num_experts), layer.num_groups), order)
            for layer, order in zip(layers, omp_orderings(layers))
        ]
