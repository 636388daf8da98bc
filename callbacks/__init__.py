"""Lightning callbacks of ompmoe (installed as ``ompmoe.callbacks``; needs ``lightning``)."""

from .adaptive import AdaptiveInferenceMonitor
from .pruning import ExpertPruning, MissingModelError, OMPMoEPruning, find_hf_model

__all__ = ["AdaptiveInferenceMonitor", "ExpertPruning", "MissingModelError", "OMPMoEPruning", "find_hf_model"]
