"""Lightning callbacks of ompmoe (installed as ``ompmoe.callbacks``; needs ``lightning``)."""

from .adaptive import AdaptiveInferenceMonitor
from .pruning import ExpertPruning, MissingModelError, find_hf_model

__all__ = ["AdaptiveInferenceMonitor", "ExpertPruning", "MissingModelError", "find_hf_model"]
