"""Greedy binary pursuit (the paper's Algorithm 1) computed from Gram matrices: the correlation
``<R_t, V_e> = sum_{f not in E_t} G[f, e]`` drops by one Gram row per step, so an ordering costs ``O(N^2)``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass
class PursuitResult:
    """Full greedy ordering of one or more layers (leading batch dimension optional)."""

    order: torch.Tensor
    """Expert ids in selection order ``pi`` (..., N)."""
    residual: torch.Tensor
    """Normalized residual ``r(k) = ||R_k||^2 / ||Y||^2`` for ``k = 0..N`` (..., N + 1)."""
    gains: torch.Tensor | None
    """``gains[..., t, e]`` = ``Delta_e`` at step ``t`` (``-inf``: not eligible; ``None`` if ``with_gains=False``)."""


def greedy_pursuit(gram: torch.Tensor, num_groups: int = 1, with_gains: bool = True) -> PursuitResult:
    """Order every expert by the greedy binary pursuit on ``gram`` (``(N, N)`` or ``(L, N, N)``), ties to the lowest id;
    with groups (contiguous id blocks) a step picks from the groups picked least so far, so prefixes of multiples of
    ``num_groups`` keep the same count in each group, as group-limited routers need."""
    squeeze = gram.dim() == 2
    g = (gram.unsqueeze(0) if squeeze else gram).to(torch.float64)
    batch, n, _ = g.shape
    atom_energy = g.diagonal(dim1=1, dim2=2).contiguous()
    signal_energy = g.sum(dim=(1, 2))
    orders: list[torch.Tensor] = []
    energies = [signal_energy]
    step_gains: list[torch.Tensor] = []
    # the correlation <Y, V_e> = sum_f G[f, e] drops by the chosen atom's Gram row
    for gain, best, chosen in grouped_greedy(g, g.sum(dim=1), lambda correlation: 2.0 * correlation - atom_energy,
                                             num_groups):
        orders.append(chosen)
        energies.append(energies[-1] - best)
        if with_gains:
            step_gains.append(gain)
    order = torch.stack(orders, dim=1) if orders else torch.empty(batch, 0, dtype=torch.long, device=g.device)
    residual = torch.stack(energies, dim=1)
    residual = residual / signal_energy.clamp(min=torch.finfo(torch.float64).tiny).unsqueeze(1)
    gains = torch.stack(step_gains, dim=1) if step_gains else g.new_empty(batch, n, n) if with_gains else None
    if squeeze:
        return PursuitResult(order=order[0], residual=residual[0], gains=None if gains is None else gains[0])
    return PursuitResult(order=order, residual=residual, gains=gains)


def grouped_greedy(rows: torch.Tensor, state: torch.Tensor, gain_of: Callable[[torch.Tensor], torch.Tensor],
                   num_groups: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Steps ``(gain, best gain, chosen id)`` of a greedy ordering, batched ``(B, N)``: each picks the eligible
    maximum of ``gain_of(state)`` (a new tensor), ties to the lowest id, then subtracts the chosen row of ``rows``
    ``(B, N, N)`` from ``state``; with groups (contiguous id blocks), a group picked in this round is not eligible
    again until the round ends."""
    batch, n, _ = rows.shape
    if n % num_groups:
        raise ValueError(f"{n} experts cannot be split into {num_groups} equal groups.")
    group_size = n // num_groups
    batch_ids = torch.arange(batch, device=rows.device)
    row_start = batch_ids * n
    flat_rows = rows.reshape(batch * n, n)
    taken = torch.zeros(batch, n, dtype=torch.bool, device=rows.device)
    blocked = taken
    for step in range(n):
        if num_groups > 1 and step % num_groups == 0:
            blocked = taken.clone()
        gain = gain_of(state).masked_fill_(blocked, float("-inf"))
        best, chosen = gain.max(dim=1)  # first maximum: ties go to the lowest id
        yield gain, best, chosen
        state = state - flat_rows.index_select(0, row_start + chosen)
        taken[batch_ids, chosen] = True
        if num_groups > 1:
            blocked.view(batch, num_groups, group_size)[batch_ids, chosen // group_size] = True


def prefix_residual(gram: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Normalized residual ``r(k)`` of keeping the first ``k`` experts of any ``order``: the energy of the atoms left
    out, ``1_U^T G 1_U``, over ``||Y||^2``."""
    g = gram.to(torch.float64)
    n = order.numel()
    # Energy of the suffix order[k:], for k = 0..N: the diagonal of the 2-D cumulative sum of
    # the permuted Gram with rows and columns reversed. Both running sums go along contiguous
    # rows (much faster than along columns), hence the transposed copies.
    reverse = order.flip(0)
    flipped_t = g.index_select(0, reverse).t().contiguous().index_select(0, reverse)
    column_sums = flipped_t.cumsum(1).t().contiguous()
    suffix = column_sums.cumsum(1).diagonal().flip(0)
    energies = torch.cat([suffix, suffix.new_zeros(1)])
    total = energies[0].clamp(min=torch.finfo(torch.float64).tiny)
    return energies[: n + 1] / total


def routing_coverage(routing_mass: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``C(k)``: share of calibration routing mass held by the first ``k`` experts, ``k = 0..N``."""
    mass = routing_mass.to(torch.float64)
    share = mass / mass.sum().clamp(min=torch.finfo(torch.float64).tiny)
    return torch.cat([share.new_zeros(1), share[order].cumsum(0)])
