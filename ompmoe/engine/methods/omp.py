"""OMP-MoE's greedy binary pursuit (the paper's method, ``omp``) and its token-normalized variant."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..selection import greedy_pursuit
from ..statistics import LayerStats
from .registry import Selection, SelectionMethod, register_method


def omp_orderings(layers: Sequence[LayerStats]) -> list[torch.Tensor]:
    """Greedy binary pursuit on each layer's Gram, batched over layers of the same shape."""
    orders: list[torch.Tensor | None] = [None] * len(layers)
    shapes: dict[tuple[int, int], list[int]] = {}
    for i, layer in enumerate(layers):
        shapes.setdefault((layer.num_experts, layer.num_groups), []).append(i)
    for (_, num_groups), indices in shapes.items():
        grams = torch.stack([layers[i].gram for i in indices])
        result = greedy_pursuit(grams, num_groups=num_groups, with_gains=False)
        for row, i in enumerate(indices):
            orders[i] = result.order[row]
    return orders  # type: ignore[return-value]


@register_method
@dataclass
class OMP(SelectionMethod):
    """greedy binary pursuit (the paper)"""

    name: ClassVar[str] = "omp"

    def select(self, layers: Sequence[LayerStats]) -> list[Selection]:
        return list(omp_orderings(layers))


@register_method
@dataclass
class OMPNormalized(SelectionMethod):
    """greedy pursuit on the token-normalized Gram `sum_x V(x) V(x)^T / ||Y_x||^2`

    Each token's routed output then has unit energy, so a few high-norm tokens cannot decide
    the selection. Needs statistics with ``gram_normalized`` (collected since that version).
    """

    name: ClassVar[str] = "omp_normalized"

    def select(self, layers: Sequence[LayerStats]) -> list[Selection]:
        missing = [layer.name for layer in layers if layer.gram_normalized is None]
        if missing:
            raise ValueError(
                f"Method 'omp_normalized' needs the token-normalized Gram, which these statistics lack "
                f"(layers {missing[:3]}{'...' if len(missing) > 3 else ''}); they were written by an older "
                "ompmoe. Re-run collect_stats (or the calibration fit) to collect it."
            )
        return list(omp_orderings([dataclasses.replace(layer, gram=layer.gram_normalized) for layer in layers]))
