"""ExpertPruning: a Lightning callback that turns a calibration ``fit`` into an expert-pruning run.

The run itself (statistics, plan, ``auto``'s choice, pruning, held-out perplexity, outputs) is
:class:`ompmoe.PruningRun`'s; this callback only adapts Lightning's hooks and lends it the Trainer's ranks.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from ompmoe.engine.adapters import ARCHITECTURES, sparse_blocks
from ompmoe.engine.collect.collector import BATCH_CONTRACT, batch_inputs, real_sample_count
from ompmoe.engine.io import inputs_of, local_inputs
from ompmoe.engine.planning.strategy import Strategy
from ompmoe.engine.ranks import RunContext
from ompmoe.engine.run import PruningRun, run_options
from ompmoe.lightning import layer_by_layer
from ompmoe.lightning.fabric import RunResults
from ompmoe.lightning.strategies import check_trainer_strategy, epochs_warning

__all__ = ["ExpertPruning", "MissingModelError", "find_hf_model"]


class MissingModelError(AttributeError, ValueError):
    """The LightningModule holds no supported Hugging Face MoE model (a user error, not a bug)."""


def find_hf_model(pl_module: nn.Module, attribute: str | None = None) -> nn.Module:
    """The Hugging Face MoE model held by ``pl_module`` (``attribute``, ``.model``, or any child)."""
    if attribute is not None:
        model = getattr(pl_module, attribute, None)
        if model is None:
            raise MissingModelError(f"{type(pl_module).__name__} has no attribute {attribute!r} holding the MoE model.")
        return model
    candidates = [getattr(pl_module, "model", None)] + [child for _, child in pl_module.named_children()]
    for candidate in candidates:
        if getattr(candidate, "config", None) is not None and sparse_blocks(candidate):
            return candidate
    held = candidates[0]
    if getattr(held, "config", None) is not None:  # a model where one belongs, but dense or of another layout
        from ompmoe.lightning.calibration_module import check_prunable

        try:
            check_prunable(held)
        except ValueError as error:
            raise MissingModelError(f"ExpertPruning: {type(pl_module).__name__}.model: {error}") from None
    raise MissingModelError(
        f"ExpertPruning found no Hugging Face MoE model on {type(pl_module).__name__}: store it as "
        "`self.model` (or pass `model_attribute=`), e.g. use ompmoe.CalibrationModule. Supported "
        f"model types: {', '.join(sorted(ARCHITECTURES))}."
    )


def trainer_context(trainer: pl.Trainer) -> RunContext:
    """The Trainer's ranks, collectives and loggers, as the run's :class:`~ompmoe.engine.ranks.RunContext`."""

    def log_metrics(metrics: dict[str, float]) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    return RunContext(trainer.is_global_zero, trainer.world_size, trainer.strategy.broadcast, trainer.strategy.barrier,
                      rank_zero_info, rank_zero_warn, log_metrics)


class ExpertPruning(RunResults, pl.Callback):
    """Gather OMP-MoE statistics during a calibration fit and prune the model when it ends.

    Only training batches count (not sanity checks or validation), without padding tokens or the samples a
    ``DistributedSampler`` repeats to even out the ranks. Batches: :data:`~ompmoe.engine.collect.collector.BATCH_CONTRACT`
    (a list is what ``DataLoader(TensorDataset(ids))`` yields), else refused at the first; weights that change (an
    optimizer step) are refused too. Takes every option of :class:`ompmoe.RunOptions`, checked here.

    Args:
        strategy: What to prune (:class:`ompmoe.RunOptions`' ``strategy``; default ``auto``, whose loss-aware
            statistics need the forward to run with gradients).
        model_attribute: Attribute of the LightningModule holding the model, if not ``model``.
        batch_to_inputs: Maps a batch of another format to the model's inputs (a dict with ``input_ids``, optionally
            ``attention_mask``), e.g. ``lambda batch: {"input_ids": batch["tokens"]}``.
    """

    def __init__(self, strategy: Strategy | None = None, model_attribute: str | None = None,
                 batch_to_inputs: Callable[[Any], Any] | None = None, **options: Any) -> None:
        self.pruning = PruningRun(run_options("ExpertPruning", strategy, **options), owner="ExpertPruning")
        if batch_to_inputs is not None and not callable(batch_to_inputs):
            raise ValueError(f"ExpertPruning: batch_to_inputs must be a function from a batch to {BATCH_CONTRACT}; "
                             f"got {type(batch_to_inputs).__name__}.")
        self.model_attribute = model_attribute
        self.batch_to_inputs = batch_to_inputs
        self._restored: dict[str, Any] | None = None
        self._batch_size = 1
        self._real_samples: int | None = None

    @property
    @override
    def state_key(self) -> str:
        output_dir = self.pruning.options.output_dir
        return self._generate_state_key(output_dir=str(Path(output_dir) if output_dir is not None else None),
                                        strategy=repr(self.pruning.strategy))

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":  # validate, test, predict: nothing to calibrate on; said before the fit has pruned
            return None if (unpruned := self.pruning.unpruned_line(stage)) is None else rank_zero_warn(unpruned)
        check_trainer_strategy(trainer.strategy)
        if (too_many := epochs_warning(trainer)) is not None and not self.pruning.options.layer_by_layer:
            rank_zero_warn(too_many)
        if self.pruning.options.layer_by_layer:
            layer_by_layer.prepare(trainer, pl_module)
        # What the run reads (model, tokenizer, data files) must not lie inside an output it will replace.
        inputs = inputs_of(pl_module, getattr(trainer, "datamodule", None))
        self.pruning.check_output(trainer_context(trainer), inputs + local_inputs(self.pruning.options.tokenizer))

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = find_hf_model(pl_module, self.model_attribute)
        datamodule = getattr(trainer, "datamodule", None)
        describe = getattr(datamodule, "describe", None)
        tokenizers = (getattr(owner, name, None) for owner, name in (
            (pl_module, "tokenizer"), (pl_module, "tokenizer_name"), (datamodule, "tokenizer")))
        model_id = getattr(pl_module, "model_name_or_path", None)
        collector = self.pruning.start(model, trainer_context(trainer), model_id=model_id, data=datamodule,
                                       sources=[describe()] if callable(describe) else None, tokenizers=tokenizers)
        collector.to(pl_module.device)
        if self.pruning.needs_gradients and hasattr(pl_module, "needs_gradients"):
            pl_module.needs_gradients = True
        if self._restored is not None:
            collector.load_state_dict(self._restored.get("states", {}))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = trainer.train_dataloader
        self._batch_size = int(getattr(loader, "batch_size", None) or 1)
        # Lightning's stateful protocol: only such a loader resumes where it stopped.
        stateful = callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))
        if self._restored is not None and not stateful:
            rank_zero_warn("Resuming a calibration fit with a DataLoader that has no state_dict: Lightning restarts it "
                           "from its first batch, so some batches are counted twice and others never. Use "
                           "ompmoe.CalibrationDataModule (its loader is resumable) or a stateful DataLoader.")
        self._real_samples = real_sample_count(getattr(loader, "sampler", None))
        if self.pruning.options.layer_by_layer:
            layer_by_layer.calibrate(self.pruning, trainer, pl_module, self.batch_to_inputs)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        inputs = batch_inputs(batch, self.batch_to_inputs, self.pruning.owner)  # the one batch contract
        # the batch's first sample's position on this rank, also after a resume
        self.pruning.begin_batch(inputs, batch_idx * self._batch_size, self._real_samples)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.pruning.end_batch()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.pruning.end_batch()
        self.pruning.release_output()  # Lightning ran the failed forward: the run will not write
        if isinstance(exception, KeyboardInterrupt) and trainer.is_global_zero:  # then Lightning exits with status 1
            done = trainer.fit_loop.epoch_loop.batch_progress.current.completed
            print(self.pruning.interrupted_line(done, trainer.num_training_batches), file=sys.stderr)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Bars for writing (plots take seconds at 48 x 128) only when Lightning shows its own.
        self.pruning.finish(trainer_context(trainer),
                            show_progress=None if trainer.progress_bar_callback is not None else False)

    @override
    def state_dict(self) -> dict[str, Any]:
        """Statistics summed over all ranks so far; on resume rank 0 carries them on."""
        if self.pruning.collector is None:
            return dict(self._restored or {})
        return {"states": self.pruning.collector.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict
        if self.pruning.collector is not None:
            self.pruning.collector.load_state_dict(state_dict.get("states", {}))
