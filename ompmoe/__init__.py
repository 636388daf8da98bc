"""OMP-MoE: training-free expert pruning for Mixture-of-Experts LLMs.

Stream each MoE layer's Gram matrix of expert contributions in one forward pass
(:func:`collect_stats`), order experts by greedy binary pursuit and allocate a budget across
layers (:func:`plan_pruning`), then slice the model (:func:`prune`) and reload it
(:func:`load_pruned`).
"""

__version__ = "0.1.0"

from .adapters import ARCHITECTURES, MoELayer, UnsupportedModelError, find_moe_layers, supported_model_types
from .allocation import InfeasibleBudgetError
from .collect import StatisticsCollector, collect_stats
from .io import OutputExistsError
from .plan import LayerPlan, PruningPlan, plan_pruning
from .pruning import load_pruned, prune, pruning_info, save_pruned
from .selection import greedy_pursuit
from .statistics import FingerprintMismatchError, LayerStats, MoEStats, model_fingerprint
from .strategies import OMPStrategy, PruningStrategy

__all__ = [
    "ARCHITECTURES",
    "FingerprintMismatchError",
    "InfeasibleBudgetError",
    "LayerPlan",
    "LayerStats",
    "MoELayer",
    "MoEStats",
    "OMPStrategy",
    "OutputExistsError",
    "PruningPlan",
    "PruningStrategy",
    "StatisticsCollector",
    "UnsupportedModelError",
    "collect_stats",
    "find_moe_layers",
    "greedy_pursuit",
    "load_pruned",
    "model_fingerprint",
    "plan_pruning",
    "prune",
    "pruning_info",
    "save_pruned",
    "supported_model_types",
    "__version__",
]

# Lightning-based classes, imported on first access so that ``import ompmoe`` never needs lightning.
# Add an entry ``name -> submodule`` here to expose another one the same way.
_LAZY_ATTRIBUTES: dict[str, str] = {
    "CalibrationDataModule": ".calibration_data",
    "CalibrationModule": ".calibration_module",
}


def __getattr__(name: str):
    module = _LAZY_ATTRIBUTES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_ATTRIBUTES})
