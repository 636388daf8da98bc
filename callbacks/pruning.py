"""ExpertPruning: a Lightning callback that turns a calibration ``fit`` into an expert-pruning run.

Statistics stream during training batches on every rank, are summed exactly across ranks, and at the end of
the fit a pruning strategy plans from them and the model is pruned.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from ompmoe.engine.adapters import ARCHITECTURES, find_moe_layers
from ompmoe.engine.collect import StatisticsCollector, check_calibration_inputs, selected_statistics
from ompmoe.engine.io import check_writable, inputs_of, local_inputs
from ompmoe.engine.perplexity import perplexity
from ompmoe.engine.plan import PruningPlan
from ompmoe.engine.plan_choice import PlanChoice, choose_plan
from ompmoe.engine.statistics import MoEStats
from ompmoe.engine.strategy import AUTO, PruningStrategy, Strategy
from ompmoe.lightning.pruning_steps import (
    MODEL_DIR, PLAN_FILE, PLOTS_DIR, STATS_FILE, batch_token_weight, choice_data, check_adaptive_epsilon,
    extra_strategies, plan_metrics, prune_and_adapt, real_sample_count, require_matplotlib, summary_lines,
    unsharded, usable_tokenizer, validate_strategies, write_outputs,
)

__all__ = ["ExpertPruning", "MissingModelError", "find_hf_model", "MODEL_DIR", "PLAN_FILE", "PLOTS_DIR", "STATS_FILE"]


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
        if getattr(getattr(candidate, "config", None), "model_type", None) in ARCHITECTURES:
            return candidate
    raise MissingModelError(
        f"ExpertPruning found no Hugging Face MoE model on {type(pl_module).__name__}: store it as "
        "`self.model` (or pass `model_attribute=`), e.g. use ompmoe.CalibrationModule. Supported "
        f"model types: {', '.join(sorted(ARCHITECTURES))}."
    )


class ExpertPruning(Callback):
    """Gather OMP-MoE statistics during a calibration fit and prune the model when it ends.

    Only training batches count (not sanity checks or validation), without padding tokens or the samples a
    ``DistributedSampler`` repeats to even out the ranks.

    Args:
        strategy: What to prune; default ``PruningStrategy(method="auto", allocation="auto")``: ratio 0.5 with the
            settings measured for the model's layout (the paper's: ``method="omp", allocation="waterfill"``).
            Any object with ``validate(routings)`` and ``plan(stats)`` works.
        output_dir: Where rank 0 writes ``stats.safetensors``, ``plan.json`` and ``model/`` (atomically).
            ``None`` writes nothing.
        overwrite: Replace an existing ``output_dir``.
        save_model: Also save the pruned model (and its tokenizer) under ``output_dir/model``.
        model_attribute: Attribute of the LightningModule holding the model, if not ``model``.
        extra_ratios: More ratios planned from the same statistics, written as ``plan-<ratio>.json`` (prune them
            later with ``ompmoe prune``).
        plots: Also write the plots of :mod:`ompmoe.recipes.plots` under ``output_dir/plots`` (needs matplotlib).
        adaptive_epsilon: After pruning, switch on OMP-MoE+ adaptive inference with this epsilon (the saved
            model carries it; log its counters with :class:`~ompmoe.callbacks.AdaptiveInferenceMonitor`).
        tokenizer: Tokenizer (hub id or path) saved with the model. Default: the LightningModule's
            ``tokenizer``/``tokenizer_name``, else the data module's ``tokenizer``, else the model's source; a
            warning names this argument when none is found.
        dtype: Weights dtype of the saved model (``bfloat16``, ``float32``, ...); default: the source checkpoint's.
        loss_aware: Also collect the loss-aware sums of :mod:`ompmoe.engine.loss_stats` (one backward per batch
            to the MoE outputs; the module's forward must run with gradients, as ``CalibrationModule`` does).
        reroute: Also collect the rerouting-aware Grams of :mod:`ompmoe.engine.reroute_stats` (for ``omp_reroute``;
            one more router call and one expert evaluation per token).
        statistics: Names of more optional statistics to collect (:data:`ompmoe.engine.extensions.STATISTICS`;
            ``loss_aware`` and ``reroute`` are shorthands for two of them).
        evaluate_on: Held-out sets (``heldout:prose``, ``heldout:code`` or any calibration source) on which rank 0
            prints and logs ``heldout_ppl/<set>/original`` and ``.../pruned``.
        evaluate_blocks: Blocks of the data module's ``seq_len`` tokens per held-out set.
        choice_blocks: With ``auto`` on a layout with several settings: blocks of calibration text (the data
            module's ``choice_blocks(n)``) on which each candidate plan is tried, keeping the lowest loss
            (:func:`ompmoe.choose_plan`). ``None``: the data module's default (2,048 tokens' worth); ``0`` (or a
            data module without ``choice_blocks``, with a warning if a number was given): the layout's first setting.
    """

    def __init__(
        self,
        strategy: Strategy | None = None,
        output_dir: str | None = None,
        overwrite: bool = False,
        save_model: bool = True,
        model_attribute: str | None = None,
        extra_ratios: list[float] | None = None,
        plots: bool = True,
        adaptive_epsilon: float | None = None,
        tokenizer: str | None = None,
        dtype: str | None = None,
        loss_aware: bool = False,
        reroute: bool = False,
        evaluate_on: list[str] | None = None,
        evaluate_blocks: int = 8,
        statistics: list[str] | None = None,
        choice_blocks: int | None = None,
    ) -> None:
        if choice_blocks is not None and choice_blocks < 0:
            raise ValueError(f"choice_blocks must be >= 0 (0: no trial of auto's candidate plans); "
                             f"got {choice_blocks}.")
        check_adaptive_epsilon(adaptive_epsilon)
        self.strategy = strategy if strategy is not None else PruningStrategy(method=AUTO, allocation=AUTO)
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.overwrite = overwrite
        self.save_model = save_model
        self.model_attribute = model_attribute
        self.extra_ratios = list(extra_ratios or [])
        self.plots = plots
        self.adaptive_epsilon = adaptive_epsilon
        self.tokenizer = tokenizer
        self.dtype = dtype
        self._datamodule: Any | None = None
        self._model_type: str | None = None
        self.loss_aware = loss_aware
        self.reroute = reroute
        self.statistics = selected_statistics(statistics or (), loss_aware=loss_aware, reroute=reroute)
        self.stats: MoEStats | None = None
        self.plan: PruningPlan | None = None
        self.pruned_model: nn.Module | None = None
        self._collector: StatisticsCollector | None = None
        self._restored: dict[str, Any] | None = None
        self._batch_size = 1
        self._real_samples: int | None = None
        self._progress: bool | None = False
        self._inputs: list[str] = []
        self.evaluate_on = list(evaluate_on or [])
        self.evaluate_blocks = evaluate_blocks
        self.heldout_perplexity: dict[str, tuple[float, float]] = {}
        """``{set: (original, pruned)}`` held-out perplexity, when ``evaluate_on`` names sets (rank 0)."""
        self.choice_blocks = choice_blocks
        self.choice: PlanChoice | None = None
        """What ``auto`` tried and chose (rank 0), when it had blocks to try its candidates on."""
        self._choice_data: torch.Tensor | None = None
        self._chosen: Strategy | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(output_dir=str(self.output_dir), strategy=repr(self.strategy))

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if isinstance(trainer.strategy, FSDPStrategy):
            raise ValueError(
                "ExpertPruning shards with FSDP2: use ModelParallelStrategy(data_parallel_size=N, "
                "tensor_parallel_size=1) (as configs/qwen3-30b-a3b.yaml does) instead of FSDPStrategy, "
                "whose flattened FSDP1 parameters cannot be gathered and sliced per expert."
            )
        if self.output_dir is not None:
            # What the run reads (model, tokenizer, data files) must not lie inside an output it will replace.
            self._inputs = inputs_of(pl_module, getattr(trainer, "datamodule", None)) + local_inputs(self.tokenizer)
            check_writable(self.output_dir, self.overwrite, directory=True, inputs=self._inputs)
            if self.plots:
                require_matplotlib("ExpertPruning")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = find_hf_model(pl_module, self.model_attribute)
        routings = [(layer.name, layer.routing) for layer in find_moe_layers(model)]
        self._model_type = getattr(getattr(model, "config", None), "model_type", None)
        self.statistics = validate_strategies([self.strategy, *self._extra_strategies()], routings, self.statistics,
                                              model_type=self._model_type)
        self._datamodule = datamodule = getattr(trainer, "datamodule", None)
        describe = getattr(datamodule, "describe", None)
        self._collector = StatisticsCollector(
            model,
            model_id=getattr(pl_module, "model_name_or_path", None),
            sources=[describe()] if callable(describe) else None,
            statistics=self.statistics,
        )
        self._collector.to(pl_module.device)
        needs_gradients = any(ext.needs_gradients for ext in self._collector.extensions.values())
        if needs_gradients and hasattr(pl_module, "needs_gradients"):
            pl_module.needs_gradients = True
        if self._restored is not None:
            self._load_metric_state(self._restored)
        self._choice_data = choice_data(self.strategy, datamodule, self.choice_blocks, "ExpertPruning",
                                        self._model_type)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = trainer.train_dataloader
        self._batch_size = int(getattr(loader, "batch_size", None) or 1)
        # Lightning's stateful protocol: only such a loader resumes where it stopped.
        stateful = callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))
        if self._restored is not None and not stateful:
            rank_zero_warn(
                "Resuming a calibration fit with a DataLoader that has no state_dict: Lightning restarts "
                "it from its first batch, so some batches are counted twice and others never. Use "
                "ompmoe.CalibrationDataModule (its loader is resumable) or a stateful DataLoader."
            )
        self._real_samples = real_sample_count(getattr(loader, "sampler", None))

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        inputs = batch if isinstance(batch, dict) else {"input_ids": batch}
        assert self._collector is not None
        check_calibration_inputs(self._collector.model, inputs)  # before the forward: no wrong sums
        ids = inputs.get("input_ids", inputs.get("inputs_embeds"))
        first_sample = batch_idx * self._batch_size  # position on this rank, also after a resume
        weight = batch_token_weight(inputs, first_sample, self._real_samples)
        self._collector.metric.set_token_weight(weight, num_tokens=int(ids.shape[0]) * int(ids.shape[1]))
        self._collector.__enter__()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._collector is not None and self._collector._context is not None:
            self._collector.__exit__(None, None, None)
            self._collector.metric.token_weight = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._collector is not None and self._collector._context is not None:
            self._collector.__exit__(None, None, None)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._collector is not None
        stats = self._collector.result()  # torchmetrics sums the states over ranks here
        # Bars for writing (plots take seconds at 48 x 128) only when Lightning shows its own.
        self._progress = None if trainer.progress_bar_callback is not None else False
        model = unsharded(self._collector.model, trainer.is_global_zero)
        plan = self._plan(trainer, stats, model)
        self.stats, self.plan = stats, plan
        heldout = self._heldout_sets(trainer) if model is not None and trainer.is_global_zero else {}
        before = {name: perplexity(model, blocks, self._batch_size) for name, blocks in heldout.items()}
        if model is not None:  # under FSDP only rank 0 holds (and prunes) the full model
            prune_and_adapt(model, plan, stats, self.adaptive_epsilon)
            self.pruned_model = model
        after = {name: perplexity(model, blocks, self._batch_size) for name, blocks in heldout.items()}
        for logger in trainer.loggers:
            logger.log_metrics(plan_metrics(plan), step=trainer.global_step)
        for line in summary_lines(plan, self.strategy, self._model_type, self.choice):
            rank_zero_info(line)
        if heldout:  # after the settings and kept lines: what the plan cost
            self._report_heldout(trainer, before, after)
        if trainer.is_global_zero and self.output_dir is not None:
            self._write(pl_module, model, stats, plan)
        trainer.strategy.barrier("ompmoe-pruning-written")

    def _plan(self, trainer: pl.Trainer, stats: MoEStats, model: nn.Module | None) -> PruningPlan:
        """The strategy's plan; for ``auto`` with choice blocks, the candidate rank 0 measured best (on every rank)."""
        if self._choice_data is None:
            return self.strategy.plan(stats)
        candidates = self.strategy.candidates(stats)  # type: ignore[attr-defined]  (choice_data checked the strategy)
        if trainer.is_global_zero and model is not None:
            self.choice = choose_plan(model, candidates, self._choice_data, self._batch_size)
        index = trainer.strategy.broadcast(self.choice.index if self.choice is not None else None, src=0)
        plan = candidates[index]
        self._chosen = dataclasses.replace(self.strategy, method=plan.method, allocation=plan.allocation)
        return plan

    def _heldout_sets(self, trainer: pl.Trainer) -> dict[str, torch.Tensor]:
        """The ``evaluate_on`` sets as token blocks, cut by the calibration data module."""
        datamodule = getattr(trainer, "datamodule", None)
        if not self.evaluate_on:
            return {}
        if not hasattr(datamodule, "heldout_blocks"):
            raise ValueError("ExpertPruning(evaluate_on=...) needs a data module with heldout_blocks (e.g. "
                             "ompmoe.CalibrationDataModule) to cut the held-out text; remove evaluate_on or use one.")
        return {name: datamodule.heldout_blocks(name, self.evaluate_blocks) for name in self.evaluate_on}

    def _report_heldout(self, trainer: pl.Trainer, before: dict[str, float], after: dict[str, float]) -> None:
        """Print and log what pruning cost on the held-out sets (per set: original -> pruned perplexity)."""
        self.heldout_perplexity = {name: (before[name], after[name]) for name in before}
        parts = [f"{name} {original:.2f} -> {pruned:.2f}" for name, (original, pruned) in
                 self.heldout_perplexity.items()]
        rank_zero_info(f"ompmoe: held-out perplexity, original -> pruned: {', '.join(parts)}")
        metrics = {f"heldout_ppl/{name}/{kind}": value for name, pair in self.heldout_perplexity.items()
                   for kind, value in zip(("original", "pruned"), pair)}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _extra_strategies(self) -> list[Strategy]:
        """``extra_ratios`` with the strategy's settings (once ``auto`` chose, the chosen setting)."""
        return extra_strategies(self._chosen or self.strategy, self.extra_ratios)

    def _write(self, pl_module: pl.LightningModule, model: nn.Module, stats: MoEStats, plan: PruningPlan) -> None:
        assert self.output_dir is not None
        tokenizer = self.tokenizer
        if tokenizer is None and self.save_model:  # None: save_pruned tries the model's source (and warns)
            owners = ((pl_module, "tokenizer"), (pl_module, "tokenizer_name"), (self._datamodule, "tokenizer"))
            tokenizer = usable_tokenizer(getattr(owner, name, None) for owner, name in owners)
        write_outputs(
            self.output_dir, stats=stats, plan=plan, model=model, overwrite=self.overwrite, inputs=self._inputs,
            extra=self._extra_strategies(), plots=self.plots, save_model=self.save_model,
            tokenizer=tokenizer if self.save_model else None, dtype=self.dtype, show_progress=self._progress,
        )
        rank_zero_info(f"ompmoe: wrote statistics, plan and pruned model to {self.output_dir}")

    @override
    def state_dict(self) -> dict[str, Any]:
        """Statistics summed over all ranks so far; on resume rank 0 carries them on."""
        if self._collector is None:
            return dict(self._restored or {})
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        states: dict[str, torch.Tensor] = {}
        for prefix, metric in self._collector.metrics().items():
            with metric.sync_context(should_sync=distributed):
                states.update({prefix + name: getattr(metric, name).detach().cpu().clone()
                               for name in metric._defaults})
        return {"states": states}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict
        if self._collector is not None:
            self._load_metric_state(state_dict)

    def _load_metric_state(self, state: dict[str, Any]) -> None:
        assert self._collector is not None
        metrics = self._collector.metrics()
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank = torch.distributed.get_rank() if distributed else 0
        for name, value in state.get("states", {}).items():
            prefix = name.split(".", 1)[0] + "." if "." in name else ""
            if prefix not in metrics:
                continue  # statistics this fit does not collect
            target, name = metrics[prefix], name.removeprefix(prefix)
            current = getattr(target, name)
            # Global sums resume on rank 0 only, so the final cross-rank sum stays exact.
            setattr(target, name, value.to(current) if rank == 0 else torch.zeros_like(current))
