"""Calibration and pruning inside a Lightning Fabric loop, as :class:`ompmoe.callbacks.ExpertPruning` does in a fit.

The run is :class:`ompmoe.PruningRun`'s (the same statistics, exact cross-rank sums, FSDP2 gathering and atomic
outputs); this adapter lends it Fabric's ranks. ``python -m ompmoe.lightning.fabric_prune`` is a script built on it.
"""

from __future__ import annotations

import itertools
import sys
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..engine.adapters import architecture_of
from ..engine.apply.plan_choice import PlanChoice
from ..engine.collect.collector import LoaderPosition, as_model_inputs
from ..engine.collect.statistics import MoEStats
from ..engine.io import local_inputs
from ..engine.planning.plan import PruningPlan
from ..engine.planning.strategy import Strategy
from ..engine.ranks import RunContext
from ..engine.run import PruningRun, run_options

_END = object()

__all__ = ["FabricCalibration", "RunResults", "fabric_context", "fsdp2"]

FSDP1_MESSAGE = (
    "FabricCalibration shards with FSDP2: use lightning.fabric.strategies.ModelParallelStrategy("
    "parallelize_fn=ompmoe.lightning.fabric.fsdp2, data_parallel_size=N, tensor_parallel_size=1) instead of "
    "FSDPStrategy (strategy='fsdp'), whose flattened FSDP1 parameters cannot be gathered and sliced per expert. "
    "python -m ompmoe.lightning.fabric_prune does this for --strategy fsdp (and for fabric run --strategy fsdp)."
)


def fsdp2(model: nn.Module, device_mesh: Any) -> nn.Module:
    """``parallelize_fn`` for Fabric's ``ModelParallelStrategy``: FSDP2 on each decoder layer, then the root, so
    each layer's experts are gathered whole for its forward while a rank holds ``1/N`` of the model at rest."""
    from .calibration_module import shard_model

    names = getattr(device_mesh, "mesh_dim_names", None) or ()
    shard_model(model, device_mesh["data_parallel"] if "data_parallel" in names else device_mesh)
    return model


def fabric_context(fabric: Any) -> RunContext:
    """Fabric's ranks, collectives and loggers, as the run's :class:`~ompmoe.engine.ranks.RunContext`."""
    is_global_zero = fabric.global_rank == 0

    def warn(message: str) -> None:
        if is_global_zero:
            warnings.warn(message, stacklevel=3)

    return RunContext(is_global_zero, fabric.world_size, fabric.broadcast, fabric.barrier, fabric.print, warn,
                      fabric.log_dict)


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


class RunResults:
    """What a front door's run (``self.pruning``, a :class:`ompmoe.PruningRun`) found, read-only, once it finished."""

    pruning: PruningRun

    @property
    def stats(self) -> MoEStats | None:
        """The statistics, summed over every rank."""
        return self.pruning.stats

    @property
    def plan(self) -> PruningPlan | None:
        """The plan every rank pruned with."""
        return self.pruning.plan

    @property
    def choice(self) -> PlanChoice | None:
        """What ``auto`` tried and chose (every candidate's loss), when it had blocks to try them on."""
        return self.pruning.choice

    @property
    def pruned_model(self) -> nn.Module | None:
        """The pruned model (under FSDP2, rank 0's full copy; ``None`` on the other ranks)."""
        return self.pruning.pruned_model

    @property
    def heldout_perplexity(self) -> dict[str, tuple[float, float]]:
        """``{set: (original, pruned)}`` perplexity on the ``evaluate_on`` sets (rank 0)."""
        return self.pruning.heldout_perplexity


