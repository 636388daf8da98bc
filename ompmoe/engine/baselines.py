"""Baseline expert-selection methods, computed from the same statistics as OMP-MoE.

Every method is registered in :data:`ompmoe.engine.plan.METHODS` and combines with every allocation
(``uniform``, ``waterfill``, ``optimal``): ``plan_pruning(stats, ratio, method=NAME)``. A
method maps the layers' :class:`~ompmoe.engine.statistics.LayerStats` to, per layer, either

- a full **ordering** (best first; a layer keeping ``k`` experts keeps the first ``k``), or
- a :class:`SubsetSelection`: one kept set per count ``k = 0..N`` that need not be nested
  (``exact`` and ``omp_swap``, whose best sets at different counts are not prefixes of one
  ordering). The allocation then sees ``r(k)`` and ``C(k)`` of the set kept at ``k``.

Score rankings (``frequency``, ``routing_mass``, ``ean``, ``reap``, ``random``,
``static_energy``) sort by a per-expert score, ties to the lowest id. On group-limited routers
(``num_groups > 1``) every method keeps the same number of experts in each group: score
rankings go in rounds of ``num_groups`` picks with at most one pick per group per round (best
score first), the same constraint as the grouped pursuit; set methods only consider
group-balanced sets (per-group counts differing by at most one, equal at multiples of
``num_groups``, which are the only counts an allocation chooses there).

Allocation always scores a layer's choice by the reconstruction residual on the layer's Gram
and the routing coverage of the kept set, whatever objective the method selected with, so all
methods are allocated under the same cost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .statistics import LayerStats

EXACT_MAX_SUBSETS = 2_000_000
"""Default limit on the subsets the ``exact`` method may enumerate per layer (``2^N``)."""


class TooManySubsetsError(ValueError):
    """Exact enumeration of a layer's expert subsets would exceed the configured limit."""


@dataclass
class SubsetSelection:
    """Kept sets per count for one layer, not necessarily nested.

    ``kept[k]`` (bool, ``N``) marks the experts kept when the layer keeps ``k`` of them.
    ``reference`` is a full ordering used to list experts: :meth:`order_at` puts the kept set
    first, each part in reference order, so ``sorted(order_at(k)[:k]) == kept_ids(k)``.
    """

    kept: torch.Tensor
    reference: torch.Tensor

    def kept_ids(self, count: int) -> list[int]:
        return torch.nonzero(self.kept[count]).flatten().tolist()

    def order_at(self, count: int) -> torch.Tensor:
        inside = self.kept[count][self.reference]
        return torch.cat([self.reference[inside], self.reference[~inside]])

    def residual(self, gram: torch.Tensor) -> torch.Tensor:
        """``r(k)`` of the set kept at each count: energy of the atoms left out over ``||Y||^2``."""
        energies = removed_energy(gram, self.kept)
        total = gram.to(torch.float64).sum().clamp(min=torch.finfo(torch.float64).tiny)
        return energies / total

    def coverage(self, routing_mass: torch.Tensor) -> torch.Tensor:
        """``C(k)``: share of the routing mass held by the set kept at each count."""
        mass = routing_mass.to(torch.float64)
        share = mass / mass.sum().clamp(min=torch.finfo(torch.float64).tiny)
        return self.kept.to(torch.float64) @ share


