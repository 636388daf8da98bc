"""Algorithm 1 of the paper run literally on cached atoms: what the Gram path must match.

Needs only torch, so the search-cost benchmark (benchmarks/search.py) times it without the test extras.
"""

from __future__ import annotations

import torch


def pursuit_on_atoms(atoms: torch.Tensor) -> tuple[list[int], list[float]]:
    """Algorithm 1 run literally on cached atoms ``(N, tokens, d)``, holding every atom in memory: the reference the
    Gram path must match (to validate and benchmark, not to prune)."""
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
