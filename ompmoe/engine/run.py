"""The pruning run, owned once: collect → merge across ranks → plan → choose (``auto``) → compensate → prune → adapt
→ evaluate → write. Every front door (the ``ExpertPruning`` callback, ``FabricCalibration``, the Fabric script,
``ompmoe fit``, the demo) is a thin adapter over :class:`PruningRun`: it drives the forwards and lends its ranks
(:class:`RunContext`); options are declared, documented and validated here, once, before any model work."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import tempfile
import time
import typing
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .adapters import find_moe_layers
from .apply.adaptive import enable_adaptive
from .apply.compensation import Compensation, compensation_obstacle, record_compensation, without_fix
from .apply.layer_by_layer import LayerByLayerMeasures, choose_plan_layer_by_layer, measure_layer_by_layer
from .apply.compensation_step import (
    calibration_data,
    check_compensation_mode,
    compensation_granularity,
    checks_compensation,
    compensation_line,
    data_blocks,
    fit_compensation,
    fitting_text,
    run_granularity,
)
from .apply.plan_choice import PlanChoice, choose_plan, setting_name
from .apply.pruning import prune
from .apply.quantized import QuantizedModelError, quant_method
from .apply.trial import pruned_view
from .quantized_files import QuantizedCheckpointError
from .record import CONFIG_KEY
from .fbgemm_fp8 import ONE_COUNT
from .stored_formats import COMPENSATION_STORED, FORMATS, format_name, requantizes, stored_quantization
from .collect.collector import StatisticsCollector, WeightsChangedError, weights_changed_message
from .collect.extensions import selected_statistics
from .collect.statistics import MoEStats
from .disk_space import pruned_bytes_lower_bound, require_free_space, stored_pruned_bytes_lower_bound
from .export.checkpoint import check_save_dtype, resolve_tokenizer, usable_tokenizer, written_dtype
from .export.plots import require_matplotlib, write_plots
from .export.save import save_pruned
from .io import Reservation, atomic_path, reserve
from .perplexity import heldout_block_count, perplexity
from .planning.method_registry import check_statistics, required_statistics
from .planning.plan import PruningPlan
from .planning.strategy import AUTO, PruningStrategy, Strategy, tries_candidates
from .progress import progress
from .ranks import RunContext, on_rank_zero, unsharded
from .summary import auto_note, kept_summary, named_method_sources, plan_metrics, settings_summary

STATS_FILE = "stats.safetensors"
PLAN_FILE = "plan.json"
MODEL_DIR = "model"
PLOTS_DIR = "plots"


@dataclass
class RunOptions:
    """What a pruning run does; the one declaration of these options, their defaults and their help.

    Args:
        strategy: What to prune; default ``PruningStrategy(method="auto", allocation="auto")``: ratio 0.5 with the
            settings measured for the model's layout (the paper's: ``method="omp", allocation="waterfill"``).
            Any object with ``validate(routings)`` and ``plan(stats)`` works.
        output_dir: Where rank 0 writes ``stats.safetensors``, ``plan.json``, ``plots/`` and ``model/``
            (atomically: a killed run leaves no partial output). ``None`` writes nothing.
        overwrite: Replace an existing ``output_dir`` (one written by ompmoe).
        save_model: Also save the pruned model (with its tokenizer and model card) under ``output_dir/model``.
        extra_ratios: More ratios planned from the same statistics, written as ``plan-<ratio>.json`` (prune them
            later with ``ompmoe prune``).
        plots: Also write the plots of :mod:`ompmoe.engine.export.plots` under ``output_dir/plots`` (needs matplotlib).
        adaptive_epsilon: After pruning, switch on OMP-MoE+ adaptive inference with this epsilon (the saved
            model carries it; log its counters with :class:`~ompmoe.callbacks.AdaptiveInferenceMonitor`).
        tokenizer: Tokenizer (object, hub id or path) saved with the model. Default: the one the run's model or
            data names, else the model's source; a warning names this argument when none is found.
        dtype: Weights dtype of the saved model (``bfloat16``, ``float32``, ...); default: the source checkpoint's.
        loss_aware: Also collect the loss-aware sums (one backward per batch to the MoE outputs, no weight
            gradients; the forward must run with gradients, as ``CalibrationModule`` does).
        reroute: Also collect the rerouting-aware Grams (for ``omp_reroute``; one more router call and one
            expert evaluation per token).
        statistics: Names of more optional statistics to collect (:data:`ompmoe.engine.collect.extensions.STATISTICS`;
            ``loss_aware`` and ``reroute`` are shorthands for two of them).
        evaluate_on: Held-out sets (``heldout:prose``, ``heldout:code`` or any calibration source) on which rank 0
            prints and logs ``heldout_ppl/<set>/original`` and ``.../pruned`` (needs a data module with
            ``heldout_blocks``, e.g. ``ompmoe.CalibrationDataModule``).
        evaluate_blocks: Blocks of the data module's ``seq_len`` tokens per held-out set; default: enough for 8,192
            tokens (8 blocks where the data module has no ``seq_len``). The sets and counts are recorded in
            ``plan.json`` (``extra.heldout``), so ``ompmoe prune --model`` measures its plans on the same text.
        choice_blocks: With ``auto`` on a layout with several settings: blocks of calibration text (the data
            module's ``choice_blocks(n)``) on which each candidate plan is tried, keeping the lowest loss
            (:func:`ompmoe.choose_plan`). ``None``: the data module's default (2,048 tokens' worth); ``0`` (or a
            data module without ``choice_blocks``, with a warning if a number was given): the layout's first setting.
        compensation: After planning, refit the kept routed experts to the unpruned model's routed output on the
            calibration text (:func:`ompmoe.compensate`; folded into their down projections, so the checkpoint stays
            stock and inference costs nothing more). ``auto``: for method ``auto``, the ``down`` refit or the
            ``linear`` map it starts from, whichever has the lower loss on the choice blocks, kept unless it raises
            that loss (by more than 0.02 nats); ``down``, ``linear``, ``expert`` or ``layer``: that correction for
            any method, always applied; ``off``: none (``auto`` with a method named outright, e.g. the paper's
            ``omp``, is ``off`` too). Recorded in ``plan.json`` and the model card.
        layer_by_layer: Calibrate and write a model bigger than memory: the model is a weightless skeleton, each
            decoder layer is read from the checkpoint's safetensors files, runs every calibration block and is freed
            (:func:`ompmoe.collect_stats_layerwise`; the same statistics), and the pruned checkpoint is written from
            the files layer by layer (:func:`ompmoe.save_pruned_from_files`; the same tensors). Compensation, its
            check on the choice blocks and ``evaluate_on``'s held-out perplexity run in one more pass over the layers
            (:func:`~ompmoe.engine.apply.layer_by_layer.measure_layer_by_layer`; the same fit and figures, its time
            printed), the correction folded into the rows as they are written. Loss-aware statistics are collected
            by a backward down the layers after the forward sweep, each layer read once more and recomputed from its
            input (the same sums; the inputs of every layer kept meanwhile, past half the memory available on disk
            beside the output), and ``auto``'s trial of its settings runs in a pass of
            its own (:func:`~ompmoe.engine.apply.layer_by_layer.choose_plan_layer_by_layer`; the same losses and
            choice, its time printed). Recorded in ``plan.json`` and the card; a ``dtype`` is refused. A quantized
            checkpoint (block FP8, MXFP4 experts, compressed-tensors) is read dequantized and written in its format,
            the kept tensors as stored; a compensation's down projections are quantized again in that format
            (:mod:`ompmoe.engine.stored_formats`).
    """

    strategy: Strategy | None = None
    output_dir: str | None = None
    overwrite: bool = False
    save_model: bool = True
    extra_ratios: list[float] | None = None
    plots: bool = True
    adaptive_epsilon: float | None = None
    tokenizer: Any = None
    dtype: str | None = None
    loss_aware: bool = False
    reroute: bool = False
    statistics: list[str] | None = None
    evaluate_on: list[str] | None = None
    evaluate_blocks: int | None = None
    choice_blocks: int | None = None
    compensation: str = "auto"
    layer_by_layer: bool = False

    def __post_init__(self) -> None:
        check_compensation_mode(self.compensation)
        check_save_dtype(self.dtype)
        if self.layer_by_layer:
            refuse_whole_model_options(self)
        if self.choice_blocks is not None and self.choice_blocks < 0:
            raise ValueError(f"choice_blocks must be >= 0 (0: no trial of auto's candidate plans); "
                             f"got {self.choice_blocks}.")
        if self.evaluate_blocks is not None and self.evaluate_blocks <= 0:
            raise ValueError(f"evaluate_blocks must be positive (default: 8,192 tokens' worth); got "
                             f"{self.evaluate_blocks}.")
        if self.adaptive_epsilon is not None and not 0.0 <= self.adaptive_epsilon <= 1.0:
            raise ValueError(f"adaptive_epsilon must lie in [0, 1]; got {self.adaptive_epsilon}.")
        if self.strategy is None:
            self.strategy = PruningStrategy(method=AUTO, allocation=AUTO)
        elif not all(callable(getattr(self.strategy, name, None)) for name in ("validate", "plan")):
            path = " (a path? output_dir is a keyword option: output_dir=...)" if isinstance(self.strategy, str) else ""
            raise TypeError(f"strategy must be a Strategy such as ompmoe.PruningStrategy(ratio=0.5) (any object with "
                            f"validate and plan); got {type(self.strategy).__name__} {self.strategy!r}{path}.")
        self.extra_ratios = list(self.extra_ratios or [])
        if self.extra_ratios and not hasattr(self.strategy, "ratio"):
            raise TypeError(f"extra_ratios needs a strategy with a `ratio` field; got {type(self.strategy).__name__}.")
        self.statistics = selected_statistics(self.statistics or (), loss_aware=self.loss_aware, reroute=self.reroute)
        self.evaluate_on = list(self.evaluate_on or [])


def run_options(owner: str, strategy: Strategy | None = None, **options: Any) -> RunOptions:
    """:class:`RunOptions` as a front door (``owner``: ``ExpertPruning``, ``FabricCalibration``) takes them, an
    unknown name refused naming the front door and the fix (a strategy's field, such as ``ratio``, goes in its
    strategy)."""
    known = [field.name for field in dataclasses.fields(RunOptions)]
    for name in options:
        if name in known:
            continue
        if name in {field.name for field in dataclasses.fields(PruningStrategy)}:
            raise TypeError(f"{owner} takes {name} in its strategy: {owner}(strategy=ompmoe.PruningStrategy("
                            f"{name}=...)).")
        raise TypeError(f"{owner} has no option {name!r}; its options: {', '.join(known)} (ompmoe.RunOptions).")
    return RunOptions(strategy=strategy, **options)


LAYER_BY_LAYER = "layer by layer"
"""``plan.extra["calibration"]["mode"]`` of a run calibrated one decoder layer at a time (resident runs record none)."""


def refuse_whole_model_options(options: RunOptions) -> None:
    """Refuse, before any work, what ``layer_by_layer`` cannot run (it needs the whole model), saying what runs."""
    if options.dtype is not None:
        raise ValueError(f"layer_by_layer writes the checkpoint's tensors as its files store them; got "
                         f"dtype={options.dtype!r}. Remove dtype (save_dtype), or calibrate resident.")


Step = typing.TypeVar("Step", bound=Callable[..., Any])


def paper_plan(strategy: Strategy, stats: MoEStats, plan: PruningPlan, compensation: Compensation | None
               ) -> PruningPlan | None:
    """The paper's plan (``omp`` + ``waterfill`` with the run's ratio and limits) when the run's pruned model is not
    it (another setting, or compensated); ``None`` otherwise, or for a strategy of the user's own class."""
    if not isinstance(strategy, PruningStrategy):
        return None
    if (plan.method, plan.allocation) == ("omp", "waterfill") and compensation is None:
        return None
    return dataclasses.replace(strategy, method="omp", allocation="waterfill", method_options={}).plan(stats)


