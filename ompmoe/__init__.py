"""OMP-MoE: training-free expert pruning for Mixture-of-Experts LLMs.

Stream each MoE layer's Gram matrix of expert contributions in one forward pass (:func:`collect_stats`), order experts
by greedy binary pursuit and allocate a budget across layers (:func:`plan_pruning`), then slice the model
(:func:`prune`) and reload it (:func:`load_pruned`).
"""

from ._lazy import lazy_attributes
from .engine.version import __version__

# Submodule -> the attributes it provides, imported on first access: ``import ompmoe`` (and ``ompmoe --help``)
# loads neither torch nor Lightning. Add a name here to expose it the same way.
_LAZY_MODULES: dict[str, tuple[str, ...]] = {
    ".engine.adapters": ("ARCHITECTURES", "ArchitectureSpec", "MoELayer", "UnsupportedModelError", "find_moe_layers",
                         "register_architecture", "supported_model_types"),
    ".engine.apply.adaptive": ("adaptive_report", "adaptive_summary", "disable_adaptive", "enable_adaptive",
                         "reset_adaptive_counters"),
    ".engine.planning.allocation": ("ALLOCATIONS", "AllocationProblem", "InfeasibleBudgetError", "register_allocation"),
    ".engine.collect.collector": ("CalibrationInputError", "StatisticsCollector", "collect_stats"),
    ".engine.collect.layerwise": ("LayerwiseUnsupportedError", "collect_stats_layerwise"),
    ".engine.export.streamed": ("save_pruned_from_files",),
    ".engine.apply.compensation": ("Compensation", "CompensationError", "compensate"),
    ".engine.io": ("OutputExistsError", "OutputNotReplaceableError", "OutputNotWritableError"),
    ".engine.perplexity": ("perplexity",),
    ".engine.apply.plan_choice": ("PlanChoice", "choose_plan"),
    ".engine.apply.trial": ("pruned_view",),
    ".engine.ranks": ("LocalContext",),
    ".engine.run": ("PruningRun", "RunOptions"),
    ".engine.planning.plan": ("LayerPlan", "PlanMismatchError", "PruningPlan", "plan_pruning"),
    ".engine.apply.pruning": ("prune",),
    ".engine.record": ("pruning_info",),
    ".engine.export.save": ("save_pruned",),
    ".engine.export.load": ("load_pruned",),
    ".engine.apply.quantized": ("QuantizedModelError",),
    ".engine.quantized_files": ("QuantizedCheckpointError",),
    ".engine.planning.selection": ("greedy_pursuit",),
    ".engine.collect.statistics": ("FingerprintMismatchError", "LayerStats", "MoEStats", "StatsFileError", "model_fingerprint"),
    ".engine.summary": ("kept_summary",),
    ".engine.planning.method_registry": ("METHODS", "SelectionMethod", "SubsetSelection", "get_method", "register_method"),
    ".engine.planning.strategy": ("PruningStrategy", "Strategy", "strategy_for"),
    ".recipes.finetune": ("load_balancing_loss",),
    ".recipes.quantization": ("quantization_summary", "quantize_experts"),
    # Left out of ``__all__``: they need Lightning (or matplotlib), which ``from ompmoe import *`` must not import.
    ".lightning.calibration_data": ("CalibrationDataModule",),
    ".lightning.calibration_module": ("CalibrationModule",),
    ".lightning.fabric": ("FabricCalibration",),
    ".lightning.finetune_module": ("FinetuneModule",),
    ".lightning.finetune_data": ("FinetuneDataModule",),
    ".engine.export.plots": ("write_plots",),
}
_LAZY_ATTRIBUTES = {name: module for module, names in _LAZY_MODULES.items() for name in names}

__all__ = ["__version__", *(name for name, module in _LAZY_ATTRIBUTES.items()
                            if not module.startswith((".lightning", ".engine.export.plots")))]

# Importing the methods registers the built-in methods, allocations and statistics, which loading statistics needs.
__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY_ATTRIBUTES, first=".engine.methods")
