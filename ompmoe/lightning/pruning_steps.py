"""The steps of a calibration-and-pruning run, shared by :class:`ompmoe.callbacks.ExpertPruning` (a ``Trainer.fit``)
and :class:`ompmoe.FabricCalibration` (a Fabric loop), so that either loop gives the same statistics, plan and
checkpoint."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.utils.data import DistributedSampler

from ..engine.collect import selected_statistics
from ..engine.extensions import check_statistics, required_statistics
from ..engine.io import atomic_path
from ..engine.plan import PruningPlan
from ..engine.plan_choice import PlanChoice
from ..engine.progress import progress
from ..engine.pruning import prune, save_pruned
from ..engine.statistics import MoEStats
from ..engine.strategy import AUTO, Strategy
from ..engine.summary import kept_summary, settings_summary

STATS_FILE = "stats.safetensors"
PLAN_FILE = "plan.json"
MODEL_DIR = "model"
PLOTS_DIR = "plots"


def require_matplotlib(owner: str) -> None:
    """Fail before calibration when plots are asked for and matplotlib is missing (``owner``: who asked)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(
            f"{owner}(plots=True) writes PNG plots with matplotlib, which is not installed: "
            "pip install matplotlib (or ompmoe[plots]), or pass plots=False."
        ) from None


def check_adaptive_epsilon(adaptive_epsilon: float | None) -> None:
    """Refuse, before any model work, an OMP-MoE+ epsilon outside [0, 1]."""
    if adaptive_epsilon is not None and not 0.0 <= adaptive_epsilon <= 1.0:
        raise ValueError(f"adaptive_epsilon must lie in [0, 1]; got {adaptive_epsilon}.")


def extra_strategies(strategy: Strategy, ratios: Sequence[float]) -> list[Strategy]:
    """``strategy`` at each of the ``extra_ratios`` (written as ``plan-<ratio>.json``)."""
    if ratios and not hasattr(strategy, "ratio"):
        raise TypeError(f"extra_ratios needs a strategy with a `ratio` field; got {type(strategy).__name__}.")
    return [dataclasses.replace(strategy, ratio=ratio) for ratio in ratios]  # type: ignore[type-var]


def validate_strategies(strategies: Iterable[Strategy], routings: Sequence[tuple[str, dict[str, int]]],
                        statistics: Sequence[str], owner: str = "ExpertPruning",
                        model_type: str | None = None) -> list[str]:
    """Refuse, before any forward pass, a ratio the model cannot meet or a strategy whose statistics are not collected;
    return the statistics to collect (``statistics`` plus what each setting ``auto`` tries for ``model_type`` needs).
    """
    statistics = list(statistics)
    for strategy in strategies:
        resolved = strategy.resolved(model_type) if hasattr(strategy, "resolved") else strategy
        tried = [strategy]
        if resolved is not strategy:  # ``auto``: what each setting it tries needs
            tried = [dataclasses.replace(strategy, method=m, allocation=a) for m, a in strategy.settings(model_type)]
            for each in tried:
                statistics = selected_statistics([*statistics, *required_statistics(each.method, each.allocation)])
        for each in tried:
            each.validate(routings)
            check_statistics(each, statistics, owner)
    return statistics


def tries_candidates(strategy: Strategy, model_type: str | None) -> bool:
    """Whether ``strategy`` is ``auto`` with several settings to try for ``model_type`` (a user's own class: no)."""
    return (AUTO in (getattr(strategy, "method", None), getattr(strategy, "allocation", None))
            and callable(getattr(strategy, "settings", None))
            and len(strategy.settings(model_type)) > 1)  # type: ignore[attr-defined]


def auto_note(strategy: Strategy, model_type: str | None, choice: PlanChoice | None = None) -> str:
    """What ``auto`` did, for the settings line (``""`` when the strategy does not use ``auto``)."""
    auto = [name for name in ("method", "allocation") if getattr(strategy, name, None) == AUTO]
    if not auto:
        return ""
    if choice is not None:
        return f" ({' and '.join(auto)} 'auto': {choice.summary()})"
    return f" ({' and '.join(auto)} 'auto': recommended for {model_type}, docs/quality/intervals.md)"


def summary_lines(plan: PruningPlan, strategy: Strategy, model_type: str | None,
                  choice: PlanChoice | None) -> list[str]:
    """The settings line and the kept line a run prints about its plan."""
    return [f"ompmoe: {settings_summary(plan)}{auto_note(strategy, model_type, choice)}",
            f"ompmoe: {kept_summary(plan)}"]


def choice_data(strategy: Strategy, datamodule: Any, num_blocks: int | None, owner: str,
                model_type: str | None) -> torch.Tensor | None:
    """The held-out calibration blocks ``auto`` tries its candidate plans on, or ``None`` (no trial).

    Cut before the statistics pass, so too little text fails before any model work. ``num_blocks=None`` takes the
    data module's default; a data module without ``choice_blocks(n)`` (a plain DataLoader) means the layout's first
    setting, with a warning only when ``num_blocks`` was asked for.
    """
    if num_blocks == 0 or not tries_candidates(strategy, model_type):
        return None
    if not callable(getattr(datamodule, "choice_blocks", None)):
        if num_blocks is None:
            return None
        rank_zero_warn(
            f"{owner}: method/allocation 'auto' tries its candidate plans on held-out calibration blocks, but the data "
            f"module ({type(datamodule).__name__}) has no choice_blocks(n) (ompmoe.CalibrationDataModule has); using "
            f"the setting recommended for {model_type} instead. Pass choice_blocks=0 to silence this."
        )
        return None
    return datamodule.choice_blocks(num_blocks)