def paper_part(original: float, pruned: float, paper: float | None) -> str:
    """`` (paper's setting 33.90: 24 % of its increase recovered)``: the share of the paper's perplexity increase
    the run's setting takes back, ``(paper - pruned) / (paper - original)``; where the run's setting lost more, its
    increase as a share of the paper's (``this one's increase is 120% of it``); only the paper's perplexity where it
    lost nothing."""
    if paper is None:
        return ""
    if paper <= original:
        return f" (paper's setting {paper:.2f})"
    if pruned > paper:  # the run's setting lost more than the paper's: how much more, not a negative share
        increase = (pruned - original) / (paper - original)
        return f" (paper's setting {paper:.2f}: this one's increase is {increase:.0%} of it)"
    return f" (paper's setting {paper:.2f}: {(paper - pruned) / (paper - original):.0%} of its increase recovered)"


def _releases_output_on_failure(step: Step) -> Step:
    """A step of the run that fails (an error, Ctrl-C) frees ``output_dir``: the run will not write it."""
    @functools.wraps(step)
    def guarded(self: PruningRun, *args: Any, **kwargs: Any) -> Any:
        try:
            return step(self, *args, **kwargs)
        except BaseException:
            self.release_output()
            raise

    return typing.cast(Step, guarded)


class PruningRun:
    """One calibration-and-pruning run: options checked at construction, then :meth:`start` on the model, one
    :meth:`batch` context per forward (or :meth:`collect` over batches), and :meth:`finish` on every rank.

    ``owner`` is the name error messages tell the user to pass options to (``ExpertPruning``, ``FabricCalibration``).
    """

    def __init__(self, options: RunOptions | None = None, owner: str = "PruningRun", **changes: Any) -> None:
        self.options = dataclasses.replace(options, **changes) if options is not None else RunOptions(**changes)
        self.owner = owner
        if self.options.output_dir is not None and self.options.plots:
            require_matplotlib(owner)
        self.strategy: Strategy = self.options.strategy  # type: ignore[assignment]
        self.strategy_used: Strategy = self.strategy
        """The strategy with ``auto`` replaced by the chosen setting (the extra ratios are planned with it)."""
        self.strategy_asked: Strategy = self.strategy
        """The strategy as given (layer by layer runs ``auto`` as one of its settings; compensation follows this)."""
        self.statistics = list(self.options.statistics or [])
        self.collector: StatisticsCollector | None = None
        self.model_type: str | None = None
        self.inputs: list[str] = []
        self.tokenizer: Any = None
        self.data: Any = None
        self.choice_data: torch.Tensor | None = None
        self.stats: MoEStats | None = None
        self.plan: PruningPlan | None = None
        self.choice: PlanChoice | None = None
        """What ``auto`` tried and chose (rank 0's choice, on every rank), when it had blocks to try them on."""
        self.compensation_granularity: str | None = None
        """What compensation fits (``None``: none), settled against the model in :meth:`start`."""
        self.checks_compensation = False
        """Whether the fitted compensation is kept only if the choice blocks' loss does not rise (``auto``)."""
        self.compensation: Compensation | None = None
        """The fitted compensation the pruned model gets (``None``: none fitted, or not kept)."""
        self.calibration_data: dict[str, Any] | None = None
        """The data module's settings (``CalibrationDataModule``'s), recorded with a compensation so that ``ompmoe
        prune`` can cut the same text again."""
        self.pruned_model: nn.Module | None = None
        self.heldout_perplexity: dict[str, tuple[float, float]] = {}
        """``{set: (original, pruned)}`` held-out perplexity, when ``evaluate_on`` names sets (rank 0)."""
        self.heldout_tokens = 0
        """Tokens per held-out set behind :attr:`heldout_perplexity`."""
        self.heldout_paper: dict[str, float] = {}
        """Held-out perplexity per set of the paper's setting (``omp`` + ``waterfill``, no compensation) at the
        run's ratio, when the run's setting differs: what :attr:`heldout_perplexity` is judged against."""
        self.source: str | None = None
        """The checkpoint a layer-by-layer run reads its layers from (:meth:`collect_layer_by_layer`)."""
        self.layer_by_layer_line: str | None = None
        """How long a layer-by-layer run's trial of ``auto``'s settings took (its own pass over the layers)."""
        self.no_compensation_line: str | None = None
        """What a quantized checkpoint's run leaves out (:meth:`_compensation_for_files`)."""
        self.layer_device: torch.device | str = "cpu"
        """Where a layer-by-layer run computes its layers (:meth:`collect_layer_by_layer`'s ``device``)."""
        self.timings: dict[str, float] = {}
        """Seconds per step of a layer-by-layer run (``embed``, ``layers``, ``write``)."""
        self.reservation: Reservation | None = None
        """Rank 0's hold on ``output_dir`` from :meth:`check_output` until :meth:`write` (which releases it): another
        run checking the same output meanwhile is refused. A step of the run that fails releases it
        (:meth:`release_output`); a loop whose own forward fails (Lightning's) calls that itself."""

    # -- before any model work -------------------------------------------------------------------------------------
    def release_output(self) -> None:
        """Free ``output_dir`` for the next run: this one failed or was interrupted and will not write."""
        if self.reservation is not None:
            self.reservation.release()

    def check_output(self, context: RunContext, inputs: Sequence[str] = ()) -> None:
        """Refuse, on every rank, an ``output_dir`` that exists (without ``overwrite``), cannot be written, holds the
        run's ``inputs`` (model, tokenizer, data files) or is reserved by another live run; rank 0, the one that
        writes, decides, and reserves it for this run (:attr:`reservation`) until :meth:`write`."""
        self.inputs = list(inputs)
        self.release_output()  # checked again (a second fit with the same callback): a fresh reservation
        self.reservation = None
        if self.options.output_dir is not None:
            def check() -> None:  # the reservation stays on rank 0 (it holds a lock; it is not sent to the others)
                self.reservation = reserve(self.options.output_dir, self.options.overwrite, directory=True,
                                           inputs=self.inputs)

            on_rank_zero(context, check)

    @_releases_output_on_failure
    def start(self, model: nn.Module, context: RunContext, *, model_id: str | None = None,
              sources: Sequence[str] | None = None, data: Any = None, tokenizers: Iterable[Any] = ()
              ) -> StatisticsCollector:
        """Check the strategies against ``model``'s layers, cut ``auto``'s choice blocks from ``data`` (too little
        text fails here, before any forward) and instrument the model. ``tokenizers``: where the saved tokenizer
        may come from when ``options.tokenizer`` is not given, in order."""
        options = self.options
        routings = [(layer.name, layer.routing) for layer in find_moe_layers(model)]
        self.model_type = getattr(getattr(model, "config", None), "model_type", None)
        if options.layer_by_layer and any(p.device.type != "meta" for p in model.parameters()):
            raise ValueError(f"{self.owner}(layer_by_layer=True) calibrates a model built without weights, one layer "
                             "read from its files at a time (ompmoe fit --layer_by_layer true, or "
                             "PruningRun.collect_layer_by_layer on ompmoe.engine.lazy_checkpoint.build_skeleton); this "
                             "model holds its weights: calibrate it resident (layer_by_layer=False).")
        asked = self.strategy_asked  # compensation follows what was asked (auto's), whatever layer by layer runs
        self.statistics = self._validate_strategies(routings)
        if not options.layer_by_layer:  # layer by layer: once the checkpoint is known (collect_layer_by_layer)
            on_rank_zero(context, lambda: self.check_output_space(model))
        self.data = data
        if options.evaluate_on and not callable(getattr(data, "heldout_blocks", None)):
            raise ValueError(f"{self.owner}(evaluate_on=...) needs a data module with heldout_blocks (e.g. "
                             "ompmoe.CalibrationDataModule) to cut the held-out text; remove evaluate_on or use one.")
        if isinstance(options.tokenizer, (str, os.PathLike)):  # named outright: it must load, before any work
            resolve_tokenizer(options.tokenizer, model)
        self.tokenizer = usable_tokenizer([options.tokenizer, *tokenizers])
        mode = self._compensation_for_experts(model, self._compensation_for_files(model, asked), asked)
        self.compensation_granularity = run_granularity(mode, asked, model, per_layer=options.layer_by_layer)
        self.checks_compensation = checks_compensation(mode, asked)
        self.calibration_data = calibration_data(data)
        self.collector = StatisticsCollector(model, model_id=model_id, sources=list(sources or []),
                                             statistics=self.statistics)
        self.choice_data = self._choice_data(context)
        return self.collector

    def check_output_space(self, model: nn.Module, source: str | os.PathLike | None = None) -> None:
        """Refuse, before calibration, an ``output_dir`` whose disk cannot hold the pruned model
        (:meth:`pruned_model_bytes`); nothing without an output or a model to save."""
        if self.options.output_dir is not None and self.options.save_model:
            plans_only = ("" if self.owner == "ompmoe-demo" else  # the demo has no save_model
                          " (save_model false writes the statistics and plan only)")
            require_free_space(self.options.output_dir, self.pruned_model_bytes(model, source),
                               "the pruned model needs", f"free space there, or choose another output_dir{plans_only}")

    def pruned_model_bytes(self, model: nn.Module, source: str | os.PathLike | None = None) -> int:
        """At least the bytes of the pruned model this run writes: the experts its plan keeps (before it plans: at
        least those its ratio keeps), in the dtype written (``source``: the checkpoint written from, as stored;
        ``model`` its skeleton)."""
        ratio = getattr(self.strategy, "ratio", None)
        fraction = None if ratio is None else 1.0 - float(ratio)
        kept = None if self.plan is None else {
            name: len(experts) for name, experts in self.plan.kept_by_layer().items()}
        if source is not None:
            return stored_pruned_bytes_lower_bound(source, model, fraction, kept=kept)
        return pruned_bytes_lower_bound(model, fraction, written_dtype(model, self.options.dtype), kept=kept)

    def _validate_strategies(self, routings: Sequence[tuple[str, dict[str, int]]]) -> list[str]:
        """Refuse a ratio the model cannot meet or a strategy whose statistics are not collected; return the
        statistics to collect (those asked for plus what each setting ``auto`` tries needs)."""
        statistics = list(self.statistics)
        for strategy in [self.strategy, *self._extra_strategies()]:
            resolved = strategy.resolved(self.model_type) if hasattr(strategy, "resolved") else strategy
            tried = [strategy]
            if resolved is not strategy:  # ``auto``: what each setting it tries needs
                tried = [dataclasses.replace(strategy, method=m, allocation=a)  # type: ignore[type-var]
                         for m, a in strategy.settings(self.model_type)]  # type: ignore[attr-defined]
                for each in tried:
                    statistics = selected_statistics(
                        [*statistics, *required_statistics(each.method, each.allocation)])  # type: ignore[attr-defined]
            for each in tried:
                each.validate(routings)
                check_statistics(each, statistics, self.owner)
        return statistics

    def _choice_data(self, context: RunContext) -> torch.Tensor | None:
        """The held-out calibration blocks ``auto`` tries its candidate plans on, or ``None`` (no trial; see
        ``RunOptions.choice_blocks``)."""
        num_blocks = self.options.choice_blocks
        trial = tries_candidates(self.strategy, self.model_type)
        if num_blocks == 0 or not (trial or self.checks_compensation):
            return None
        if not callable(getattr(self.data, "choice_blocks", None)):
            if num_blocks is not None and trial:
                context.warn(
                    f"{self.owner}: method/allocation 'auto' tries its candidate plans on held-out calibration blocks, "
                    f"but the data module ({type(self.data).__name__}) has no choice_blocks(n) "
                    "(ompmoe.CalibrationDataModule has); using the setting recommended for "
                    f"{self.model_type} instead. Pass choice_blocks=0 to silence this.")
            return None
        return self.data.choice_blocks(num_blocks)

    def unpruned_line(self, stage: Any) -> str | None:
        """What a Trainer's ``stage`` (validate, test, predict) run before this run pruned the model is told: that
        the model runs unpruned (the run calibrates on the fit's batches only); ``None`` once it has pruned."""
        if self.plan is not None:
            return None
        return (f"{self.owner} prunes during trainer.fit (it calibrates on the fit's batches); "
                f"trainer.{getattr(stage, 'value', stage)} runs the model as it is, unpruned. Call trainer.fit first, "
                "or load a model it pruned with ompmoe.load_pruned.")

    # -- collect -----------------------------------------------------------------------------------------------------
    def _compensation_for_files(self, model: nn.Module, strategy: Strategy) -> str:
        """The compensation mode the run fits: the one asked, but none for a checkpoint whose weights ompmoe does not
        quantize again (block FP8 with multipliers in a ``scale_fmt`` it does not write), whose kept tensors are
        written as stored (``auto`` then fits none and :attr:`no_compensation_line` says so; one named is refused
        here, before any work); a block-FP8, MXFP4 or compressed-tensors one's compensated down projections are
        quantized again. A model transformers loaded quantized is refused too (prune computes on full precision).
        """
        mode, stored = self.options.compensation, stored_quantization(model)
        method = quant_method(getattr(model, "config", None))
        if method is not None:
            if self.options.layer_by_layer:  # a skeleton built otherwise than build_skeleton builds it
                raise QuantizedModelError(
                    f"{self.owner}(layer_by_layer=True): the model was built with its config's quantization_config "
                    f"(quant_method={method!r}); build it with ompmoe.engine.lazy_checkpoint.build_skeleton(config), "
                    "which builds it to compute on the weights dequantized (block FP8, MXFP4, compressed-tensors) or "
                    "refuses the format.")
            record = getattr(getattr(model, "config", None), CONFIG_KEY, None)
            per_layer = isinstance(record, dict) and not record.get("uniform", True)  # layer by layer cannot read it
            source = ((record.get("plan") or {}).get("model_id") if per_layer else None) or "SOURCE"
            fix = ("it was pruned to per-layer counts, which layer by layer cannot read: plan again from the "
                   f"statistics it was pruned with and prune its source (ompmoe prune --stats STATS --ratio R --model "
                   f"{source})" if method in FORMATS and per_layer else
                   "pass layer_by_layer=True (ompmoe fit --layer_by_layer true): it reads a quantized checkpoint's "
                   "weights dequantized and writes the kept ones as stored" if method in FORMATS else
                   "prune the full-precision model, then quantize the pruned one (docs/recipes.md)")
            raise QuantizedModelError(f"{self.owner}: the model was loaded quantized (quant_method={method!r}); "
                                      f"pruning computes on full-precision weights: {fix}.")
        if stored is not None and stored["quant_method"] == "fbgemm_fp8" and getattr(strategy, "allocation",
                                                                                   "uniform") != "uniform":
            raise QuantizedCheckpointError(ONE_COUNT.format(source=self._model_name(model)))  # before any work
        if stored is None or compensation_granularity(mode, strategy) is None or requantizes(stored):
            return mode  # block FP8, MXFP4, compressed-tensors: its compensated down projections quantized again
        if mode != "auto":
            raise QuantizedCheckpointError(COMPENSATION_STORED.format(source=self._model_name(model),
                                                                      format=format_name(stored)))
        self.no_compensation_line = (f"ompmoe: the checkpoint stores {format_name(stored)} weights, written as stored: auto "
                            "fits no compensation (its refit would change them)")
        return "off"

    def _compensation_for_experts(self, model: nn.Module, mode: str, strategy: Strategy) -> str:
        """``mode``, but none where a correction cannot be folded or written
        (:func:`~.apply.compensation.compensation_obstacle`: MuseSpark's normalized expert outputs, Inkling2-Loop's
        repeated layers, a quantized checkpoint's transposed experts): ``auto`` then fits none and
        :attr:`no_compensation_line` says so; one named is refused here, before any work."""
        if compensation_granularity(mode, strategy) is None:
            return mode
        obstacle = compensation_obstacle(model)
        if obstacle is None:
            return mode
        if mode != "auto":
            raise obstacle
        self.no_compensation_line = f"ompmoe: auto fits no compensation: {without_fix(obstacle)}"
        return "off"

    @staticmethod
    def _model_name(model: nn.Module) -> str:
        return str(getattr(getattr(model, "config", None), "_name_or_path", None) or "the model")

    @property
    def needs_gradients(self) -> bool:
        """Whether a statistic runs a backward (the forward must then run with gradients)."""
        return self.collector is not None and self.collector.needs_gradients

    @_releases_output_on_failure
    def begin_batch(self, inputs: Mapping[str, torch.Tensor], first_sample: int = 0,
                    real_samples: int | None = None) -> None:
        """Instrument the next forward, which the loop runs (:meth:`StatisticsCollector.begin_batch`); refused once
        the weights changed since the first batch (the loop steps an optimizer), before more forwards are spent."""
        collector = self._collector()
        collector.check_weights(self.owner, values=False)
        collector.begin_batch(inputs, first_sample, real_samples)

    def end_batch(self) -> None:
        """Stop instrumenting (also after a failed forward)."""
        if self.collector is not None:
            self.collector.end_batch()

    @_releases_output_on_failure
    def forward(self, inputs: dict[str, torch.Tensor], first_sample: int = 0, real_samples: int | None = None,
                autocast: Any = None) -> None:
        """One instrumented forward (:meth:`StatisticsCollector.calibrate`)."""
        self._collector().calibrate(inputs, first_sample, real_samples, autocast)

    @_releases_output_on_failure
    def collect(self, batches: Iterable[Any], show_progress: bool | None = None) -> int:
        """One instrumented forward per batch in this process (a script's or the demo's loop); returns the count."""
        return self._collector().collect(batches, show_progress)

    @_releases_output_on_failure
    def collect_layer_by_layer(self, source: str | os.PathLike, batches: Iterable[Any],
                               device: torch.device | str = "cpu", show_progress: bool | None = None) -> int:
        """All calibration ``batches`` through the checkpoint at ``source`` one decoder layer at a time (the run's
        model is its weightless skeleton; ``RunOptions.layer_by_layer``); returns the number of batches."""
        from .collect.layerwise import collect_layerwise

        if not self.options.layer_by_layer:
            raise RuntimeError(f"{self.owner}: collect_layer_by_layer needs layer_by_layer=True.")
        self.source, self.layer_device = str(source), device
        self.check_output_space(self._collector().model, source)
        return collect_layerwise(self._collector(), source, batches, device=device, progress=show_progress,
                                 timings=self.timings, scratch=self.scratch_parent())

    def _collector(self) -> StatisticsCollector:
        if self.collector is None:
            raise RuntimeError(f"{self.owner}: start(model, ...) must come before any batch.")
        if self.stats is not None:
            raise RuntimeError(f"{self.owner}.finish() was called already; create a new {self.owner}.")
        return self.collector

    # -- after the last batch ----------------------------------------------------------------------------------------
    @_releases_output_on_failure
    def finish(self, context: RunContext, choice_blocks: torch.Tensor | None = None,
               show_progress: bool | None = False) -> PruningPlan:
        """Merge the statistics over ranks, plan (choosing on rank 0), prune, evaluate, print, log and write once.

        Every rank must call it (the sums and the gathering of sharded weights are collectives); it returns the
        same plan on each. ``choice_blocks``: token ids to try ``auto``'s candidates on, in place of the data's.
        """
        collector = self._collector()
        # Statistics from changing weights describe no model: refused on every rank together, before any collective.
        changed = collector.changed_weight()
        if context.world_size > 1:
            names = [context.broadcast(changed, src=rank) for rank in range(context.world_size)]
            changed = next((name for name in names if name is not None), None)
        collector.weights = None  # no reference to the unpruned weights outlives the check
        if changed is not None:
            raise WeightsChangedError(weights_changed_message(self.owner, changed))
        with warnings.catch_warnings():
            # A rank that got no batch has an empty (zero) share of the sums: that is no mistake here.
            warnings.filterwarnings("ignore", message=r".*was called before the ``update`` method.*")
            stats = collector.result()  # torchmetrics sums the states over ranks here
        model = unsharded(collector.model, context.is_global_zero)
        batch_size = collector.batch_size or 4  # the calibration's (blocks as long as its own), 4 if it had none
        blocks = self.choice_data if choice_blocks is None else choice_blocks
        plan = self._plan(context, stats, model, blocks, batch_size)
        if self.options.layer_by_layer:
            plan = dataclasses.replace(plan, extra={**plan.extra, "calibration": {"mode": LAYER_BY_LAYER}})
        if self.calibration_data is not None:  # what ``ompmoe prune`` cuts again to refit its plans (also this fit's)
            plan = dataclasses.replace(plan, extra={**plan.extra, "calibration_data": self.calibration_data})
        if self.options.evaluate_on:  # the same on every rank: what ``ompmoe prune`` measures its plans on again
            plan = dataclasses.replace(plan, extra={**plan.extra, "heldout": self.heldout_record()})
        self.stats, self.plan = stats, plan
        evaluate_on = self.options.evaluate_on if model is not None and context.is_global_zero else []  # rank 0 only
        heldout = {name: self.data.heldout_blocks(name, plan.extra["heldout"]["blocks"]) for name in evaluate_on or []}
        if self.options.layer_by_layer:  # one process: fitted and measured in one more pass over the layers
            with self.layer_by_layer_scratch() as scratch:
                measured = self._measure_layer_by_layer(model, blocks, batch_size, heldout, scratch)
                before = {name: pair[0] for name, pair in measured.heldout.items()}
                after = {name: pair[1] for name, pair in measured.heldout.items()}
                return self._finish(context, model, heldout, before, after, show_progress,
                                    self.measured_line(measured, heldout))
        self.gather_calibration_text(context)
        self.compensation, self.plan = on_rank_zero(
            context, lambda: (self._compensate(model, blocks, batch_size), self.plan))  # the same on every rank
        before = {name: perplexity(model, blocks, batch_size) for name, blocks in heldout.items()}
        paper = paper_plan(self.strategy_used, stats, self.plan, self.compensation) if heldout else None
        if paper is not None:  # the baseline the share of its loss recovered is measured against
            with pruned_view(model, paper):
                self.heldout_paper = {name: perplexity(model, blocks, batch_size) for name, blocks in heldout.items()}
        if model is not None:  # under FSDP only rank 0 holds (and prunes) the full model
            self.apply(model)
        after = {name: perplexity(model, blocks, batch_size) for name, blocks in heldout.items()}
        return self._finish(context, model, heldout, before, after, show_progress)

    def _finish(self, context: RunContext, model: nn.Module | None, heldout: dict[str, torch.Tensor],
                before: dict[str, float], after: dict[str, float], show_progress: bool | None,
                measured_line: str | None = None) -> PruningPlan:
        """What every run does once pruned: log, print its lines and write (rank 0), on every rank."""
        plan = self.plan
        assert plan is not None
        if self.options.layer_by_layer and model is not None:
            self.apply(model)
        context.log_metrics(plan_metrics(plan))
        for line in self.summary_lines():
            context.print(line)
        for line in (self.layer_by_layer_line, self.no_compensation_line):
            if line is not None:
                context.print(line)
        if measured_line is not None:
            context.print(measured_line)
        if "compensation" in plan.extra:
            context.print(compensation_line(plan.extra["compensation"]))
        if heldout:  # after the settings and kept lines: what the plan cost
            self.heldout_perplexity = {name: (before[name], after[name]) for name in before}
            self.heldout_tokens = min(blocks.numel() for blocks in heldout.values())
            context.print(self.heldout_line())
            context.log_metrics({f"heldout_ppl/{name}/paper": value for name, value in self.heldout_paper.items()})
            context.log_metrics({f"heldout_ppl/{name}/{kind}": value for name, pair in self.heldout_perplexity.items()
                                 for kind, value in zip(("original", "pruned"), pair)})
        if self.options.output_dir is not None:
            on_rank_zero(context, lambda: self.write(model, show_progress))
            written = "statistics, plan" + (" and pruned model" if self.options.save_model else " (save_model off)")
            context.print(f"ompmoe: wrote {written} to {self.options.output_dir}")
        context.barrier("ompmoe-pruning-written")
        return plan

    @contextlib.contextmanager
    def layer_by_layer_scratch(self, directory: str | os.PathLike | None = None) -> Iterator[Path]:
        """Where a layer-by-layer run keeps its per-layer corrections until they are written: a temporary directory in
        ``directory`` (default :meth:`scratch_parent`), removed when the run ends, also when it fails."""
        parent = directory if directory is not None else self.scratch_parent()
        with tempfile.TemporaryDirectory(prefix=".ompmoe-compensation-", dir=parent,
                                         ignore_cleanup_errors=True) as scratch:  # gone with the reservation's
            yield Path(scratch)

    def scratch_parent(self) -> Path | None:
        """Where a layer-by-layer run's temporary files go: beside the output (the disk the user chose for a big
        model), in the run's scratch directory while it holds ``output_dir`` (:meth:`Reservation.scratch`: a killed
        run's is removed by the next run's check), else beside ``output_dir``; ``None`` (the system's temporary
        directory) without one."""
        if self.reservation is not None and self.reservation.held:
            return self.reservation.scratch()
        output_dir = self.options.output_dir
        if output_dir is not None and Path(output_dir).parent.is_dir():
            return Path(output_dir).parent
        return None

    def _measure_layer_by_layer(self, model: nn.Module, blocks: torch.Tensor | None, batch_size: int,
                                heldout: dict[str, torch.Tensor], scratch: Path) -> LayerByLayerMeasures:
        """The compensation fit, its check and held-out perplexity of a layer-by-layer run, in one more pass over the
        checkpoint's layers (:func:`~.apply.layer_by_layer.measure_layer_by_layer`); records them as a resident run
        does."""
        assert self.plan is not None and self.stats is not None and self.collector is not None
        granularity = self.compensation_granularity
        text = fitting_text(self.data, self.collector.token_batches) if granularity else None
        if granularity and text is None:
            self.compensate(model, granularity, None)  # recorded: nothing to fit on
        fit = granularity if text is not None else None
        if fit is None and not heldout:
            return LayerByLayerMeasures()  # nothing that needs another pass
        check = blocks if self.checks_compensation else None
        unchecked = ("applied without a check: no held-out calibration blocks (choice_blocks)" if
                     self.options.compensation == "auto" else f"applied as asked (compensation={granularity!r})")
        return self.measure_from_files(model, fit, text, check, unchecked, heldout, scratch, batch_size)

    def measure_from_files(self, model: nn.Module, granularity: str | None, text: Any,
                           check_blocks: torch.Tensor | None, unchecked: str, heldout: Mapping[str, torch.Tensor],
                           scratch: Path, batch_size: int = 4, original: Mapping[str, float] | None = None
                           ) -> LayerByLayerMeasures:
        """:meth:`compensate` (``granularity`` on ``text``; ``None``: no fit) and the held-out perplexity of the
        run's plan, on the **unpruned** skeleton ``model`` of the checkpoint at :attr:`source`, one decoder layer at a
        time (:func:`~.apply.layer_by_layer.measure_layer_by_layer`); recorded as a resident run records them.
        ``original``: the unpruned model's held-out perplexity measured by an earlier plan's pass (not run again). The
        correction stays in ``scratch`` until :meth:`save_model` folds it into the rows it writes."""
        assert self.plan is not None and self.stats is not None and self.source is not None
        paper = paper_plan(self.strategy_used, self.stats, self.plan, None) if heldout else None
        if heldout and paper is None and granularity:  # the run's plan is the paper's: its perplexity uncompensated
            paper = self.plan
        measured = measure_layer_by_layer(self.source, model, self.plan, scratch, granularity=granularity, text=text,
                                          batch_size=batch_size, check_blocks=check_blocks, unchecked=unchecked,
                                          heldout=heldout, paper=paper, original=original, device=self.layer_device,
                                          progress=None)
        if measured.record is not None:
            record = dict(measured.record)
            if self.calibration_data is not None:
                record["calibration_data"] = self.calibration_data
            self.plan = dataclasses.replace(self.plan, extra={**self.plan.extra, "compensation": record})
            self.compensation = measured.compensation
        if paper_plan(self.strategy_used, self.stats, self.plan, self.compensation) is not None:
            self.heldout_paper = dict(measured.paper)
        return measured

    def measured_line(self, measured: LayerByLayerMeasures, heldout: Mapping[str, torch.Tensor],
                       passes: str = "one more pass") -> str | None:
        """``ompmoe: compensation and its check and held-out perplexity ran layer by layer in one more pass over the
        layers: 12.3 s (calibration: 20.1 s)``; ``None`` where no pass ran. ``passes``: what the pass was to the
        run (``ompmoe prune``'s is its only one)."""
        checked = measured.record is not None and "loss_with" in measured.record  # checked_choice's record
        uses = (["compensation" + (" and its check" if checked else "")]
                if measured.record is not None else []) + (["held-out perplexity"] if heldout else [])
        if not uses:
            return None
        calibration = self.timings.get("total")
        adaptive = ("; the pruned perplexity is without OMP-MoE+'s per-token skipping (adaptive_epsilon switches it "
                    "on in the written model; measure that resident or with ompmoe validate)"
                    if heldout and self.options.adaptive_epsilon is not None else "")
        return (f"ompmoe: {' and '.join(uses)} ran {LAYER_BY_LAYER} in {passes} over the layers: "
                f"{measured.seconds:.1f} s" + (f" (calibration: {calibration:.1f} s)" if calibration is not None else "")
                + adaptive)

    def replan(self, stats: MoEStats) -> PruningPlan:
        """Plan from saved statistics (``ompmoe prune``): the strategy checked against their layers, then planned."""
        self.model_type = stats.model_type
        for strategy in [self.strategy, *self._extra_strategies()]:
            strategy.validate([(layer.name, layer.routing) for layer in stats.layers])
        self.stats, self.tokenizer = stats, self.options.tokenizer
        self.plan = self._plan(RunContext(), stats, None, None, 0)
        return self.plan

    def apply(self, model: nn.Module) -> nn.Module:
        """Prune ``model`` in place by the run's plan, then switch on adaptive inference if asked: the one place a
        plan becomes a pruned model, for every front door."""
        assert self.plan is not None and self.stats is not None
        prune(model, self.plan)
        if self.compensation is not None and self.source is not None:
            record_compensation(model, self.compensation.record)  # a skeleton: the writer folds it into the rows
        elif self.compensation is not None:
            self.compensation.apply(model)
        if self.options.adaptive_epsilon is not None:
            enable_adaptive(model, self.stats, self.options.adaptive_epsilon)
        self.pruned_model = model
        return model

    def save_model(self, model: nn.Module, path: Any) -> None:
        """Save the pruned ``model`` (stock checkpoint, tokenizer, model card) at ``path``; layer by layer, from the
        source files (``model`` is the pruned skeleton: its config and record)."""
        assert self.stats is not None and self.plan is not None
        calibration = "; ".join(self.stats.sources) or None
        if self.source is not None:
            from .export.streamed import save_streamed

            with atomic_path(path, directory=True) as tmp:  # a failed write names the model's folder, as save_pruned's
                save_streamed(self.source, self.plan, model, tmp, tokenizer=self.tokenizer, calibration=calibration,
                              timings=self.timings, compensation=self.compensation)
            return
        save_pruned(model, path, tokenizer=self.tokenizer, dtype=self.options.dtype, calibration=calibration)

    def _plan(self, context: RunContext, stats: MoEStats, model: nn.Module | None, blocks: torch.Tensor | None,
              batch_size: int) -> PruningPlan:
        """The strategy's plan; for ``auto`` with choice blocks, the candidate rank 0 measured best (on every rank)."""
        if blocks is None or not tries_candidates(self.strategy, stats.model_type):
            return on_rank_zero(context, lambda: self.strategy.plan(stats))
        candidates = self.strategy.candidates(stats)  # type: ignore[attr-defined]
        if self.options.layer_by_layer:  # the skeleton's layers read from the files, one at a time
            started = time.perf_counter()
            self.choice = choose_plan_layer_by_layer(self.source, model, candidates, blocks, batch_size,
                                                     self.layer_device)
            self.layer_by_layer_line = (f"ompmoe: auto's trial of its settings ran {LAYER_BY_LAYER} in one more pass "
                                        f"over the layers: {time.perf_counter() - started:.1f} s")
        else:
            self.choice = on_rank_zero(context, lambda: choose_plan(model, candidates, blocks, batch_size))
        plan = candidates[self.choice.index]
        self.strategy_used = dataclasses.replace(self.strategy, method=plan.method,  # type: ignore[type-var]
                                                 allocation=plan.allocation)
        return plan

    def gather_calibration_text(self, context: RunContext) -> None:
        """Every rank's calibration batches, rank by rank, on every rank (a collective: every rank calls it): the
        compensation, fitted on rank 0, fits on all the text the statistics saw when the data module holds no blocks
        of its own (a plain DataLoader), not rank 0's share of it."""
        if (context.world_size > 1 and self.compensation_granularity and self.collector is not None
                and data_blocks(self.data) is None):  # the data module's blocks are the whole text on every rank
            own = self.collector.token_batches
            self.collector.token_batches = [batch for rank in range(context.world_size)
                                            for batch in context.broadcast(own, src=rank)]

    def _compensate(self, model: nn.Module | None, blocks: torch.Tensor | None, batch_size: int
                    ) -> Compensation | None:
        """The run's compensation step on rank 0 (``RunOptions.compensation``): on the calibration text, checked on
        ``blocks`` where ``auto`` asks for it."""
        granularity = self.compensation_granularity
        if granularity is None or model is None:
            return None
        assert self.collector is not None
        text = fitting_text(self.data, self.collector.token_batches)
        check = blocks if self.checks_compensation else None
        unchecked = ("applied without a check: no held-out calibration blocks (choice_blocks)" if
                     self.options.compensation == "auto" else f"applied as asked (compensation={granularity!r})")
        without = self.choice.losses[setting_name(self.plan)] if self.choice and check is not None else None
        return self.compensate(model, granularity, text, batch_size, check, unchecked, without)

    def compensate(self, model: nn.Module, granularity: str, text: Any, batch_size: int = 4,
                   check_blocks: torch.Tensor | None = None, unchecked: str = "applied as asked",
                   loss_without: float | None = None) -> Compensation | None:
        """Fit the plan's compensation on the unpruned ``model`` over ``text`` (calibration token ids; ``None``: none
        to fit on) and record it in ``plan.extra["compensation"]``; :meth:`apply` then folds it in if kept.

        With ``check_blocks`` it is kept only if the pruned model's loss there falls (``loss_without``: that loss
        when ``auto``'s trial measured it already; :mod:`.run_compensation`).
        """
        assert self.plan is not None
        if text is None:  # nothing to fit on: said in the plan and the run's lines, not an error after calibrating
            compensation = None
            record = {"granularity": granularity, "applied": False,
                      "checked": "the calibration fed inputs_embeds, no token ids to fit on"}
        else:
            compensation, record = fit_compensation(model, self.plan, text, batch_size, granularity, check_blocks,
                                                    loss_without, unchecked)
            if self.calibration_data is not None:
                record["calibration_data"] = self.calibration_data
        self.plan = dataclasses.replace(self.plan, extra={**self.plan.extra, "compensation": record})
        self.compensation = compensation
        return compensation

    def _extra_strategies(self) -> list[Strategy]:
        """``extra_ratios`` with the strategy's settings (once ``auto`` chose, the chosen setting)."""
        return [dataclasses.replace(self.strategy_used, ratio=ratio)  # type: ignore[type-var]
                for ratio in self.options.extra_ratios or []]

    def summary_lines(self) -> list[str]:
        """The settings line (with the compensation applied, and where a named method's own settings came from) and
        the kept line every front door prints about its plan."""
        assert self.plan is not None
        record = self.plan.extra.get("compensation") or {}
        sources = named_method_sources(self.strategy_asked, self.options.compensation)
        settings = settings_summary(self.plan, record["granularity"] if record.get("applied") else "off", sources)
        return [f"ompmoe: {settings}{auto_note(self.strategy, self.model_type, self.choice)}",
                f"ompmoe: {kept_summary(self.plan)}"]

    def interrupted_line(self, batches_done: int, batches: int | None = None) -> str:
        """The one line a front door prints on Ctrl-C before the run wrote its output (atomically, so nothing was
        written): during calibration, after how many batches; once they all ran (:meth:`finish` under way), while
        pruning and writing."""
        output_dir = self.options.output_dir
        kept = f" ({output_dir} is as it was)" if output_dir is not None else ""
        if self.stats is not None or (batches and batches_done >= batches):
            where = f"after calibration, while pruning and writing {output_dir}" if output_dir is not None else (
                "after calibration, while pruning")
        else:
            where = f"after {batches_done}{f' of {batches}' if batches else ''} calibration batches"
        return f"ompmoe: interrupted {where}; nothing was written{kept}: run the same command again to redo it"

    def heldout_record(self) -> dict[str, Any]:
        """``plan.extra["heldout"]``: the sets, blocks per set and the data settings that cut them."""
        seq_len = getattr(self.data, "seq_len", None)
        blocks = heldout_block_count(self.options.evaluate_blocks, seq_len) if seq_len else (
            self.options.evaluate_blocks or 8)
        return {"sets": list(self.options.evaluate_on or []), "blocks": blocks, "calibration_data": self.calibration_data}

    def heldout_line(self) -> str:
        """``ompmoe: held-out perplexity on 8,192 tokens per set, original -> pruned: heldout:prose 30.10 -> 33.52,
        ...``."""
        parts = [f"{name} {original:.2f} -> {pruned:.2f}{paper_part(original, pruned, self.heldout_paper.get(name))}"
                 for name, (original, pruned) in self.heldout_perplexity.items()]
        # resident, the pruned model measured is the one written: with OMP-MoE+ on, which a plain load runs without
        # (layer by layer it is measured static, which measured_line says)
        adaptive = (f" (with OMP-MoE+ at epsilon {self.options.adaptive_epsilon:g}, as ompmoe.load_pruned runs it; a "
                    "plain from_pretrained runs without)" if self.options.adaptive_epsilon is not None
                    and not self.options.layer_by_layer else "")
        return (f"ompmoe: held-out perplexity on {self.heldout_tokens:,} tokens per set, original -> pruned"
                f"{adaptive}: {', '.join(parts)}")

    def write(self, model: nn.Module | None, show_progress: bool | None = False) -> None:
        """Write ``stats.safetensors``, ``plan.json`` (and ``plan-<ratio>.json``), plots and ``model/``.

        Everything goes into a temporary sibling renamed into place at the end, so a run killed at any point
        leaves the old output or none, never part of a new one.
        """
        options, stats, plan = self.options, self.stats, self.plan
        assert options.output_dir is not None and stats is not None and plan is not None
        with atomic_path(options.output_dir, overwrite=options.overwrite, directory=True, inputs=self.inputs) as tmp:
            steps = ["statistics"] + (["plots"] if options.plots else []) + (["model"] if options.save_model else [])
            bar = iter(progress(steps, "ompmoe writing", show_progress, unit="part"))
            next(bar)
            stats.save(tmp / STATS_FILE)
            plan.save(tmp / PLAN_FILE)
            for strategy in self._extra_strategies():
                strategy.plan(stats).save(tmp / f"plan-{strategy.ratio:g}.json")  # type: ignore[attr-defined]
            if options.plots:
                next(bar)
                write_plots(stats, tmp / PLOTS_DIR, plan=plan, progress=show_progress)
            if options.save_model:
                assert model is not None
                next(bar)
                self.save_model(model, tmp / MODEL_DIR)
            next(bar, None)


__all__ = ["PruningRun", "RunOptions", "run_options"]
