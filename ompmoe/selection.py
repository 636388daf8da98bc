"""Greedy binary pursuit (the paper's Algorithm 1) computed from Gram matrices.

With ``R_t = Y - sum_{e in E_t} V_e`` and ``Y = sum_e V_e``, the correlation
``<R_t, V_e> = sum_{f not in E_t} G[f, e]`` drops by one Gram row per step, so the whole
``N_e``-step ordering costs ``O(N_e^2)`` per layer and is batched over layers of equal size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PursuitResult:
    """Full greedy ordering of one or more layers (leading batch dimension optional)."""

    order: torch.Tensor
    """Expert ids in selection order ``pi`` (..., N)."""
    residual: torch.Tensor
    """Normalized residual ``r(k) = ||R_k||^2 / ||Y||^2`` for ``k = 0..N`` (..., N + 1)."""
    gains: torch.Tensor
    """``gains[..., t, e]`` = ``Delta_e`` at step ``t``; ``-inf`` for experts not eligible then."""


def greedy_pursuit(gram: torch.Tensor, num_groups: int = 1) -> PursuitResult:
    """Order every expert by the greedy binary pursuit on ``gram`` (``(N, N)`` or ``(L, N, N)``).

    With ``num_groups > 1`` the pursuit is group-constrained: a step may only pick from the
    groups (contiguous id blocks) that have been picked least so far, so every prefix whose
    length is a multiple of ``num_groups`` keeps the same count in each group and a
    group-limited native router still works after pruning. Ties go to the lowest id.
    """
    squeeze = gram.dim() == 2
    g = (gram.unsqueeze(0) if squeeze else gram).to(torch.float64)
    batch, n, _ = g.shape
    if n % num_groups:
        raise ValueError(f"{n} experts cannot be split into {num_groups} equal groups.")
    rows = torch.arange(batch, device=g.device)
    correlation = g.sum(dim=1)  # <Y, V_e> = sum_f G[f, e]
    atom_energy = g.diagonal(dim1=1, dim2=2)
    signal_energy = g.sum(dim=(1, 2))
    eligible = torch.ones(batch, n, dtype=torch.bool, device=g.device)
    group_of = torch.arange(n, device=g.device) // (n // num_groups)
    group_count = torch.zeros(batch, num_groups, dtype=torch.long, device=g.device)
    order = torch.empty(batch, n, dtype=torch.long, device=g.device)
    gains = torch.full((batch, n, n), float("-inf"), dtype=torch.float64, device=g.device)
    residual = torch.empty(batch, n + 1, dtype=torch.float64, device=g.device)
    residual[:, 0] = signal_energy
    for step in range(n):
        allowed = eligible
        if num_groups > 1:
            least = group_count.min(dim=1, keepdim=True).values
            allowed = eligible & (group_count == least).gather(1, group_of.expand(batch, n))
        gain = (2.0 * correlation - atom_energy).masked_fill(~allowed, float("-inf"))
        chosen = gain.argmax(dim=1)
        gains[:, step] = gain
        order[:, step] = chosen
        residual[:, step + 1] = residual[:, step] - gain[rows, chosen]
        correlation = correlation - g[rows, chosen]
        eligible[rows, chosen] = False
        if num_groups > 1:
            group_count[rows, group_of[chosen]] += 1
    residual = residual / signal_energy.clamp(min=torch.finfo(torch.float64).tiny).unsqueeze(1)
    result = PursuitResult(order=order, residual=residual, gains=gains)
    if squeeze:
        result = PursuitResult(order=order[0], residual=residual[0], gains=gains[0])
    return result


def prefix_residual(gram: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Normalized residual ``r(k)`` of keeping the first ``k`` experts of any ``order``.

    ``||Y - sum_{first k} V||^2`` equals the energy of the atoms left out, ``1_U^T G 1_U``.
    """
    g = gram.to(torch.float64)
    permuted = g[order][:, order]
    n = order.numel()
    # Energy of the suffix order[k:], for k = 0..N, from a reversed 2-D cumulative sum.
    suffix = permuted.flip(0, 1).cumsum(0).cumsum(1).diagonal().flip(0)
    energies = torch.cat([suffix, suffix.new_zeros(1)])
    total = energies[0].clamp(min=torch.finfo(torch.float64).tiny)
    return energies[: n + 1] / total


def routing_coverage(routing_mass: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``C(k)``: share of calibration routing mass held by the first ``k`` experts, ``k = 0..N``."""
    mass = routing_mass.to(torch.float64)
    share = mass / mass.sum().clamp(min=torch.finfo(torch.float64).tiny)
    return torch.cat([share.new_zeros(1), share[order].cumsum(0)])


def pursuit_on_atoms(atoms: torch.Tensor) -> tuple[list[int], list[float]]:
    """Algorithm 1 run literally on cached atoms ``(N, tokens, d)``: the reference the Gram path must match.

    Holds every atom in memory (the paper's way); use it to validate and benchmark, not to prune.
    """
    atoms = atoms.to(torch.float64)
    residual = atoms.sum(dim=0)
    signal = float(residual.square().sum())
    remaining = list(range(atoms.shape[0]))
    order: list[int] = []
    curve = [1.0]
    for _ in range(atoms.shape[0]):
        gains = torch.stack([2.0 * (residual * atoms[e]).sum() - atoms[e].square().sum() for e in remaining])
        best = remaining[int(gains.argmax())]
        residual = residual - atoms[best]
        remaining.remove(best)
        order.append(best)
        curve.append(float(residual.square().sum()) / signal)
    return order, curve
