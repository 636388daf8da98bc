"""Rerouting-aware selection: the paper's pursuit on the Gram of what removing an expert really changes.

The paper scores a kept set by ``||sum_{e removed} V_e||^2``, as if a token's output simply lost
the removed experts' contributions. After pruning, the native router gives the token's free slot
to its next expert by routing score and renormalizes the weights, which makes up for part of the
loss. ``omp_reroute`` runs the same greedy binary pursuit on the rerouting-aware Gram
``sum_x <D_e(x), D_f(x)>`` (token-normalized by default, like ``omp_normalized``), with ``D_e(x)``
the output change of the single removal of ``e`` (:mod:`ompmoe.engine.reroute_stats`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .omp import GramPursuit
from .registry import register_method


@register_method
@dataclass
class OMPReroute(GramPursuit):
    """greedy pursuit on the rerouting-aware Gram `sum_x <D_e(x), D_f(x)> / ||Y_x||^2`, `D_e` = output change when `e` is removed and the router re-routes (statistics collected with reroute=True)"""

    name: ClassVar[str] = "omp_reroute"
    statistics: ClassVar[tuple[str, ...]] = ("reroute",)
    token_normalized: bool = True
    """Weight each token by ``1 / ||Y_x||^2`` (``gram_reroute_normalized``) or not (``gram_reroute``)."""

    def gram_keys(self) -> tuple[str, ...]:
        return ("gram_reroute_normalized" if self.token_normalized else "gram_reroute",)
