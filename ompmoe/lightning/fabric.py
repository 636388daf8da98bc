"""Calibration and pruning inside a Lightning Fabric loop, as :class:`ompmoe.callbacks.ExpertPruning` does in a fit.

The same statistics hooks, exact cross-rank sums, FSDP2 gathering and atomic outputs (the steps of
:mod:`ompmoe.lightning.pruning_steps`) for users who write their own loop; docs/usage.md shows one.
``python -m ompmoe.lightning.fabric_prune`` is a ready-made script built on it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..engine.adapters import architecture_of, find_moe_layers
from ..engine.collect import StatisticsCollector, as_model_inputs, check_calibration_inputs, selected_statistics
from ..engine.io import check_writable, local_inputs
from ..engine.plan import PruningPlan
from ..engine.plan_choice import PlanChoice, choose_plan
from ..engine.statistics import MoEStats
from ..engine.strategy import AUTO, PruningStrategy, Strategy
from .pruning_steps import (
    batch_token_weight, check_adaptive_epsilon, extra_strategies, plan_metrics, prune_and_adapt, real_sample_count,
    require_matplotlib, summary_lines, tries_candidates, unsharded, usable_tokenizer, validate_strategies,
    write_outputs,
)

T = TypeVar("T")
_END = object()

__all__ = ["FabricCalibration", "check_output", "fsdp2", "on_rank_zero"]

FSDP1_MESSAGE = (
    "FabricCalibration shards with FSDP2: use lightning.fabric.strategies.ModelParallelStrategy("
    "parallelize_fn=ompmoe.lightning.fabric.fsdp2, data_parallel_size=N, tensor_parallel_size=1) instead of "
    "FSDPStrategy (strategy='fsdp'), whose flattened FSDP1 parameters cannot be gathered and sliced per expert. "
    "python -m ompmoe.lightning.fabric_prune does this for --strategy fsdp (and for fabric run --strategy fsdp)."
)


def fsdp2(model: nn.Module, device_mesh: Any) -> nn.Module:
    """``parallelize_fn`` for Fabric's ``ModelParallelStrategy``: FSDP2 on each decoder layer, then the root.

    Each decoder layer's weights (its experts included) are gathered whole for its forward and
    freed after, so calibration sees full experts while a rank holds ``1/N`` of the model at rest.
    """
    from .calibration_module import shard_model

    names = getattr(device_mesh, "mesh_dim_names", None) or ()
    shard_model(model, device_mesh["data_parallel"] if "data_parallel" in names else device_mesh)
    return model


def on_rank_zero(fabric: Any, function: Callable[[], T]) -> T:
    """``function()`` run on rank 0 only, its result (or its exception) given to every rank.

    Every rank raises the same error, so none is left waiting in a collective for a rank that stopped.
    """
    result: Any = None
    error: BaseException | None = None
    if fabric.global_rank == 0:
        try:
            result = function()
        except Exception as caught:  # handed to every rank below, then raised on each
            error = caught
    if fabric.world_size > 1:
        result, error = fabric.broadcast((result, error), src=0)
    if error is not None:
        raise error
    return result


def check_output(fabric: Any, output_dir: str | Path, overwrite: bool = False, inputs: Iterable[str] = ()) -> Path:
    """Refuse, on every rank and before any model work, an ``output_dir`` that exists (without ``overwrite``),
    cannot be written, or holds the run's ``inputs``; rank 0 (the one that writes) decides."""
    return on_rank_zero(fabric, lambda: check_writable(output_dir, overwrite, directory=True, inputs=list(inputs)))


