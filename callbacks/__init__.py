"""Lightning callbacks of ompmoe (installed as ``ompmoe.callbacks``; needs ``lightning``)."""

from .pruning import OMPMoEPruning, find_hf_model

__all__ = ["OMPMoEPruning", "find_hf_model"]
