"""OMP-MoE: training-free expert pruning for Mixture-of-Experts LLMs.

Stream each MoE layer's Gram matrix of expert contributions in one forward pass
(:func:`collect_stats`), order experts by greedy binary pursuit and allocate a budget across
layers (:func:`plan_pruning`), then slice the model (:func:`prune`) and reload it
(:func:`load_pruned`).
"""

__version__ = "0.1.0"

from .adapters import ARCHITECTURES, MoELayer, UnsupportedModelError, find_moe_layers, supported_model_types
from .adaptive import adaptive_report, adaptive_summary, disable_adaptive, enable_adaptive, reset_adaptive_counters
from .allocation import InfeasibleBudgetError
from .collect import CalibrationInputError, StatisticsCollector, collect_stats
from .finetune import load_balancing_loss
from .io import OutputExistsError, OutputNotReplaceableError, OutputNotWritableError
from .plan import LayerPlan, PlanMismatchError, PruningPlan, plan_pruning
from .pruning import load_pruned, prune, pruning_info, save_pruned
from .quantization import QuantizedModelError, quantization_summary, quantize_experts
from .selection import greedy_pursuit
from .statistics import FingerprintMismatchError, LayerStats, MoEStats, StatsFileError, model_fingerprint
from .summary import kept_summary
from .strategies import (
    STRATEGIES,
    EANStrategy,
    ExactStrategy,
    FrequencyStrategy,
    OMPStrategy,
    OMPSwapStrategy,
    PruningStrategy,
    RandomStrategy,
    REAPStrategy,
    RoutingMassStrategy,
    StaticEnergyStrategy,
    TokenNormalizedOMPStrategy,
    strategy_for,
)

__all__ = [
    "QuantizedModelError",
    "load_balancing_loss",
    "kept_summary",
    "quantization_summary",
    "quantize_experts",
    "ARCHITECTURES",
    "EANStrategy",
    "ExactStrategy",
    "FrequencyStrategy",
    "OMPSwapStrategy",
    "REAPStrategy",
    "RandomStrategy",
    "RoutingMassStrategy",
    "STRATEGIES",
    "StaticEnergyStrategy",
    "TokenNormalizedOMPStrategy",
    "FingerprintMismatchError",
    "InfeasibleBudgetError",
    "LayerPlan",
    "LayerStats",
    "MoELayer",
    "MoEStats",
    "OMPStrategy",
    "OutputExistsError",
    "OutputNotReplaceableError",
    "OutputNotWritableError",
    "PlanMismatchError",
    "StatsFileError",
    "CalibrationInputError",
    "PruningPlan",
    "PruningStrategy",
    "StatisticsCollector",
    "UnsupportedModelError",
    "adaptive_report",
    "adaptive_summary",
    "collect_stats",
    "disable_adaptive",
    "enable_adaptive",
    "find_moe_layers",
    "greedy_pursuit",
    "load_pruned",
    "model_fingerprint",
    "plan_pruning",
    "prune",
    "pruning_info",
    "reset_adaptive_counters",
    "save_pruned",
    "strategy_for",
    "supported_model_types",
    "__version__",
]

# Lightning-based classes, imported on first access so that ``import ompmoe`` never needs lightning.
# Add an entry ``name -> submodule`` here to expose another one the same way.
_LAZY_ATTRIBUTES: dict[str, str] = {
    "CalibrationDataModule": ".calibration_data",
    "CalibrationModule": ".calibration_module",
    "write_plots": ".plots",  # needs matplotlib
    "FinetuneModule": ".finetune_module",
    "FinetuneDataModule": ".finetune_data",
}


from ._lazy import lazy_attributes  # noqa: E402

__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY_ATTRIBUTES)
