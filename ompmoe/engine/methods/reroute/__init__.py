"""Rerouting-aware family: what a token's output becomes when one of its experts is pruned and the router re-routes
(:mod:`.statistics`, ``statistics=["reroute"]``) and the pursuit on that Gram (:mod:`.selection`, ``omp_reroute``)."""

from . import statistics, selection  # noqa: F401,I001  (registers the extension and the method)
from .statistics import REROUTE_TENSORS, RerouteError, RerouteStatistics, check_reroutable

__all__ = ["REROUTE_TENSORS", "RerouteError", "RerouteStatistics", "check_reroutable"]