def real_sample_count(sampler: Any) -> int | None:
    """How many samples of this rank are real when a ``DistributedSampler`` pads an uneven data set, else ``None``.

    The sampler repeats samples from the start of the data set so every rank gets as many; on each
    rank the repeats come last, after ``len(range(rank, len(dataset), num_replicas))`` real ones.
    """
    if isinstance(sampler, DistributedSampler) and not sampler.drop_last:
        return len(range(sampler.rank, len(sampler.dataset), sampler.num_replicas))  # type: ignore[arg-type]
    return None


def batch_token_weight(
    inputs: Mapping[str, torch.Tensor], first_sample: int, real_samples: int | None
) -> torch.Tensor | None:
    """Per-token weights of a batch (``None``: every token counts): its attention mask, times 0 for samples past
    ``real_samples`` (repeats); ``first_sample`` is the batch's first sample's position on this rank."""
    ids = inputs.get("input_ids", inputs.get("inputs_embeds"))
    assert ids is not None
    num_samples, seq_len = int(ids.shape[0]), int(ids.shape[1])
    weight = inputs.get("attention_mask")
    if real_samples is not None and first_sample + num_samples > real_samples:
        real = torch.arange(first_sample, first_sample + num_samples, device=ids.device) < real_samples
        sample_weight = real.to(torch.float64).unsqueeze(1).expand(num_samples, seq_len)
        weight = sample_weight if weight is None else weight.to(torch.float64) * sample_weight
    return weight


def unsharded(model: nn.Module, is_global_zero: bool) -> nn.Module | None:
    """``model`` itself, or for FSDP-sharded (DTensor) parameters a full CPU copy on rank 0 (``None`` elsewhere);
    gathering is a collective, so every rank must call this."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_global_zero:
        return None
    dtype = next(iter(state.values())).dtype
    full = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
    full.load_state_dict(state)
    return full.eval()


def prune_and_adapt(model: nn.Module, plan: PruningPlan, stats: MoEStats, adaptive_epsilon: float | None) -> None:
    """Prune ``model`` by ``plan``; with ``adaptive_epsilon``, switch on OMP-MoE+ adaptive inference."""
    prune(model, plan)
    if adaptive_epsilon is not None:
        from ..engine.adaptive import enable_adaptive

        enable_adaptive(model, stats, adaptive_epsilon)


def usable_tokenizer(candidates: Iterable[Any]) -> Any | None:
    """The first candidate that names or is a tokenizer to save with the model, else ``None``.

    Tokenizer objects, hub ids and paths count; ``bytes`` and ``tiny:`` names (no files to save) do not.
    ``None`` lets :func:`ompmoe.save_pruned` try the model's source and warn when nothing is found.
    """
    for value in candidates:
        if value is not None and hasattr(value, "save_pretrained"):
            return value
        if isinstance(value, str) and value and value != "bytes" and not value.startswith("tiny:"):
            return value
    return None


def plan_metrics(plan: PruningPlan) -> dict[str, float]:
    """What a run logs about its plan: achieved ratio, cost, and per layer the kept count, residual and coverage."""
    metrics: dict[str, float] = {"ompmoe/achieved_ratio": plan.achieved_ratio, "ompmoe/cost": plan.cost}
    for layer in plan.layers:
        metrics[f"ompmoe/{layer.name}/kept"] = float(layer.num_kept)
        metrics[f"ompmoe/{layer.name}/residual"] = float(layer.residual[layer.num_kept])
        metrics[f"ompmoe/{layer.name}/coverage"] = float(layer.coverage[layer.num_kept])
    return metrics


def write_outputs(
    output_dir: Path,
    *,
    stats: MoEStats,
    plan: PruningPlan,
    model: nn.Module | None,
    overwrite: bool = False,
    inputs: Sequence[str] = (),
    extra: Sequence[Strategy] = (),
    plots: bool = True,
    save_model: bool = True,
    tokenizer: Any = None,
    dtype: str | None = None,
    show_progress: bool | None = False,
) -> None:
    """Write ``stats.safetensors``, ``plan.json`` (and ``plan-<ratio>.json``), plots and ``model/`` on rank 0.

    Everything goes into a temporary sibling renamed into place at the end, so a run killed at any point
    leaves the old output or none, never part of a new one.
    """
    with atomic_path(output_dir, overwrite=overwrite, directory=True, inputs=inputs) as tmp:
        steps = ["statistics"] + (["plots"] if plots else []) + (["model"] if save_model else [])
        bar = iter(progress(steps, "ompmoe writing", show_progress, unit="part"))
        next(bar)
        stats.save(tmp / STATS_FILE)
        plan.save(tmp / PLAN_FILE)
        for strategy in extra:
            strategy.plan(stats).save(tmp / f"plan-{strategy.ratio:g}.json")  # type: ignore[attr-defined]
        if plots:
            from ..recipes.plots import write_plots

            next(bar)
            write_plots(stats, tmp / PLOTS_DIR, plan=plan, progress=show_progress)
        if save_model:
            assert model is not None
            next(bar)
            save_pruned(model, tmp / MODEL_DIR, tokenizer=tokenizer, dtype=dtype,
                        calibration="; ".join(stats.sources) or None)
        next(bar, None)
