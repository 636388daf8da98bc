"""OMP-MoE's greedy binary pursuit (the paper's method, ``omp``) and the class every pursuit on another Gram uses."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..collect.statistics import LayerStats
from ..planning.method_registry import Selection, SelectionMethod, register_method, require_statistic
from ..planning.selection import greedy_pursuit


def omp_orderings(layers: Sequence[LayerStats]) -> list[torch.Tensor]:
    """Greedy binary pursuit on each layer's Gram, batched over layers of the same shape."""
    shapes: dict[tuple[int, int], list[int]] = {}
    for i, layer in enumerate(layers):
        shapes.setdefault((layer.num_experts, layer.num_groups), []).append(i)
    orders: dict[int, torch.Tensor] = {}
    for (_, num_groups), indices in shapes.items():
        result = greedy_pursuit(torch.stack([layers[i].gram for i in indices]), num_groups=num_groups, with_gains=False)
        orders.update(zip(indices, result.order))
    return [orders[i] for i in range(len(layers))]


@dataclass
class GramPursuit(SelectionMethod):
    """Base of every greedy binary pursuit (the paper's Algorithm 1), parameterized by the Gram it pursues: a subclass
    names the statistics tensor in ``gram_key``, or overrides :meth:`gram_keys` (and :meth:`pursued_gram`)."""

    gram_key: ClassVar[str] = "gram"
    """The :class:`~ompmoe.engine.collect.statistics.LayerStats` tensor the pursuit runs on."""

    def gram_keys(self) -> tuple[str, ...]:
        """The statistics tensors :meth:`pursued_gram` reads."""
        return (self.gram_key,)

    def pursued_gram(self, layer: LayerStats) -> torch.Tensor:
        return getattr(layer, self.gram_keys()[0])

    def select(self, layers: Sequence[LayerStats]) -> list[Selection]:
        for key in self.gram_keys():
            require_statistic(layers, key, f"Method {self.name!r}")
        return omp_orderings([dataclasses.replace(layer, gram=self.pursued_gram(layer)) for layer in layers])


@register_method
@dataclass
class OMP(GramPursuit):
    """greedy binary pursuit (the paper)"""

    name: ClassVar[str] = "omp"


@register_method
@dataclass
class OMPNormalized(GramPursuit):
    """greedy pursuit on the token-normalized Gram `sum_x V(x) V(x)^T / ||Y_x||^2`

    Each token's routed output then has unit energy, so a few high-norm tokens cannot decide the selection."""

    name: ClassVar[str] = "omp_normalized"
    gram_key: ClassVar[str] = "gram_normalized"
