"""Expert-selection methods: one registry (:mod:`.registry`) and the built-in families registered in it, each with
the statistics it needs (``loss/``, ``reroute/``); a new method is one ``@register_method`` ``@dataclass`` subclass
of :class:`SelectionMethod`, a new kind of statistics one ``@register_statistics`` extension."""

# Importing registers the built-in methods (in the order of the README's method table), allocations and statistics.
from . import omp, scores, subsets, loss, reroute  # noqa: F401,I001
from ..planning.method_registry import (METHODS, Selection, SelectionMethod, SubsetSelection, check_statistics, default_allocation,
                       get_method, method_class, method_table, option_defaults, register_method, removed_energy, required_statistics)
from .omp import omp_orderings
from .scores import ScoreRanking, reap_scores, score_order
from .subsets import EXACT_MAX_SUBSETS, TooManySubsetsError, check_exact_size, exact_subsets, swap_refine

__all__ = [
    "EXACT_MAX_SUBSETS", "METHODS", "ScoreRanking", "Selection", "SelectionMethod", "SubsetSelection",
    "TooManySubsetsError", "check_exact_size", "check_statistics", "default_allocation", "exact_subsets", "get_method", "method_class",
    "method_table", "omp_orderings", "option_defaults", "reap_scores", "register_method", "removed_energy",
    "required_statistics", "score_order", "swap_refine",
]
