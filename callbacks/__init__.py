"""Lightning callbacks of ompmoe (installed as ``ompmoe.callbacks``; needs ``lightning``)."""

from .adaptive import AdaptiveInferenceMonitor
from .pruning import OMPMoEPruning, find_hf_model

__all__ = ["AdaptiveInferenceMonitor", "OMPMoEPruning", "find_hf_model"]
