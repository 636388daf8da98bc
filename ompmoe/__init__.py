"""OMP-MoE: training-free expert pruning for Mixture-of-Experts LLMs.

Stream each MoE layer's Gram matrix of expert contributions in one forward pass
(:func:`collect_stats`), order experts by greedy binary pursuit and allocate a budget across
layers (:func:`plan_pruning`), then slice the model (:func:`prune`) and reload it
(:func:`load_pruned`).
"""

from .engine.version import __version__


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
    "FingerprintMismatchError",
    "InfeasibleBudgetError",
    "LayerPlan",
    "LayerStats",
    "MoELayer",
    "MoEStats",
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
    "pruned_view",
    "choose_plan",
    "PlanChoice",
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
    # The engine: loaded on first use too, so `ompmoe --help` answers without importing torch.
    "ARCHITECTURES": ".engine.adapters",
    "ArchitectureSpec": ".engine.adapters",
    "MoELayer": ".engine.adapters",
    "UnsupportedModelError": ".engine.adapters",
    "find_moe_layers": ".engine.adapters",
    "register_architecture": ".engine.adapters",
    "supported_model_types": ".engine.adapters",
    "adaptive_report": ".engine.adaptive",
    "adaptive_summary": ".engine.adaptive",
    "disable_adaptive": ".engine.adaptive",
    "enable_adaptive": ".engine.adaptive",
    "reset_adaptive_counters": ".engine.adaptive",
    "ALLOCATIONS": ".engine.allocation",
    "AllocationProblem": ".engine.allocation",
    "InfeasibleBudgetError": ".engine.allocation",
    "register_allocation": ".engine.allocation",
    "CalibrationInputError": ".engine.collect",
    "StatisticsCollector": ".engine.collect",
    "collect_stats": ".engine.collect",
    "OutputExistsError": ".engine.io",
    "OutputNotReplaceableError": ".engine.io",
    "OutputNotWritableError": ".engine.io",
    "PlanChoice": ".engine.plan_choice",
    "choose_plan": ".engine.plan_choice",
    "pruned_view": ".engine.trial",
    "LayerPlan": ".engine.plan",
    "PlanMismatchError": ".engine.plan",
    "PruningPlan": ".engine.plan",
    "plan_pruning": ".engine.plan",
    "load_pruned": ".engine.pruning",
    "prune": ".engine.pruning",
    "pruning_info": ".engine.pruning",
    "save_pruned": ".engine.pruning",
    "QuantizedModelError": ".engine.quantized",
    "greedy_pursuit": ".engine.selection",
    "FingerprintMismatchError": ".engine.statistics",
    "LayerStats": ".engine.statistics",
    "MoEStats": ".engine.statistics",
    "StatsFileError": ".engine.statistics",
    "model_fingerprint": ".engine.statistics",
    "kept_summary": ".engine.summary",
    "METHODS": ".engine.methods",
    "SelectionMethod": ".engine.methods",
    "SubsetSelection": ".engine.methods",
    "get_method": ".engine.methods",
    "register_method": ".engine.methods",
    "PruningStrategy": ".engine.strategy",
    "Strategy": ".engine.strategy",
    "strategy_for": ".engine.strategy",
    "CalibrationDataModule": ".lightning.calibration_data",
    "CalibrationModule": ".lightning.calibration_module",
    "FabricCalibration": ".lightning.fabric",
    "write_plots": ".recipes.plots",  # needs matplotlib
    "FinetuneModule": ".lightning.finetune_module",
    "FinetuneDataModule": ".lightning.finetune_data",
    # Recipes, so that ``import ompmoe`` loads the engine only.
    "load_balancing_loss": ".recipes.finetune",
    "quantization_summary": ".recipes.quantization",
    "quantize_experts": ".recipes.quantization",
}


from ._lazy import lazy_attributes  # noqa: E402


__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY_ATTRIBUTES)