def _hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside what ``fabric.setup`` returned (clear error for anything else)."""
    from lightning.fabric.wrappers import _FabricModule

    if not isinstance(model, _FabricModule):
        raise TypeError(
            f"FabricCalibration needs the model returned by fabric.setup(model); got {type(model).__name__}. "
            "Call model = fabric.setup(model) first (it moves the model to the device and wraps it for the strategy)."
        )
    inner = model.module
    if isinstance(inner, nn.parallel.DistributedDataParallel):
        inner = inner.module
    architecture_of(inner)  # a clear error for models ompmoe does not support
    return inner


class FabricCalibration:
    """Gather OMP-MoE statistics in a Fabric loop on every rank, sum them exactly, plan, prune and write once.

    Works on one device, under DDP and under FSDP2 (``ModelParallelStrategy(parallelize_fn=fsdp2)``), in any
    Fabric precision; FSDP1 (``strategy="fsdp"``) is refused. ``output_dir``, the ratio and the strategy's
    statistics are checked here, before any forward pass.

    Args:
        fabric: The launched :class:`lightning.fabric.Fabric`.
        model: The model ``fabric.setup`` returned (a Hugging Face MoE causal LM inside).
        strategy: What to prune; defaults to ``PruningStrategy(method="auto", allocation="auto")`` (ratio 0.5, the
            settings measured for the model's layout, whose statistics are then collected), as ``ExpertPruning``.
        output_dir: Where rank 0 writes ``stats.safetensors``, ``plan.json``, ``plots/`` and ``model/``
            (atomically: a killed run leaves no partial output). ``None`` writes nothing.
        overwrite: Replace an existing ``output_dir`` (one written by ompmoe).
        save_model: Also save the pruned model (with its tokenizer and model card) under ``output_dir/model``.
        extra_ratios: More ratios planned from the same statistics, written as ``plan-<ratio>.json``.
        plots: Also write the plots of :mod:`ompmoe.recipes.plots` (needs matplotlib).
        adaptive_epsilon: Switch on OMP-MoE+ adaptive inference with this epsilon after pruning.
        tokenizer: Tokenizer (object, hub id or path) saved with the model; default: the model's source.
        dtype: Weights dtype of the saved model; default: the source checkpoint's.
        loss_aware: Also collect the loss-aware sums (one backward per batch to the MoE outputs, no
            weight gradients); :meth:`update` runs the forward with gradients for them.
        reroute: Also collect the rerouting-aware Grams (``omp_reroute``).
        statistics: Names of more optional statistics (:data:`ompmoe.engine.extensions.STATISTICS`).
        model_id: Model name recorded in the statistics; default: the config's ``_name_or_path``.
        sources: Calibration sources recorded in the statistics and the model card.
        inputs: Local files the run reads (data files): an ``output_dir`` holding them is never replaced.
    """

    def __init__(
        self,
        fabric: Any,
        model: nn.Module,
        strategy: Strategy | None = None,
        output_dir: str | Path | None = None,
        overwrite: bool = False,
        save_model: bool = True,
        extra_ratios: Sequence[float] | None = None,
        plots: bool = True,
        adaptive_epsilon: float | None = None,
        tokenizer: Any = None,
        dtype: str | None = None,
        loss_aware: bool = False,
        reroute: bool = False,
        statistics: Sequence[str] | None = None,
        model_id: str | None = None,
        sources: Sequence[str] | None = None,
        inputs: Sequence[str] = (),
    ) -> None:
        from lightning.fabric.strategies import FSDPStrategy

        if isinstance(fabric.strategy, FSDPStrategy):
            raise ValueError(FSDP1_MESSAGE)
        check_adaptive_epsilon(adaptive_epsilon)
        self.fabric = fabric
        self.model = model
        self.hf_model = _hf_model(model)
        self.strategy = strategy if strategy is not None else PruningStrategy(method=AUTO, allocation=AUTO)
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.overwrite = overwrite
        self.save_model = save_model
        self.extra_ratios = list(extra_ratios or [])
        self.plots = plots
        self.adaptive_epsilon = adaptive_epsilon
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.statistics = selected_statistics(statistics or (), loss_aware=loss_aware, reroute=reroute)
        model_id = model_id or getattr(self.hf_model.config, "_name_or_path", None) or None
        self._inputs = local_inputs(model_id, tokenizer if isinstance(tokenizer, str) else None, list(inputs))
        if self.output_dir is not None:
            check_output(fabric, self.output_dir, overwrite, self._inputs)
            if plots:
                require_matplotlib("FabricCalibration")
        routings = [(layer.name, layer.routing) for layer in find_moe_layers(self.hf_model)]
        self.model_type = getattr(self.hf_model.config, "model_type", None)
        self.statistics = validate_strategies([self.strategy, *extra_strategies(self.strategy, self.extra_ratios)],
                                              routings, self.statistics, owner="FabricCalibration",
                                              model_type=self.model_type)
        self.collector = StatisticsCollector(self.hf_model, model_id=model_id, sources=list(sources or []),
                                             statistics=self.statistics)
        self.collector.to(fabric.device)
        for ext in self.collector.extensions.values():
            ext.standalone()  # the forward's output is dropped: no step reuses its graph
        self.sharded = any(isinstance(p, DTensor) for p in self.hf_model.parameters())
        """Whether the weights are FSDP2-sharded (every forward is then a collective)."""
        self.needs_gradients = any(ext.needs_gradients for ext in self.collector.extensions.values())
        self.stats: MoEStats | None = None
        self.plan: PruningPlan | None = None
        self.choice: PlanChoice | None = None
        """What ``auto`` tried and chose, when ``finish`` got ``choice_blocks``."""
        self.strategy_used: Strategy = self.strategy
        """The strategy with ``auto`` replaced by the chosen setting (the extra ratios are planned with it)."""
        self.pruned_model: nn.Module | None = None
        self.num_batches = 0
        """Batches this rank has added (including batches of repeats, which add no tokens)."""
        self._loader: Any = None
        self._position = 0
        self._real_samples: int | None = None

    def update(self, batch: Any, dataloader: Any = None) -> None:
        """Run the model on one batch (input ids, or a dict with ``input_ids`` and ``attention_mask``) and add it.

        Pass the ``dataloader`` the batch comes from so the samples its ``DistributedSampler`` repeats are
        not counted. Under DDP the forward is local (ranks may call this unequally often); under FSDP2 it is a
        collective: every rank must call this equally often, or use :meth:`run`.
        """
        self._check_open()
        if dataloader is not None and dataloader is not self._loader:
            self._loader, self._position = dataloader, 0
            self._real_samples = real_sample_count(getattr(dataloader, "sampler", None))
        inputs = as_model_inputs(batch, self.fabric.device)
        check_calibration_inputs(self.hf_model, inputs)  # before the forward: no wrong sums
        num_samples = int(inputs.get("input_ids", inputs.get("inputs_embeds")).shape[0])
        weight = batch_token_weight(inputs, self._position, self._real_samples)
        self._position += num_samples
        self.num_batches += 1
        self._forward(inputs, weight)

    def _forward(self, inputs: dict[str, torch.Tensor], weight: torch.Tensor | None) -> None:
        """One instrumented forward (and the loss-aware backward) with per-token weights ``weight``."""
        ids = inputs.get("input_ids", inputs.get("inputs_embeds"))
        metric = self.collector.metric
        metric.set_token_weight(weight, num_tokens=int(ids.shape[0]) * int(ids.shape[1]))
        was_training = self.hf_model.training
        frozen = [p for p in self.hf_model.parameters() if p.requires_grad] if self.needs_gradients else []
        self.hf_model.eval()  # routers of Mixtral and others jitter in train mode
        try:
            with self.collector, torch.set_grad_enabled(self.needs_gradients), self.fabric.autocast():
                for parameter in frozen:  # the loss-aware backward needs the outputs' gradients only
                    parameter.requires_grad_(False)
                self.hf_model(**inputs, use_cache=False)
        finally:
            metric.token_weight = None
            for parameter in frozen:
                parameter.requires_grad_(True)
            self.hf_model.train(was_training)

    def run(self, dataloader: Iterable[Any]) -> int:
        """:meth:`update` on every batch of ``dataloader``; returns the number of batches of this rank.

        Under FSDP2 a rank whose data ends first runs forwards that count nothing until every rank
        is done, since each forward gathers weights from all ranks.
        """
        self._check_open()
        join = self.sharded and self.fabric.world_size > 1
        iterator = iter(dataloader)
        count = 0
        while True:
            batch = next(iterator, _END)
            if join:
                more = torch.tensor(float(batch is not _END), device=self.fabric.device)
                if not bool(self.fabric.all_reduce(more, reduce_op="max") > 0):
                    break
            if batch is not _END:
                self.update(batch, dataloader)
                count += 1
            elif join:  # out of batches: a forward that counts nothing keeps this rank in the collectives
                ids = torch.zeros(1, 2, dtype=torch.long, device=self.fabric.device)
                self._forward({"input_ids": ids}, torch.zeros(1, 2, dtype=torch.float64, device=self.fabric.device))
            else:
                break
        return count

    def _check_open(self) -> None:
        if self.stats is not None:
            raise RuntimeError("FabricCalibration.finish() was called already; create a new FabricCalibration.")

    def finish(self, choice_blocks: torch.Tensor | None = None) -> PruningPlan:
        """Sum the statistics over ranks, plan on rank 0, prune every rank's model, write the outputs once.

        Every rank must call it (the sums and the gathering of sharded weights are collectives); it returns the
        same plan on each. ``choice_blocks``: token ids ``(num_blocks, seq_len)`` the loop did not feed (e.g.
        ``CalibrationDataModule.choice_blocks()``) on which ``auto`` tries its candidate plans and keeps the one
        with the lowest loss (:func:`ompmoe.choose_plan`); without them it takes the layout's first setting.
        """
        self._check_open()
        fabric = self.fabric
        with warnings.catch_warnings():
            # A rank that got no batch has an empty (zero) share of the sums: that is no mistake here.
            warnings.filterwarnings("ignore", message=r".*was called before the ``update`` method.*")
            stats = self.collector.result()  # torchmetrics sums the states over ranks here
        model = unsharded(self.hf_model, fabric.is_global_zero)
        choice = None
        if choice_blocks is not None and tries_candidates(self.strategy, stats.model_type):
            candidates = self.strategy.candidates(stats)  # type: ignore[attr-defined]
            choice = on_rank_zero(fabric, lambda: choose_plan(model, candidates, choice_blocks))
            plan = candidates[choice.index]
            self.strategy_used = dataclasses.replace(self.strategy, method=plan.method, allocation=plan.allocation)
        else:
            plan = on_rank_zero(fabric, lambda: self.strategy.plan(stats))
        self.choice = choice
        if model is not None:  # under FSDP2 only rank 0 holds (and prunes) the full model
            prune_and_adapt(model, plan, stats, self.adaptive_epsilon)
            self.pruned_model = model
        self.stats, self.plan = stats, plan
        fabric.log_dict(plan_metrics(plan))
        for line in summary_lines(plan, self.strategy, self.model_type, choice):
            fabric.print(line)
        if self.output_dir is not None:
            on_rank_zero(fabric, lambda: write_outputs(
                self.output_dir, stats=stats, plan=plan, model=model, overwrite=self.overwrite, inputs=self._inputs,
                extra=extra_strategies(self.strategy_used, self.extra_ratios), plots=self.plots,
                save_model=self.save_model, tokenizer=usable_tokenizer([self.tokenizer]) if self.save_model else None,
                dtype=self.dtype, show_progress=None))
            fabric.print(f"ompmoe: wrote statistics, plan and pruned model to {self.output_dir}")
        return plan
