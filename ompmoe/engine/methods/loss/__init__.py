"""Loss-aware family: the statistics seen through the language-model loss's gradient (:mod:`.statistics`,
``statistics=["loss_aware"]``) and the methods and allocations that rank and budget in loss units (:mod:`.selection`)."""

from . import statistics, selection  # noqa: F401,I001  (registers the extension, the methods and the allocations)
from .statistics import LOSS_TENSORS, LossAwareError, LossAwareStatistics
from .selection import greedy_quadratic

__all__ = ["LOSS_TENSORS", "LossAwareError", "LossAwareStatistics", "greedy_quadratic"]
