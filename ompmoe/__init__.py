"""OMP-MoE: training-free expert pruning for Mixture-of-Experts LLMs.

Stream each MoE layer's Gram matrix of expert contributions in one forward pass
(:func:`collect_stats`), order experts by greedy binary pursuit and allocate a budget across
layers (:func:`plan_pruning`), then slice the model (:func:`prune`) and reload it
(:func:`load_pruned`).
"""

__version__ = "0.1.0"

from .engine.adapters import (
    ARCHITECTURES,
    ArchitectureSpec,
    MoELayer,
    UnsupportedModelError,
    find_moe_layers,
    register_architecture,
    supported_model_types,
)
from .engine.adaptive import adaptive_report, adaptive_summary, disable_adaptive, enable_adaptive, reset_adaptive_counters
from .engine.allocation import ALLOCATIONS, AllocationProblem, InfeasibleBudgetError, register_allocation
from .engine.collect import CalibrationInputError, StatisticsCollector, collect_stats
from .engine.io import OutputExistsError, OutputNotReplaceableError, OutputNotWritableError
from .engine.plan import LayerPlan, PlanMismatchError, PruningPlan, plan_pruning
from .engine.pruning import load_pruned, prune, pruning_info, save_pruned
from .engine.quantized import QuantizedModelError
from .engine.selection import greedy_pursuit
from .engine.statistics import FingerprintMismatchError, LayerStats, MoEStats, StatsFileError, model_fingerprint
from .engine.summary import kept_summary
from .engine.methods import METHODS, SelectionMethod, SubsetSelection, get_method, register_method
from .engine.strategy import (
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
    Strategy,
    TokenNormalizedOMPStrategy,
    strategy_for,
)

__all__ = [
    "ALLOCATIONS",
    "ArchitectureSpec",
    "register_architecture",
    "AllocationProblem",
    "METHODS",
    "SelectionMethod",
    "Strategy",
    "SubsetSelection",
    "get_method",
    "register_allocation",
    "register_method",
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
    "CalibrationDataModule": ".lightning.calibration_data",
    "CalibrationModule": ".lightning.calibration_module",
    "write_plots": ".recipes.plots",  # needs matplotlib
    "FinetuneModule": ".lightning.finetune_module",
    "FinetuneDataModule": ".lightning.finetune_data",
    # Recipes, so that ``import ompmoe`` loads the engine only.
    "load_balancing_loss": ".recipes.finetune",
    "quantization_summary": ".recipes.quantization",
    "quantize_experts": ".recipes.quantization",
}


from ._compat import install as _install_moved_modules  # noqa: E402
from ._lazy import lazy_attributes  # noqa: E402

_install_moved_modules()

__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY_ATTRIBUTES)