def removed_energy(gram: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``||Y - sum_{e kept} V_e||^2 = u^T G u`` with ``u`` the indicator of the experts left out.

    ``kept`` is ``(..., N)`` bool; returns ``(...)`` float64.
    """
    g = gram.to(torch.float64)
    u = (~kept).to(torch.float64)
    return ((u @ g) * u).sum(-1)


# ---------------------------------------------------------------------------- score rankings
def score_order(scores: torch.Tensor, num_groups: int = 1) -> torch.Tensor:
    """Experts by descending score, ties to the lowest id; group-balanced when ``num_groups > 1``.

    With groups (contiguous id blocks), round ``r`` takes the ``r``-th best expert of every
    group, and the picks of a round go best score first: exactly "at each step, the best
    expert of a group not yet picked in this round of ``num_groups`` steps".
    """
    scores = torch.nan_to_num(scores.detach().to("cpu", torch.float64), nan=float("-inf"))
    n = scores.numel()
    if n % num_groups:
        raise ValueError(f"{n} experts cannot be split into {num_groups} equal groups.")
    order = torch.sort(scores, descending=True, stable=True).indices
    if num_groups == 1:
        return order
    group = order // (n // num_groups)
    rank_in_group = torch.zeros(n, dtype=torch.long)
    seen = torch.zeros(num_groups, dtype=torch.long)
    for position, g in enumerate(group.tolist()):
        rank_in_group[position] = seen[g]
        seen[g] += 1
    key = rank_in_group * n + torch.arange(n)
    return order[torch.argsort(key)]


def _ranked(layers: Sequence[LayerStats], scores: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [score_order(s, layer.num_groups) for layer, s in zip(layers, scores)]


def frequency_orderings(layers: Sequence[LayerStats]) -> list[torch.Tensor]:
    """Frequency: number of calibration tokens routed to each expert."""
    return _ranked(layers, [layer.token_count for layer in layers])


def routing_mass_orderings(layers: Sequence[LayerStats]) -> list[torch.Tensor]:
    """Routing mass: sum of the native top-k weight ``g_e(x)`` over routed tokens."""
    return _ranked(layers, [layer.routing_mass for layer in layers])


def ean_orderings(layers: Sequence[LayerStats]) -> list[torch.Tensor]:
    """EAN (expert activation norm): ``sum_x ||F_e(x)||`` over the tokens routed to ``e``."""
    return _ranked(layers, [layer.norm_sum for layer in layers])


def reap_scores(layer: LayerStats) -> torch.Tensor:
    """REAP saliency ``mean_{x routed to e} g_e(x) ||F_e(x)||`` (0 for an expert never routed)."""
    count = layer.token_count.to(torch.float64)
    return torch.where(count > 0, layer.weighted_norm_sum.to(torch.float64) / count.clamp(min=1e-300), 0.0)


def reap_orderings(layers: Sequence[LayerStats]) -> list[torch.Tensor]:
    """REAP (Lasby et al., 2025): router-weighted expert activation norm, averaged over routed tokens."""
    return _ranked(layers, [reap_scores(layer) for layer in layers])


def random_orderings(layers: Sequence[LayerStats], seed: int = 0) -> list[torch.Tensor]:
    """Seeded random ranking: i.i.d. uniform scores per expert from ``torch.Generator().manual_seed(seed)``,
    drawn layer after layer (group-balanced like every method)."""
    generator = torch.Generator().manual_seed(int(seed))
    scores = [torch.rand(layer.num_experts, generator=generator, dtype=torch.float64) for layer in layers]
    return _ranked(layers, scores)


def static_energy_orderings(layers: Sequence[LayerStats]) -> list[torch.Tensor]:
    """Static ranking by ``||V_e||^2`` (the Gram diagonal): OMP without residual updates."""
    return _ranked(layers, [layer.gram.diagonal() for layer in layers])


# ----------------------------------------------------------------------- pursuit variants
def _omp(layers: Sequence[LayerStats]) -> list[torch.Tensor]:
    from .plan import omp_orderings  # plan imports this module

    return omp_orderings(layers)


def omp_normalized_orderings(layers: Sequence[LayerStats]) -> list[torch.Tensor]:
    """Greedy pursuit on the token-normalized Gram ``sum_x V(x) V(x)^T / ||Y_x||^2``.

    Each token's routed output then has unit energy, so a few high-norm tokens cannot decide
    the selection. Needs statistics with ``gram_normalized`` (collected by this version).
    """
    missing = [layer.name for layer in layers if layer.gram_normalized is None]
    if missing:
        raise ValueError(
            f"Method 'omp_normalized' needs the token-normalized Gram, which these statistics lack "
            f"(layers {missing[:3]}{'...' if len(missing) > 3 else ''}); they were written by an older "
            "ompmoe. Re-run collect_stats (or the calibration fit) to collect it."
        )
    return _omp([dataclasses.replace(layer, gram=layer.gram_normalized) for layer in layers])


def _tolerance(gram: torch.Tensor) -> float:
    """Energies closer than this count as equal (ties, and swaps that do not really improve)."""
    g = gram.to(torch.float64)
    return 1e-12 * max(float(g.sum()), float(g.diagonal().sum()), float(torch.finfo(torch.float64).tiny))


def _balanced(kept: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Whether each kept set has per-group counts differing by at most one."""
    if num_groups == 1:
        return torch.ones(kept.shape[:-1], dtype=torch.bool)
    per_group = kept.reshape(*kept.shape[:-1], num_groups, -1).sum(-1)
    return per_group.amax(-1) - per_group.amin(-1) <= 1


def check_exact_size(name: str, num_experts: int, max_subsets: int = EXACT_MAX_SUBSETS) -> None:
    """Refuse a layer whose ``2^N`` subsets exceed ``max_subsets`` (before any enumeration)."""
    if 2**num_experts > max_subsets:
        raise TooManySubsetsError(
            f"Method 'exact' would enumerate 2^{num_experts} = {2**num_experts:,} expert subsets in layer "
            f"{name}, more than max_subsets={max_subsets:,}. Raise max_subsets (time and memory grow as "
            "2^N) or use method 'omp_swap' (local search from the greedy set)."
        )


def exact_subsets(gram: torch.Tensor, num_groups: int = 1, max_subsets: int = EXACT_MAX_SUBSETS,
                  name: str = "layer", chunk: int = 1 << 15) -> torch.Tensor:
    """``kept[k]`` = a set of ``k`` experts minimizing ``||Y - sum_{e in E} V_e||^2 = u^T G u``.

    Enumerates all ``2^N`` subsets (every count is needed for the allocation curves) and
    refuses with :class:`TooManySubsetsError` above ``max_subsets``. With groups, only
    group-balanced sets compete. Ties (energies within ``1e-12`` of the layer's energy scale)
    go to the lexicographically smallest sorted id list.
    """
    n = gram.shape[0]
    if n % num_groups:
        raise ValueError(f"{n} experts cannot be split into {num_groups} equal groups.")
    check_exact_size(name, n, max_subsets)
    g = gram.to("cpu", torch.float64)
    # Code c encodes the kept set {e : bit (n - 1 - e) of c}; among sets of one size the
    # lexicographically smallest id list has the largest code.
    shifts = torch.arange(n - 1, -1, -1, dtype=torch.long)
    best_energy = torch.full((n + 1,), float("inf"), dtype=torch.float64)
    energies, counts, valid_parts = [], [], []
    for start in range(0, 2**n, chunk):
        codes = torch.arange(start, min(start + chunk, 2**n), dtype=torch.long)
        kept = ((codes.unsqueeze(1) >> shifts) & 1).bool()
        energy = removed_energy(g, kept)
        count = kept.sum(1)
        valid = _balanced(kept, num_groups)
        energies.append(energy)
        counts.append(count)
        valid_parts.append(valid)
        best_energy.scatter_reduce_(0, count[valid], energy[valid], reduce="amin")
    energy, count, valid = torch.cat(energies), torch.cat(counts), torch.cat(valid_parts)
    codes = torch.arange(2**n, dtype=torch.long)
    tied = valid & (energy <= best_energy[count] + _tolerance(g))
    best_code = torch.full((n + 1,), -1, dtype=torch.long).scatter_reduce_(0, count[tied], codes[tied], reduce="amax")
    assert bool((best_code >= 0).all()), "every count has a group-balanced set"
    return ((best_code.unsqueeze(1) >> shifts) & 1).bool()


def exact_selections(layers: Sequence[LayerStats], max_subsets: int = EXACT_MAX_SUBSETS) -> list[SubsetSelection]:
    """Exact optimum of the reconstruction objective at every count, by enumeration.

    Exact optima at different counts are not nested, so this returns one optimal set per
    count (:class:`SubsetSelection`): a layer allocated ``k`` experts keeps the optimal
    ``k``-set, and the allocation curves are the optimal residual ``r*(k)`` and the coverage
    of those sets. All layers are checked against ``max_subsets`` before any enumeration.
    """
    for layer in layers:
        check_exact_size(layer.name, layer.num_experts, max_subsets)
    orders = _omp(layers)
    return [
        SubsetSelection(kept=exact_subsets(layer.gram, layer.num_groups, max_subsets, name=layer.name), reference=order)
        for layer, order in zip(layers, orders)
    ]


def swap_refine(gram: torch.Tensor, kept: torch.Tensor, num_groups: int = 1, max_rounds: int | None = None) -> torch.Tensor:
    """Best-improvement 1-swap local search on ``u^T G u``, for every row of ``kept`` (``(K, N)`` bool).

    A swap drops a kept expert ``i`` and keeps a dropped expert ``j`` (of the same group when
    ``num_groups > 1``, so group balance is kept); it changes the residual energy by
    ``2 c_i - 2 c_j + G_ii + G_jj - 2 G_ij`` with ``c = G u``. Each round applies, per row, the
    swap that lowers the energy most (ties to the lowest ``i``, then ``j``) if it lowers it by
    more than ``1e-12`` of the energy scale; rows stop when none does, i.e. when no single swap
    improves them. Energies only go down, so the result is never worse than the input.
    """
    g = gram.to("cpu", torch.float64)
    n = g.shape[0]
    size = n // num_groups
    state = kept.clone().to("cpu", torch.bool)
    diagonal = g.diagonal()
    # Swaps stay inside a group: work on the (group, i, j) blocks only. For a row,
    # delta[g, i, j] = a_i + b_j - 2 G_ij; +inf in a or b marks swaps that are not allowed.
    blocks = torch.stack([g[k * size:(k + 1) * size, k * size:(k + 1) * size] for k in range(num_groups)])
    pair = -2.0 * blocks  # (groups, size, size)
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


def omp_swap_selections(layers: Sequence[LayerStats]) -> list[SubsetSelection]:
    """OMP followed by 1-swap refinement on the same objective, at every count.

    For each count ``k`` the greedy (group-constrained) ``k``-prefix is improved by
    :func:`swap_refine` until no single swap lowers ``||Y - sum_{kept} V||^2``; refined sets
    are not nested, hence a :class:`SubsetSelection`. Never worse than OMP at any count.
    """
    orders = _omp(layers)
    selections = []
    for layer, order in zip(layers, orders):
        n = layer.num_experts
        position = torch.empty(n, dtype=torch.long)
        position[order] = torch.arange(n)
        prefixes = position.unsqueeze(0) < torch.arange(n + 1).unsqueeze(1)  # (N + 1, N)
        selections.append(SubsetSelection(kept=swap_refine(layer.gram, prefixes, layer.num_groups), reference=order))
    return selections


BASELINES = {
    "frequency": frequency_orderings,
    "routing_mass": routing_mass_orderings,
    "ean": ean_orderings,
    "reap": reap_orderings,
    "random": random_orderings,
    "static_energy": static_energy_orderings,
    "exact": exact_selections,
    "omp_swap": omp_swap_selections,
    "omp_normalized": omp_normalized_orderings,
}
"""Baseline methods by name (registered in :data:`ompmoe.engine.plan.METHODS` next to ``omp``)."""

__all__ = [
    "BASELINES",
    "EXACT_MAX_SUBSETS",
    "SubsetSelection",
    "TooManySubsetsError",
    "check_exact_size",
    "exact_subsets",
    "removed_energy",
    "score_order",
    "swap_refine",
]
