"""Rerouting-aware selection: the paper's pursuit on the Gram of what removing an expert really changes.

The paper scores a kept set by ``||sum_{e removed} V_e||^2``, as if a token's output simply lost
the removed experts' contributions. After pruning, the native router gives the token's free slot
to its next expert by routing score and renormalizes the weights, which makes up for part of the
loss. ``omp_reroute`` runs the same greedy binary pursuit on the rerouting-aware Gram
``sum_x <D_e(x), D_f(x)>`` (token-normalized by default, like ``omp_normalized``), with ``D_e(x)``
the output change of the single removal of ``e`` (:mod:`ompmoe.engine.reroute_stats`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from ..statistics import LayerStats
from .omp import omp_orderings
from .registry import Selection, SelectionMethod, register_method, require_layer_tensor


def check_reroute_not_needed(strategy: object) -> None:
    """Refuse, before calibration, a strategy whose method needs rerouting-aware statistics."""
    if getattr(strategy, "method", None) == OMPReroute.name:
        raise ValueError(
            "The strategy's method 'omp_reroute' needs rerouting-aware statistics, which this calibration would "
            "not collect: pass ExpertPruning(..., reroute=True)."
        )


@register_method
@dataclass
class OMPReroute(SelectionMethod):
    """greedy pursuit on the rerouting-aware Gram `sum_x <D_e(x), D_f(x)> / ||Y_x||^2`, `D_e` = output change when `e` is removed and the router re-routes (statistics collected with reroute=True)"""

    name: ClassVar[str] = "omp_reroute"
    token_normalized: bool = True
    """Weight each token by ``1 / ||Y_x||^2`` (``gram_reroute_normalized``) or not (``gram_reroute``)."""

    def select(self, layers: Sequence[LayerStats]) -> list[Selection]:
        key = "gram_reroute_normalized" if self.token_normalized else "gram_reroute"
        require_layer_tensor(layers, key, "Method 'omp_reroute'", "rerouting-aware",
                             "ompmoe.collect_stats(model, batches, reroute=True)")
        return list(omp_orderings([dataclasses.replace(layer, gram=getattr(layer, key)) for layer in layers]))
