"""The ``ompmoe`` command (``ompmoe --help`` lists its commands): LightningCLI for calibration fits and lm-eval
suites, plus re-planning, plots and reports from saved statistics and results."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import numbers
import sys
from argparse import ArgumentError
from collections import Counter
from pathlib import Path
from typing import Any

from ._quiet import LIGHTNING_LOGGERS, passive_omp_threads, quiet_third_party
from .cli_args import (
    SHORT_OPTIONS,
    add_run_options,
    bare_flags,
    check_config_files,
    class_paths,
    fail,
    list_option,
    names_option,
    user_errors,
)
from .cli_help import COMMANDS as CLI_COMMANDS
from .cli_help import TOP_HELP, short_help, unknown_command, with_registry_names
from .cli_options import PARSER_SETTINGS, OneLineErrors, unknown_options_line
from .engine.collect.input_kinds import check_input_kind
from .engine.io import atomic_path, check_writable, local_inputs
from .engine.progress import progress
from .help_cache import is_plain_help, print_help

# torch-backed modules load inside the commands, so help and argument errors answer at once; no TYPE_CHECKING
# imports either: jsonargparse executes them to resolve the commands' annotations.


def _ratios(ratio: Any) -> list[float]:
    """``ratio`` as a list of distinct plain floats (one number, NumPy's or torch's too, is a list of one).

    Strings and booleans are refused rather than guessed at, and so are two ratios with the same plan file name
    (``plan-<ratio:g>.json``), since the second would overwrite the first.
    """
    if hasattr(ratio, "tolist") and not isinstance(ratio, (str, bytes)):  # numpy array/scalar, torch tensor
        ratio = ratio.tolist()
    values = list(ratio) if isinstance(ratio, (list, tuple)) else [ratio]
    if not values:
        raise ValueError("give at least one ratio, e.g. --ratio [0.5]")
    result: list[float] = []
    for value in values:
        if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
            value = value.tolist()
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise ValueError(
                f"ratio must be numbers between 0 and 1, e.g. --ratio [0.5]; got {value!r} "
                f"({type(value).__name__})"
            )
        result.append(float(value))
    repeated = [name for name, count in Counter(f"{value:g}" for value in result).items() if count > 1]
    if repeated:
        raise ValueError(
            f"ratio {', '.join(repeated)} is given more than once ({values}); each ratio writes "
            f"plan-<ratio>.json, so give each once, e.g. --ratio {sorted(set(result))}"
        )
    return result


def replan(
    *,
    stats: str,
    ratio: float | list[float],
    output_dir: str,
    allocation: str | None = None,
    risk_weight: float | None = None,
    min_kept_fraction: float | None = None,
    max_kept_fraction: float | None = None,
    model: str | None = None,
    overwrite: bool = False,
    method: str | None = None,
    method_options: dict[str, Any] | None = None,
    zeta: float | None = None,
    tokenizer: str | None = None,
    dtype: str | None = None,
    quiet: bool = False,
    compensation: str | None = None,
    evaluate_on: list[str] | None = None,
    evaluate_blocks: int | None = None,
    layer_by_layer: bool | None = None,
) -> list[Path]:
    """Plan at each ratio from a statistics file; with ``model``, also save each pruned model.

    Without ``method``, the settings not given are those of the fit's plan beside the statistics (``plan.json`` of
    the same statistics): its plan again at other ratios. A method named runs as a fresh ``ompmoe fit --method`` runs
    it, as published: its own allocation and no compensation unless ``allocation`` / ``compensation`` are given
    (risk_weight, kept fractions and zeta are still the fit's). One line says each setting and where it came from.

    Args:
        stats: A ``stats.safetensors`` written by a calibration fit or ``MoEStats.save``.
        ratio: Fractions of routed experts to remove, one plan each (distinct; one number counts as
            a list of one).
        output_dir: Receives ``plan-<ratio>.json`` (and ``model-<ratio>/``) per ratio.
        allocation: A registered allocation (ompmoe.ALLOCATIONS): ALLOCATION_NAMES (default: the named method's own,
            e.g. reap's uniform; else the fit's, else waterfill).
        risk_weight: Lambda of the routing-risk term (default: the fit's, else 3.0).
        min_kept_fraction: Fewest experts a layer may keep, as a fraction of its experts (default: the fit's,
            else 0.375).
        max_kept_fraction: Most experts a layer may keep, as a fraction of its experts (default: the fit's,
            else 0.875).
        model: Model id, path or ``tiny:<model_type>`` the statistics were collected on.
        overwrite: Replace an existing ``output_dir``.
        method: A registered method (ompmoe.METHODS): METHOD_NAMES (default: the fit's, else omp). ``auto``: the
            fit's too, else the setting recommended for the architecture.
        method_options: The method's options, e.g. ``--method_options.seed 3``: METHOD_OPTIONS (default: the
            fit's when its method is used).
        zeta: Stabilizer inside the routing-risk logarithm (default: the fit's, else 1e-6).
        tokenizer: Tokenizer (hub id or path) saved with each model; default: ``model``'s own
            (a warning names this option when none is found).
        dtype: Weights dtype of the saved models; default: the source checkpoint's.
        quiet: No progress bar and no summary lines (errors are still printed).
        compensation: With ``model``: refit each pruned model's kept experts to the unpruned model's output
            (``off``, ``layer``, ``expert``, ``linear`` or ``down``; RunOptions.compensation) on the fit's
            calibration text, cut again from the data settings its plan recorded. Default: ``off`` with a method
            named, else what the fit applied.
        evaluate_on: With ``model``: held-out sets (``heldout:prose``, ``heldout:code`` or any calibration source)
            on which each ratio prints perplexity original -> pruned. Default: the fit's (its plan records them).
        evaluate_blocks: Blocks per held-out set (default: the fit's, else 8,192 tokens' worth).
        layer_by_layer: With ``model``: refit and measure each plan one decoder layer at a time, in one pass over the
            checkpoint's files per ratio, and write each model from them (a model bigger than memory; a local or
            downloadable safetensors checkpoint in its own dtype). Default: as the fit calibrated, and for a
            quantized checkpoint with equal expert counts in every layer (written in its format: the kept tensors as
            stored, compensated down projections quantized again).
    """
    from .engine.apply.compensation_step import compensation_line
    from .engine.collect.statistics import MoEStats
    from .engine.export.checkpoint import check_save_dtype
    from .engine.perplexity import perplexity
    from .engine.planning.strategy import AUTO, PruningStrategy
    from .engine.apply.trial import pruned_view
    from .engine.run import PruningRun, paper_plan
    from .engine.summary import auto_note, kept_summary, settings_summary

    ratio = _ratios(ratio)
    for option, value in (("--dtype", dtype), ("--tokenizer", tokenizer)):
        if value is not None and model is None:
            raise ValueError(f"{option} applies to the models prune writes: give --model (plans alone hold no "
                             "weights)")
    check_save_dtype(dtype, "--dtype")
    check_input_kind(stats, "statistics")
    fit_plan = Path(stats).parent / FIT_PLAN
    inputs = local_inputs(stats, fit_plan, model, tokenizer)
    check_writable(output_dir, overwrite, directory=True, inputs=inputs)
    statistics = MoEStats.load(stats)
    settings, sources, taken, fit = _settings(statistics, fit_plan, dict(
        method=method, allocation=allocation, risk_weight=risk_weight, min_kept_fraction=min_kept_fraction,
        max_kept_fraction=max_kept_fraction, zeta=zeta, method_options=method_options))
    refit = _compensation(compensation, fit, model, fit_plan, named=method not in (None, AUTO),
                          from_files=layer_by_layer is not False)
    sources["compensation"] = refit.source
    heldout = _heldout(evaluate_on, evaluate_blocks, fit, model)
    runs = [PruningRun(owner="ompmoe prune", strategy=PruningStrategy(ratio=r, **settings), tokenizer=tokenizer,
                       dtype=dtype, plots=False) for r in ratio]
    for run in runs:  # plans are microseconds: all made (and checked) before any model loads
        run.replan(statistics)
    # Nothing in memory differs from the files (no refit, no held-out perplexity, the source dtype), or the refit and
    # the held-out perplexity run layer by layer: each pruned checkpoint is written from the model's files one
    # decoder layer at a time, the model never loaded.
    from_files = _layer_by_layer(layer_by_layer, fit, model, dtype)
    layerwise = from_files and bool(refit.granularity or heldout)  # measured layer by layer: one pass per ratio
    source = (_layer_by_layer_source(model) if from_files else  # type: ignore[arg-type]
              _streamable_source(model, dtype) if model is not None and not refit.granularity and not heldout else None)
    # A mismatched model is refused before anything is written.
    checked = _check_model(model, statistics, source) if model is not None else None
    if model is not None:  # every ratio's model fits the disk, or nothing is written
        _check_space(runs, output_dir, checked if checked is not None else _skeleton(source), source)  # type: ignore
    text, check = _calibration_text(refit.data, refit.check_blocks, tokenizer or model) if refit.granularity else (
        None, None)
    heldout_blocks, heldout_record = _heldout_blocks(heldout, tokenizer or model)
    refit_text = fit_data(fit)  # the data settings of the statistics' calibration text, as the fit recorded them
    if refit.note and not quiet:
        print(refit.note)
    written: list[Path] = []
    original: dict[str, float] = {}
    with atomic_path(output_dir, overwrite=overwrite, directory=True, inputs=inputs) as tmp, \
            contextlib.ExitStack() as stack:  # a ratio's per-layer corrections, kept until its model is written
        for run in progress(runs, "ompmoe prune", False if quiet else None, unit="ratio"):
            plan = run.plan
            if not quiet and not written:
                print(f"ompmoe prune: {settings_summary(plan, refit.granularity or 'off', sources)}"
                      f"{auto_note(run.strategy, statistics.model_type)}"
                      + (f" ({', '.join(taken)} from the fit's plan {fit_plan})" if taken else ""))
            name = f"{run.strategy.ratio:g}"
            loaded = (_skeleton(source, model if layerwise else None) if source is not None else
                      checked if checked is not None else  # the model loaded to check it: the first ratio's
                      _load_model(model, statistics) if model is not None else None)
            checked = None
            run.source = str(source) if source is not None else None
            if heldout_record:  # as a fit records it: the plans of both say what they were measured on
                run.plan = dataclasses.replace(run.plan, extra={**run.plan.extra, "heldout": heldout_record})
            if (heldout_record or refit.granularity) and refit_text is not None:  # and the text they came from
                run.plan = dataclasses.replace(run.plan, extra={**run.plan.extra, "calibration_data": refit_text})
            # inside the output's temporary: removed before the commit, and a killed run's with it by the next run
            scratch = stack.enter_context(run.layer_by_layer_scratch(tmp)) if layerwise else None
            measured = None
            unchecked = f"applied as asked (compensation={refit.granularity!r})"
            if loaded is not None and refit.granularity:
                run.calibration_data = refit.data  # recorded again: what the fit was compensated on
            if scratch is not None and loaded is not None:  # the refit and held-out perplexity in one pass
                measured = run.measure_from_files(loaded, refit.granularity, text, check, unchecked, heldout_blocks,
                                                  scratch, original=original)  # the first ratio's pass measured it
                original = {key: pair[0] for key, pair in measured.heldout.items()}
                if not quiet:
                    line = run.measured_line(measured, heldout_blocks, "one pass") or ""
                    print(f"ratio {run.strategy.ratio:g}: {line.removeprefix('ompmoe: ')}")
            if loaded is not None and heldout_blocks and not original:
                original = {key: perplexity(loaded, blocks) for key, blocks in heldout_blocks.items()}
            if loaded is not None and refit.granularity and measured is None:
                run.compensate(loaded, refit.granularity, text, check_blocks=check, unchecked=unchecked)
            if loaded is not None and refit.granularity and not quiet:
                line = compensation_line(run.plan.extra["compensation"]).removeprefix("ompmoe: ")
                print(f"ratio {run.strategy.ratio:g}: {line}")
            run.plan.save(tmp / f"plan-{name}.json")
            written.append(Path(output_dir) / f"plan-{name}.json")
            if loaded is not None:
                paper = paper_plan(run.strategy_used, statistics, run.plan, run.compensation) if heldout_blocks else None
                if paper is not None and measured is None:  # as a fit's line: the paper's setting beside the run's
                    with pruned_view(loaded, paper):
                        run.heldout_paper = {key: perplexity(loaded, blocks) for key, blocks in heldout_blocks.items()}
                pruned = run.apply(loaded)
                if heldout_blocks:
                    run.heldout_perplexity = (dict(measured.heldout) if measured is not None else
                                              {key: (original[key], perplexity(pruned, blocks))
                                               for key, blocks in heldout_blocks.items()})
                    run.heldout_tokens = min(blocks.numel() for blocks in heldout_blocks.values())
                    if not quiet:
                        print(f"ratio {run.strategy.ratio:g}: {run.heldout_line().removeprefix('ompmoe: ')}")
                run.save_model(pruned, tmp / f"model-{name}")
                written.append(Path(output_dir) / f"model-{name}")
            stack.close()  # this ratio's corrections are written: their scratch goes before the next ratio's
            if not quiet:
                print(f"ratio {run.strategy.ratio:g}: {kept_summary(plan)} -> {written[-1]}")
    return written


FIT_PLAN = "plan.json"
"""The plan a calibration fit (``ExpertPruning``, ``ompmoe-demo``) writes beside its ``stats.safetensors``."""


def _settings(statistics: Any, fit_plan: Path, given: dict[str, Any]
              ) -> tuple[dict[str, Any], dict[str, str], list[str], Any]:
    """``PruningStrategy`` settings; where the method and allocation came from (``option``, ``the fit's plan``,
    ``default``, ``<method>'s own``); the other names taken from the fit's plan; and that plan (``None``: none, or
    made from other statistics).

    Without a method, the settings not given are the fit's plan's (if made from these statistics), else the defaults.
    A method named runs as published: its own allocation (``auto``) unless one is given. The method's options come
    from the plan only with its method. A method or allocation ``auto`` alone is the fit's too: what ``auto`` chose
    there, by trying candidates on text this command lacks.
    """
    from .engine.planning.plan import PruningPlan
    from .engine.planning.strategy import AUTO, PruningStrategy
    from .engine.summary import own_allocation_note

    named = given.get("method") not in (None, AUTO)
    auto = {name for name in ("method", "allocation") if given.get(name) == AUTO}
    given = {name: None if name in auto else value for name, value in given.items()}
    if named and given["allocation"] is None:
        given["allocation"] = AUTO  # the named method's own
    plan = None
    if any(value is None for value in given.values()) and fit_plan.is_file():
        try:
            plan = PruningPlan.load(fit_plan)
        except ValueError as error:
            raise ValueError(f"{error} (ompmoe prune reads the fit's plan beside --stats for the settings not given; "
                             "give --method, --allocation, --risk_weight, --min_kept_fraction, --max_kept_fraction, "
                             "--zeta and --method_options to do without it)") from None
        made_from = (plan.fingerprint, plan.model_id, plan.num_tokens)
        plan = plan if made_from == (statistics.fingerprint, statistics.model_id, statistics.num_tokens) else None
    defaults = {field.name: field.default for field in dataclasses.fields(PruningStrategy)}
    settings, sources, taken = {}, {}, []
    for name, value in given.items():
        if name == "method_options":
            if value is None and plan is not None and settings["method"] == plan.method and plan.extra.get(name):
                value = dict(plan.extra[name])
                taken.append(name)
            settings[name] = dict(value or {})
            continue
        if value is None and plan is not None:
            settings[name], source = getattr(plan, name), "the fit's plan"
        elif value is None:
            settings[name], source = (AUTO, "option") if name in auto else (defaults[name], "default")
        else:
            settings[name], source = value, "option"
        if name in ("method", "allocation"):
            sources[name] = source
        elif source == "the fit's plan":
            taken.append(name)
    if named and settings["allocation"] == AUTO:
        sources["allocation"] = f"{settings['method']}'s own"
    elif named and (note := own_allocation_note(settings["method"], settings["allocation"])):
        sources["allocation"] = f"{sources['allocation']}; {note}"
    return settings, sources, taken, plan


@dataclasses.dataclass
class _Refit:
    """What ``prune`` fits: the granularity (``None``: nothing), the fit's data settings to cut its calibration text
    with, the choice blocks the fit checked it on, where the setting came from, and a line to print when the fit's
    compensation is not done."""

    granularity: str | None = None
    data: dict[str, Any] | None = None
    check_blocks: int | None = None  # None: the fit did not check its compensation
    source: str = "default"
    note: str | None = None


def _compensation(given: str | None, fit: Any, model: str | None, fit_plan: Path, named: bool,
                  from_files: bool = True) -> _Refit:
    """The granularity given, else none for a named method (as published), else the one the fit fitted (``down``
    also when its choice was the linear map); refused, before any work, where it cannot be done (``from_files``: the
    model may be written from its files, which a quantized checkpoint's are as stored)."""
    from .engine.apply.compensation import GRANULARITIES, CompensationError, without_fix
    from .engine.quantized_files import QuantizedCheckpointError
    from .engine.stored_formats import COMPENSATION_STORED, format_name, requantizes, with_article

    if given is not None and given not in ("off", *GRANULARITIES):
        raise ValueError(f"--compensation must be off, {', '.join(GRANULARITIES)}; got {given!r} (the default: off "
                         "with a method named, else what the fit applied)")
    record = (fit.extra.get("compensation") or {}) if fit is not None else {}
    if given is not None:
        granularity, source = given, "option"
    elif named:
        granularity, source = None, "none for a named method"
    elif fit is not None:  # a fit's plan without a record: the fit compensated nothing
        granularity = record.get("fitted", record.get("granularity")) if record.get("applied") else None
        source = "the fit's plan"
    else:
        granularity, source = None, "default"
    if model is None and granularity not in (None, "off"):
        if given is not None:
            raise ValueError("--compensation refits the pruned models' experts: give --model (plans alone hold no "
                             "weights)")
        return _Refit(source="plans only: no --model")
    if granularity in (None, "off"):
        return _Refit(source=source)
    stored = _stored_quantization(model) if model is not None and from_files else None
    if stored is not None and not requantizes(stored):  # its kept tensors are written as stored, never requantized
        if given is not None:  # a refit would change them
            raise QuantizedCheckpointError(COMPENSATION_STORED.format(source=model, format=format_name(stored)).replace(
                "compensation='off'", "--compensation off"))
        return _Refit(source=f"none for {with_article(stored)} checkpoint")
    if stored is not None and (obstacle := _compensation_obstacle(model)) is not None:  # before a layer is read
        why = without_fix(obstacle).rstrip(".")
        if given is not None:
            raise CompensationError(f"{why}. Run without compensation (--compensation off).")
        return _Refit(source=f"none: {why}")
    data = fit_data(fit)
    if data is None:
        where = (f"the fit's plan {fit_plan} records no calibration data settings to cut it again (its text came "
                 "from elsewhere than ompmoe.CalibrationDataModule)" if fit is not None else
                 f"no fit's plan of these statistics ({fit_plan}) records the calibration data")
        if given is None:
            return _Refit(source="not redone", note=f"ompmoe prune: the fit compensated its model, these are not: "
                                                    f"{where}")
        raise ValueError(f"--compensation {given} fits on the fit's calibration text, but {where}; pass "
                         "--compensation off")
    return _Refit(granularity, data, record.get("check_blocks"), source)


def _compensation_obstacle(model: str) -> Any:
    """:func:`~ompmoe.engine.apply.compensation.compensation_obstacle` of the checkpoint ``model``'s weightless
    skeleton, as a run asks it of the model it starts on."""
    from .engine.apply.compensation import compensation_obstacle
    from .engine.export.config import load_stock_config
    from .engine.lazy_checkpoint import build_skeleton

    return compensation_obstacle(build_skeleton(load_stock_config(model)))


def fit_data(fit: Any) -> dict[str, Any] | None:
    """The data settings of a fit's calibration text, wherever its plan records them: on their own (a fit on
    ompmoe.CalibrationDataModule), or in its compensation or held-out record (plans of earlier ompmoe versions)."""
    if fit is None:
        return None
    return (fit.extra.get("calibration_data") or (fit.extra.get("compensation") or {}).get("calibration_data")
            or (fit.extra.get("heldout") or {}).get("calibration_data"))


@dataclasses.dataclass
class _Heldout:
    """The held-out sets ``prune`` measures each pruned model on, blocks per set and the data settings to cut them."""

    sets: list[str]
    blocks: int | None
    data: dict[str, Any]


def _heldout(given: list[str] | None, blocks: int | None, fit: Any, model: str | None) -> _Heldout | None:
    """The sets given, else the fit's (its plan's ``extra.heldout``), cut with the fit's data settings (tokenizer,
    ``seq_len``) where its plan records them; refused without ``model`` when given."""
    if blocks is not None and blocks <= 0:
        raise ValueError(f"--evaluate_blocks must be positive (default: the fit's, else 8,192 tokens' worth); got "
                         f"{blocks}")
    record = (fit.extra.get("heldout") or {}) if fit is not None else {}
    sets = list(given) if given is not None else list(record.get("sets") or [])
    if given and model is None:
        raise ValueError("--evaluate_on measures the pruned models: give --model (plans alone hold no weights)")
    if not sets or model is None:
        return None
    fit_blocks = record.get("blocks") if given is None or sets == record.get("sets") else None
    data = fit_data(fit)
    return _Heldout(sets, blocks or fit_blocks, dict(data or {}))


def _data_module(settings: dict[str, Any], tokenizer: str | None) -> Any:
    """A ``CalibrationDataModule`` with the fit's recorded data settings (the ones it accepts); ``tokenizer`` where
    they name none."""
    from .lightning.calibration_data import CalibrationDataModule

    accepted = inspect.signature(CalibrationDataModule).parameters
    settings = {key: value for key, value in settings.items() if key in accepted}
    settings["tokenizer"] = settings.get("tokenizer") or tokenizer
    return CalibrationDataModule(**settings)


def _calibration_text(data: dict[str, Any] | None, check_blocks: int | None, tokenizer: str | None
                      ) -> tuple[Any, Any]:
    """The fit's calibration blocks, cut again, and the choice blocks after them if it checked its compensation."""
    module = _data_module(data or {}, tokenizer)
    return module.blocks, module.choice_blocks(check_blocks) if check_blocks else None


def _heldout_blocks(heldout: _Heldout | None, tokenizer: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``{set: blocks}`` cut like the fit's calibration blocks (its ``seq_len``, else 256 tokens per block), and the
    plans' ``extra.heldout`` record of them (as :meth:`PruningRun.heldout_record`)."""
    from .engine.perplexity import heldout_block_count

    if heldout is None:
        return {}, {}
    cut = {key: heldout.data[key] for key in ("tokenizer", "seq_len", "text_field") if heldout.data.get(key)}
    module = _data_module({"seq_len": HELDOUT_SEQ_LEN, **cut}, tokenizer)  # the fit's files are not read
    count = heldout_block_count(heldout.blocks, module.seq_len)
    record = {"sets": heldout.sets, "blocks": count, "calibration_data": heldout.data or None}
    return {name: module.heldout_blocks(name, count) for name in heldout.sets}, record


HELDOUT_SEQ_LEN = 256
"""Tokens per held-out block when no fit's plan records its calibration ``seq_len`` (``configs/tiny.yaml``'s)."""


def plot(*, stats: str, output_dir: str, plan: str | None = None, overwrite: bool = False,
         quiet: bool = False) -> list[Path]:
    """Write reconstruction-gain heatmaps, residual/risk curves, the allocation and the high-contribution table.

    Args:
        stats: A ``stats.safetensors`` written by a calibration fit or ``MoEStats.save``.
        output_dir: Receives the PNG files, ``residual_curves.csv``, ``high_contribution.md`` / ``.csv``
            (and with ``plan``, ``allocation.png`` / ``.csv``).
        plan: A ``plan.json`` made from these statistics, to mark each layer's kept count.
        overwrite: Replace an existing ``output_dir``.
        quiet: No progress bars and no list of written files.
    """
    from .engine.collect.statistics import MoEStats
    from .engine.export.plots import write_plots
    from .engine.planning.plan import PruningPlan

    check_input_kind(stats, "statistics")
    if plan is not None:
        check_input_kind(plan, "plan")
    inputs = local_inputs(stats, plan)
    check_writable(output_dir, overwrite, directory=True, inputs=inputs)
    statistics = MoEStats.load(stats)
    pruning_plan = PruningPlan.load(plan) if plan is not None else None
    with atomic_path(output_dir, overwrite=overwrite, directory=True, inputs=inputs) as tmp:
        written = [Path(output_dir) / path.name
                   for path in write_plots(statistics, tmp, plan=pruning_plan, progress=False if quiet else None)]
    for path in [] if quiet else written:
        print(path)
    return written


def _layer_by_layer(given: bool | None, fit: Any, model: str | None, dtype: str | None) -> bool:
    """Whether ``prune`` refits and measures one decoder layer at a time: as given, else as the fit calibrated (its
    plan's ``extra.calibration``), or for a checkpoint stored quantized (its pruned tensors written as stored);
    refused, before any work, where it cannot be done."""
    from .engine.export.config import non_uniform_config
    from .engine.run import LAYER_BY_LAYER
    from .engine.stored_formats import format_name
    from .lightning.models import resolve_model

    if model is None:
        if given:
            raise ValueError("--layer_by_layer reads the model's files: give --model (plans alone hold no weights)")
        return False
    fit_mode = (fit.extra.get("calibration") or {}).get("mode") if fit is not None else None
    stored = _stored_quantization(model) if given is None and fit_mode != LAYER_BY_LAYER else None
    if stored is not None and non_uniform_config(resolve_model(model)) is not None:
        stored = None  # a skeleton cannot read per-layer counts: it loads, as before (dequantized)
    wanted = given if given is not None else fit_mode == LAYER_BY_LAYER or stored is not None
    if wanted and dtype is not None:
        why = ("" if given else f" (the model stores {format_name(stored)} weights, written in that format)" if stored
               else " (the fit ran layer by layer, so its plans are refitted and measured so too)")
        raise ValueError(f"--layer_by_layer writes the checkpoint's tensors as its files store them; got --dtype "
                         f"{dtype}{why}. Remove --dtype, or pass --layer_by_layer false to load the model.")
    return bool(wanted)


def _layer_by_layer_source(name: str) -> Path:
    """The local safetensors checkpoint of ``name`` to refit, measure and write from layer by layer; a clear error
    for a model that has none (a tiny model) or whose files a skeleton cannot read (per-layer expert counts)."""
    from .lightning.layer_by_layer import layer_by_layer_checkpoint
    from .lightning.models import is_tiny

    if is_tiny(name):
        raise ValueError(f"--layer_by_layer reads the model's safetensors files, and {name} has none (it is built in "
                         "memory); pass --layer_by_layer false.")
    return layer_by_layer_checkpoint(name, "--layer_by_layer", "pass --layer_by_layer false to load it")


def _streamable_source(name: str, dtype: str | None) -> Path | None:
    """The local safetensors checkpoint of ``name`` when ``ompmoe prune`` can write from its files (never a tiny
    model, nor a new dtype), else ``None`` (then the model is loaded)."""
    from .lightning.layer_by_layer import local_checkpoint
    from .lightning.models import is_tiny

    from .engine.export.config import non_uniform_config

    if is_tiny(name) or dtype is not None:
        return None
    try:
        source = local_checkpoint(name)
    except (ValueError, FileNotFoundError):
        return None
    return None if non_uniform_config(source) is not None else source  # per-layer counts: load_pruned builds them


def _check_space(runs: list[Any], output_dir: str, model: Any, source: Path | None = None) -> None:
    """Refuse, before any model is pruned, an ``output_dir`` whose disk cannot hold every ratio's pruned model."""
    from .engine.disk_space import require_free_space

    needed = sum(run.pruned_model_bytes(model, source) for run in runs)
    what = "the pruned model needs" if len(runs) == 1 else f"the {len(runs)} pruned models need"
    require_free_space(output_dir, needed, what, "free space there, or choose another --output_dir (without --model, "
                       "prune writes the plans only)")


def _skeleton(source: Path, measured_as: str | None = None) -> Any:
    """The model of ``source`` without weights (its files are read layer by layer when it is written); to measure
    it layer by layer (``measured_as``: the model's name), in the dtype a fit loads that model in (``load_model``'s:
    float32 for a shipped model, whose files are bf16 for size only, else the files')."""
    from .engine.export.config import load_stock_config
    from .engine.lazy_checkpoint import build_skeleton, checkpoint_dtype
    from .lightning.models import default_dtype

    config = load_stock_config(source)
    measured = default_dtype(measured_as) if measured_as is not None else None
    return build_skeleton(config, dtype=measured or checkpoint_dtype(config))


def _check_model(name: str, statistics: Any, source: Path | None) -> Any:
    """Refuse a model the statistics were not collected on, before anything is written: on its skeleton when it
    will be written from its files (nothing loaded; returns ``None``), else loaded (returns it: the first ratio
    prunes it, so a resident prune loads the model once per ratio, not once more to check it)."""
    if source is None:
        return _load_model(name, statistics)
    from .lightning.calibration_module import check_prunable

    from .engine.export.config import load_stock_config
    from .engine.export.load import check_checkpoint_files

    check_prunable(name, option="--model", action="prune", statistics_model=statistics.model_id)
    check_checkpoint_files(source, load_stock_config(source))
    skeleton = _skeleton(source)
    skeleton.config._name_or_path = name
    statistics.check_compatible(skeleton)
    return None


def _stored_quantization(name: str) -> dict[str, Any] | None:
    """The ``quantization_config`` of the model ``name`` (a path, a shipped model or a hub id: its ``config.json``
    only) if it is stored in a format ompmoe reads (block FP8, MXFP4, compressed-tensors), else ``None``; other
    quantizations are refused here."""
    import transformers

    from .engine.hub import cache_only_where_unreachable
    from .engine.stored_formats import stored_settings
    from .lightning.models import is_tiny, resolve_model

    if is_tiny(name):
        return None
    try:
        source = str(resolve_model(name))
        with cache_only_where_unreachable(source):
            config, _ = transformers.PreTrainedConfig.get_config_dict(source)
    except OSError:  # no such model: the load says so, with its own message
        return None
    return stored_settings(config)


def _load_model(name: str, statistics: Any) -> Any:
    """The model ``name`` (as a calibration fit loads it), refused unless ``statistics`` were collected on it; a
    dense model, or one ompmoe pruned (unless the statistics are its own), before its weights load."""
    from .engine.apply.quantized import QuantizedModelError, quant_method
    from .lightning.calibration_module import check_prunable
    from .lightning.models import load_model

    check_prunable(name, option="--model", action="prune", statistics_model=statistics.model_id)
    model = load_model(name).eval()
    method = quant_method(model.config)
    if method is not None:  # loaded quantized (a block-FP8 checkpoint on a GPU): refused before any forward
        raise QuantizedModelError(f"--model {name} was loaded quantized (quant_method={method!r}); prune computes "
                                  "on full-precision weights: pass --layer_by_layer true, which reads a block-FP8, "
                                  "MXFP4 or compressed-tensors checkpoint's weights dequantized and writes the kept "
                                  "ones as stored.")
    statistics.check_compatible(model)
    return model


def lightning_cli(args: list[str] | None = None) -> None:
    """``ompmoe fit``/``predict`` (LightningCLI on the calibration modules) and ``validate``/``test`` (the lm-eval
    suite of :mod:`ompmoe.eval`); ``--quiet`` turns off Lightning's bars, model summary and info lines for this
    command."""
    given = list(sys.argv[1:] if args is None else args)
    args = class_paths(given)
    if "--quiet" not in args:
        return _lightning_cli(args, given)
    args = [arg for arg in args if arg != "--quiet"]  # Lightning's own switches (:mod:`ompmoe._quiet` drops the rest)
    args += ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
    from transformers.utils import logging as hf_logging

    loggers = [logging.getLogger(name) for name in LIGHTNING_LOGGERS]
    levels, bars = [logger.level for logger in loggers], hf_logging.is_progress_bar_enabled()
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    hf_logging.disable_progress_bar()
    try:
        return _lightning_cli(args, given)
    finally:  # for this command only: a later one in the same process (a notebook, a test) is not quiet
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        if bars:
            hf_logging.enable_progress_bar()


def _lightning_cli(args: list[str], given: list[str]) -> None:
    """:func:`lightning_cli` on ``args`` (``given``: the command as typed)."""
    from unittest import mock

    from lightning.pytorch.cli import LightningCLI

    from .eval.cli import EVAL_SUBCOMMANDS, eval_cli

    # Lightning starts the other processes of a multi-device run by running sys.argv again: it holds this command
    # (as given: each process parses it itself) while the run goes on; only while LightningCLI parses ``args`` is it
    # bare (OneLineErrors.parse_arguments: it warns when both hold arguments; ``args`` are always meant).
    with mock.patch.object(sys, "argv", [sys.argv[0], *given]):
        if args and args[0] in EVAL_SUBCOMMANDS:
            return eval_cli(args)

        from .lightning.calibration_data import CalibrationDataModule
        from .lightning.calibration_module import CalibrationModule

        class CalibrationCLI(OneLineErrors, LightningCLI):
            """``fit`` with the short pruning options every front door takes (``--ratio``, ``--output_dir``, ...)."""

            def add_arguments_to_parser(self, parser: Any) -> None:
                add_run_options(parser, short_only=True)

            def before_instantiate_classes(self) -> None:
                apply_short_options(self.config.get(self.subcommand, self.config), self.subcommand)

        CalibrationCLI(
            CalibrationModule,
            CalibrationDataModule,
            save_config_kwargs={"overwrite": True},
            trainer_defaults={"enable_model_summary": False},  # forward-only: no trainable parameters to list
            args=args,
        )


def apply_short_options(config: Any, subcommand: str | None) -> None:
    """Move ``--ratio``/``--method``/``--allocation``/``--output_dir``/``--overwrite`` into the config's
    ``ExpertPruning`` callback (its strategy for the first three); refuse them where there is none."""
    given = {name: value for name in SHORT_OPTIONS if (value := config.pop(name, None)) is not None}
    if not given:
        return
    callbacks = [cb for cb in (config.get("trainer.callbacks") or [])
                 if str(cb.get("class_path", "")).endswith("ExpertPruning")]
    if len(callbacks) != 1:
        raise ValueError(f"--{next(iter(given))} sets the ExpertPruning callback's option, but the {subcommand} "
                         f"config has {len(callbacks) or 'no'} ExpertPruning callbacks; add one (as "
                         "configs/tiny.yaml does) or set the option on it as --trainer.callbacks.init_args.<name>.")
    init_args = callbacks[0].init_args
    for name, value in given.items():
        if SHORT_OPTIONS[name] == "run":
            init_args[name] = value
        elif init_args.get("strategy") is None:
            raise ValueError(f"--{name} sets the ExpertPruning callback's strategy, which the config leaves out; "
                             "give it as configs/tiny.yaml does (class_path: ompmoe.PruningStrategy).")
        else:
            init_args.strategy.init_args[name] = value


COMMANDS = {"prune": replan, "plot": plot}

# Boolean parameters of the prune/plot commands, accepted bare (``--overwrite`` = ``--overwrite true``).
FLAGS = ("overwrite", "quiet")

USER_ERRORS = user_errors()


def _one_line(message: str, command: str) -> str:
    """A jsonargparse error as one line; a bad ``--ratio`` as what to type instead."""
    if message.startswith('Parser key "ratio"'):
        given = message.rsplit("Given value:", 1)[-1] if "Given value:" in message else message.rsplit("value:", 1)[-1]
        return (f"ratio must be a number between 0 and 1 or a list of them, e.g. --ratio 0.5 or "
                f"--ratio [0.25,0.5]; got {given.strip()}")
    options = [f"--{name}" for name in inspect.signature(COMMANDS[command]).parameters]
    return unknown_options_line(message, options, f"ompmoe {command}")


def command_cli(argv: list[str]) -> None:
    """``ompmoe prune``/``plot``: jsonargparse on the function; its help names the registered methods."""
    from jsonargparse import auto_cli

    command = COMMANDS[argv[0]]
    if {"-h", "--help"} & set(argv[1:]) and "METHOD_NAMES" in (command.__doc__ or ""):
        command.__doc__ = with_registry_names(command.__doc__ or "")
    args = bare_flags(names_option(list_option(argv[1:], "ratio"), "evaluate_on"), FLAGS)
    try:
        auto_cli(command, args=args, prog=f"ompmoe {argv[0]}", **PARSER_SETTINGS)
    except ArgumentError as error:  # jsonargparse's multi-line message, as one line
        raise ValueError(_one_line(str(error), argv[0])) from None


def _interrupted_line(argv: list[str]) -> str:
    """The one line ``ompmoe`` prints on Ctrl-C that no loop of its own reported. ``prune`` and ``plot`` write their
    ``--output_dir`` atomically (``ompmoe.engine.io.atomic_path``), so an interrupt leaves it as it was; the line says
    so, naming it when the command line gives it (not a config file given after it)."""
    if not argv or argv[0] not in COMMANDS:
        return "ompmoe: interrupted"
    output_dir = None
    for index, arg in enumerate(argv[1:], start=1):
        if arg == "--output_dir" and index + 1 < len(argv):
            output_dir = argv[index + 1]
        elif arg.startswith("--output_dir="):
            output_dir = arg.split("=", 1)[1]
        elif arg == "--config" or arg.startswith("--config="):
            output_dir = None  # the config may name another one
    kept = f" ({output_dir} is as it was)" if output_dir else ""
    return f"ompmoe: interrupted; nothing was written{kept}: run the same command again to redo it"


def refuse_repeated_lists(argv: list[str], flags: tuple[str, ...]) -> None:
    """A list flag given more than once (``--ratio 0.25 --ratio 0.5``) is refused with the one list it stands for:
    the parser keeps the last, which would silently drop the others."""
    for flag in flags:
        values = [argv[i + 1] if arg == flag and i + 1 < len(argv) else arg.partition("=")[2]
                  for i, arg in enumerate(argv) if arg == flag or arg.startswith(flag + "=")]
        if len(values) > 1:
            joined = ",".join(value.strip("[] ") for value in values)
            raise ValueError(f"{flag} is given {len(values)} times ({', '.join(values)}); the parser keeps only the "
                             f"last. Give them in one list: {flag} [{joined}]")


def main(argv: list[str] | None = None) -> None:
    """The ``ompmoe`` command; a user error is one ``error:`` line on stderr and exit status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    passive_omp_threads(argv[:1] == ["fit"])
    quiet_third_party()
    try:
        if not argv or argv[0] in ("-h", "--help"):
            print(TOP_HELP, end="")
        elif argv[0] not in CLI_COMMANDS and not argv[0].startswith("-"):
            raise ValueError(unknown_command(argv[0]))
        elif short_help(argv[0]) and "-h" in argv[1:] and "--help" not in argv[1:]:
            print(short_help(argv[0]), end="")
        elif argv[0] == "report":  # ompmoe report a.json b.json ... (ompmoe.eval.report)
            from .eval.report import report_cli

            report_cli(argv[1:])
        elif is_plain_help(argv):  # Lightning's full help, built once and then printed from the cache
            print_help(argv, command_cli if argv[0] in COMMANDS else lightning_cli)
        elif argv[0] in COMMANDS:
            refuse_repeated_lists(argv, ("--ratio",) if argv[0] == "prune" else ())
            command_cli(argv)
        else:
            check_config_files(argv)
            lightning_cli(bare_flags(argv, ("overwrite",)))
    except USER_ERRORS as error:
        fail(error)
    except KeyboardInterrupt:  # one line, not Python's traceback; 130 as a shell reports Ctrl-C
        print(_interrupted_line(argv), file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