class FabricCalibration(RunResults):
    """Gather OMP-MoE statistics in a Fabric loop on every rank, sum them exactly, plan, prune and write once.

    Works on one device, under DDP and under FSDP2 (``ModelParallelStrategy(parallelize_fn=fsdp2)``), in any Fabric
    precision; FSDP1 (``strategy="fsdp"``) is refused. Takes every option of :class:`ompmoe.RunOptions` (``strategy``,
    ``output_dir``, ``overwrite``, ``evaluate_on``, ``choice_blocks``, ...), checked here, before any forward pass.

    Args:
        fabric: The launched :class:`lightning.fabric.Fabric`.
        model: The model ``fabric.setup`` returned (a Hugging Face MoE causal LM inside).
        strategy: What to prune (:class:`ompmoe.RunOptions`' ``strategy``; default ``auto``).
        model_id: Model name recorded in the statistics; default: the config's ``_name_or_path``.
        sources: Calibration sources recorded in the statistics and the model card.
        inputs: Local files the run reads (data files): an ``output_dir`` holding them is never replaced.
        data: A data module with ``choice_blocks(n)`` / ``heldout_blocks(name, n)`` (``ompmoe.CalibrationDataModule``)
            for ``auto``'s trial and ``evaluate_on``.
        pruning: A :class:`ompmoe.PruningRun` whose output was checked already (``check_output``), in place of
            ``strategy`` and options (``inputs`` then go unused).
    """

    def __init__(self, fabric: Any, model: nn.Module, strategy: Strategy | None = None, model_id: str | None = None,
                 sources: Sequence[str] | None = None, inputs: Sequence[str] = (), data: Any = None,
                 pruning: PruningRun | None = None, **options: Any) -> None:
        from lightning.fabric.strategies import FSDPStrategy

        if isinstance(fabric.strategy, FSDPStrategy):
            raise ValueError(FSDP1_MESSAGE)
        if pruning is not None and (strategy is not None or options):
            raise ValueError("FabricCalibration takes either pruning= or a strategy and options, not both.")
        self.pruning = pruning or PruningRun(run_options("FabricCalibration", strategy, **options),
                                               owner="FabricCalibration")
        self.fabric, self.model, self.context = fabric, model, fabric_context(fabric)
        self.hf_model = _hf_model(model)
        model_id = model_id or getattr(self.hf_model.config, "_name_or_path", None) or None
        if pruning is None:  # what the run reads (local model, tokenizer, data files) must outlive its output
            self.pruning.check_output(self.context, local_inputs(model_id, self.pruning.options.tokenizer, *inputs))
        collector = self.pruning.start(self.hf_model, self.context, model_id=model_id, sources=sources, data=data)
        collector.to(fabric.device)
        for ext in collector.extensions.values():
            ext.standalone()  # the forward's output is dropped: no step reuses its graph
        self.sharded = any(isinstance(p, DTensor) for p in self.hf_model.parameters())
        """Whether the weights are FSDP2-sharded (every forward is then a collective)."""
        self._loader = LoaderPosition()  # where each batch lies in its loader's pass

    def update(self, batch: Any, dataloader: Any = None) -> None:
        """Run the model on one batch (input ids, or a dict with ``input_ids`` and ``attention_mask``) and add it.

        Pass the ``dataloader`` the batch comes from so the samples its ``DistributedSampler`` repeats (in each
        pass: :class:`~ompmoe.engine.collect.collector.LoaderPosition`) are not counted. Under DDP the forward is local
        (ranks may call this unequally often); under FSDP2 a collective: call it equally often, or use :meth:`run`.
        """
        inputs = as_model_inputs(batch, self.fabric.device)
        first, real = self._loader.batch(dataloader, int(inputs.get("input_ids", inputs.get("inputs_embeds")).shape[0]))
        self.pruning.forward(inputs, first, real, self.fabric.autocast())

    def run(self, dataloader: Iterable[Any]) -> int:
        """:meth:`update` on every batch of ``dataloader``; returns the number of batches of this rank.

        Under FSDP2 a rank whose data ends first runs forwards that count nothing until every rank
        is done, since each forward gathers weights from all ranks.
        """
        join = self.sharded and self.fabric.world_size > 1
        count = 0
        for batch in itertools.chain(dataloader, itertools.repeat(_END) if join else ()):
            if join:  # does any rank have a batch left?
                more = torch.tensor(float(batch is not _END), device=self.fabric.device)
                if self.fabric.all_reduce(more, reduce_op="max") == 0:
                    break
            if batch is _END:  # out of batches: a forward that counts nothing keeps this rank in the collectives
                ids = torch.zeros(1, 2, dtype=torch.long, device=self.fabric.device)
                self.pruning.forward({"input_ids": ids}, real_samples=0)
            else:
                try:
                    self.update(batch, dataloader)
                except KeyboardInterrupt:  # one line on rank 0, then the interrupt goes on (the script exits 130)
                    if self.fabric.is_global_zero:
                        from lightning.fabric.utilities.data import sized_len

                        print(self.pruning.interrupted_line(count, sized_len(dataloader)), file=sys.stderr)
                    raise
                count += 1
        return count

    def finish(self, choice_blocks: torch.Tensor | None = None) -> PruningPlan:
        """Sum the statistics over ranks, plan on rank 0, prune every rank's model, write the outputs once.

        Every rank must call it; it returns the same plan on each. ``choice_blocks``: token ids
        ``(num_blocks, seq_len)`` the loop did not feed, on which ``auto`` tries its candidate plans (default: the
        ``data`` module's, if any; without either it takes the layout's first setting).
        """
        return self.pruning.finish(self.context, choice_blocks=choice_blocks, show_progress=None)
