"""Rerouting-aware selection: the paper's pursuit on the Gram of what removing an expert really changes, once the
router gives the token's free slot to its next expert (which ``||sum_{e removed} V_e||^2`` ignores)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...planning.method_registry import register_method
from ..omp import GramPursuit


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
