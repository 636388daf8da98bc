"""AdaptiveInferenceMonitor: a Lightning callback that logs OMP-MoE+ adaptive-inference counters and can
switch adaptive inference on (how ``--trainer.callbacks`` turns it on from the command line).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from ompmoe.engine.apply.adaptive import (
    adaptive_histograms,
    adaptive_info,
    adaptive_totals,
    enable_adaptive,
    is_adaptive,
    layer_counts,
    reset_adaptive_counters,
    restore_adaptive,
)
from ompmoe.engine.collect.statistics import MoEStats

from .pruning import find_hf_model


class AdaptiveInferenceMonitor(pl.Callback):
    """Log OMP-MoE+ counters at the end of validation and test epochs (sanity checks excluded).

    Logged through ``LightningModule.log``: ``<stage>/adaptive/avg_experts_per_token``, ``skip_ratio`` and
    ``flops_ratio`` over all MoE layers (``<stage>``: ``val`` or ``test``), with ``per_layer`` also as
    ``<stage>/adaptive/<layer name>/<counter>``; counters are summed over ranks. The last report is ``self.report``.

    Args:
        epsilon: Switch adaptive inference on (or change its epsilon) when validation or testing starts.
            ``None`` keeps the model's setting (re-applying the saved one after plain ``from_pretrained``).
        stats: A ``stats.safetensors`` (or :class:`ompmoe.MoEStats`) giving the alphas when ``epsilon`` is
            set; defaults to the alphas saved with the model. Statistics of the unpruned model work too.
        per_layer: Also log per-layer counters.
        model_attribute: Attribute of the LightningModule holding the model, if not ``model``.
    """

    def __init__(self, epsilon: float | None = None, stats: str | None = None, per_layer: bool = True,
                 model_attribute: str | None = None) -> None:
        if epsilon is not None and not 0.0 <= float(epsilon) <= 1.0:
            raise ValueError(f"epsilon must lie in [0, 1]; got {epsilon}.")
        self.epsilon = epsilon
        self.stats = stats
        self.per_layer = per_layer
        self.model_attribute = model_attribute
        self.report: dict[str, dict[str, Any]] = {}
        self._warned = False

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = find_hf_model(pl_module, self.model_attribute)
        if self.epsilon is not None:
            source: Any = self.stats
            if source is None:
                record = adaptive_info(model)
                if not record:
                    raise ValueError(
                        "AdaptiveInferenceMonitor(epsilon=...) needs `stats` (a stats.safetensors of this model "
                        "or of the model it was pruned from) unless the model was saved with adaptive inference."
                    )
                source = record["alphas"]
            elif not isinstance(source, MoEStats):
                source = self.stats = MoEStats.load(source)  # read once
            enable_adaptive(model, source, float(self.epsilon))
            rank_zero_info(f"ompmoe: adaptive inference on (epsilon={float(self.epsilon):g})")
        elif not is_adaptive(model) and not restore_adaptive(model) and not self._warned:
            rank_zero_warn(
                "AdaptiveInferenceMonitor: adaptive inference is off and the model carries no saved setting; "
                "pass `epsilon` (and `stats`) to switch it on. Nothing will be logged."
            )
            self._warned = True

    on_test_start = on_validation_start

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        reset_adaptive_counters(find_hf_model(pl_module, self.model_attribute))

    on_test_epoch_start = on_validation_epoch_start

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._log(trainer, pl_module, "val")

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log(trainer, pl_module, "test")

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        histograms = adaptive_histograms(find_hf_model(pl_module, self.model_attribute))
        if not histograms:
            return
        report: dict[str, dict[str, Any]] = {}
        for name, (histogram, top_k) in histograms.items():
            summed = trainer.strategy.reduce(histogram.to(pl_module.device, torch.float64), reduce_op="sum")
            report[name] = layer_counts(summed.round().to(torch.long), top_k)
        self.report = report
        totals = adaptive_totals(report)
        if not totals["tokens"]:
            return
        prefix = f"{stage}/adaptive"
        keys = ("avg_experts_per_token", "skip_ratio", "flops_ratio")
        metrics = {f"{prefix}/{key}": float(totals[key]) for key in keys}
        if self.per_layer:
            for name, counts in report.items():
                metrics.update({f"{prefix}/{name}/{key}": float(counts[key]) for key in keys})
        pl_module.log_dict(metrics, on_step=False, on_epoch=True, sync_dist=False)


__all__ = ["AdaptiveInferenceMonitor"]
