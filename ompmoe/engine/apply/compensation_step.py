"""The run's compensation step: after the plan, before pruning, fit :func:`~ompmoe.engine.apply.compensation.compensate` on
the calibration text and decide whether the pruned model gets it (``RunOptions.compensation``).

``auto`` keeps the ``linear`` map of the ``auto`` method unless it raises the loss on ``auto``'s choice blocks by more
than :data:`CHECK_TOLERANCE`; a granularity named outright is always applied. The rules: docs/methods.md."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..adapters import find_moe_layers
from ..perplexity import perplexity
from ..planning.plan import PruningPlan
from ..planning.strategy import AUTO, Strategy
from ..record import within_tolerance
from .compensation import (
    DEFAULT_GRANULARITY,
    GRANULARITIES,
    MAX_SUM_BYTES,
    Compensation,
    CompensationError,
    check_sum_budget,
    compensate,
    compensated_view,
    fitting_tokens,
    heldout_losses,
    spread_rows,
)
from .down_refit import DEFAULT_ALPHA, DOWN_ALPHAS, check_down_refit, down_fitting_tokens, refit_down
from .trial import pruned_view

COMPENSATION_MODES = ("auto", "off", *GRANULARITIES)
"""Values of ``RunOptions.compensation``."""
CHECK_TOLERANCE = 0.02
"""Nats of held-out calibration loss by which compensation may raise the choice blocks' loss and still be kept: on
2,048 tokens a strict "lower" dropped it in 9 of 54 measured cases where it lowered held-out perplexity (each moved
that loss by 0 to +0.011 nats), where always keeping it was right in 52 of 54 (docs/quality/compensation.md)."""


def check_compensation_mode(mode: Any) -> None:
    """Refuse an unknown ``compensation`` value at construction, naming the ones there are."""
    if mode not in COMPENSATION_MODES:
        raise ValueError(f"compensation must be one of {', '.join(COMPENSATION_MODES)} ('auto': for method 'auto', "
                         "the down refit or the linear map, whichever has the lower held-out loss, kept unless it "
                         f"raises that loss; 'off': none); got {mode!r}.")


AUTO_GRANULARITY = "down"
"""What ``compensation="auto"`` fits: the down refit, whose ``alpha`` (the ``linear`` map itself among the
candidates) the choice blocks pick (docs/quality/compensation.md)."""


def compensation_granularity(mode: str, strategy: Strategy) -> str | None:
    """The granularity a run fits, or ``None`` for none: ``auto`` fits only for the ``auto`` method."""
    if mode == "auto":
        return AUTO_GRANULARITY if getattr(strategy, "method", None) == AUTO else None
    return None if mode == "off" else mode


def run_granularity(mode: str, strategy: Strategy, model: nn.Module, per_layer: bool = False) -> str | None:
    """:func:`compensation_granularity` checked against ``model`` before calibrating: where ``linear``'s ``d x d``
    sums (which ``down`` starts from too) would exceed :data:`~ompmoe.engine.apply.compensation.MAX_SUM_BYTES`
    (DeepSeek-V3: 48 GB; ``per_layer``, fitted one layer at a time: one layer's), ``auto`` fits ``expert`` instead
    and a ``linear`` or ``down`` asked for is refused; where the experts are not built on transformers' experts
    interface, ``auto`` fits ``linear`` instead of ``down``."""
    granularity = compensation_granularity(mode, strategy)
    if granularity == "down":
        try:
            for layer in find_moe_layers(model):
                check_down_refit(layer)
        except CompensationError:
            if mode != "auto":
                raise
            granularity = DEFAULT_GRANULARITY  # experts the refit cannot take apart: the linear map
    if granularity not in ("linear", "down"):
        return granularity
    try:  # the down refit starts from the linear map: the same sums
        check_sum_budget(find_moe_layers(model)[:1] if per_layer else find_moe_layers(model), MAX_SUM_BYTES)
    except CompensationError as error:
        if mode == "auto":
            return "expert"
        raise CompensationError(str(error).replace("granularity='linear'", f"granularity={granularity!r}").replace(
            "pass granularity='expert' or a larger max_sum_bytes", "pass compensation='expert' (or 'off')")) from None
    return granularity


def checks_compensation(mode: str, strategy: Strategy) -> bool:
    """Whether the run measures compensation on held-out blocks before keeping it (``auto`` does)."""
    return mode == "auto" and compensation_granularity(mode, strategy) is not None


def data_blocks(data: Any) -> torch.Tensor | None:
    """The data module's calibration blocks ``(num_blocks, seq_len)`` (``CalibrationDataModule.blocks``: the whole
    text, the same on every rank), or ``None``: the text is the batches the loop fed."""
    blocks = getattr(data, "blocks", None)
    return blocks if isinstance(blocks, torch.Tensor) and blocks.dim() == 2 else None


def fitting_text(data: Any, token_batches: Sequence[dict[str, torch.Tensor]]
                 ) -> torch.Tensor | list[dict[str, torch.Tensor]] | None:
    """The calibration text to fit on: the data module's ``blocks`` (the whole set, the same on every rank), else the
    batches this process calibrated on (one tensor when they are unpadded blocks of one length); ``None``: no token
    ids (the calibration fed ``inputs_embeds``)."""
    blocks = data_blocks(data)
    if blocks is not None:
        return blocks
    if not token_batches:
        return None
    lengths = {int(batch["input_ids"].shape[1]) for batch in token_batches}
    if len(lengths) == 1 and not any("attention_mask" in batch for batch in token_batches):
        return torch.cat([batch["input_ids"] for batch in token_batches])
    return list(token_batches)


def calibration_data(data: Any) -> dict[str, Any] | None:
    """The settings of a data module that saved them (``CalibrationDataModule``'s ``hparams``: source, tokenizer,
    seq_len, num_blocks, ...), JSON-able, or ``None``: what lets ``ompmoe prune`` cut the same calibration text."""
    settings = getattr(data, "hparams", None)
    if not isinstance(settings, Mapping) or not isinstance(settings.get("source"), str):
        return None
    return {key: _json_setting(value) for key, value in settings.items()
            if key not in ("batch_size", "num_workers") and not key.startswith("_")}


def _json_setting(value: Any) -> Any:
    """A data setting as the plan's JSON holds it: a tokenizer object by its name or path (``None`` when it has
    none), paths as strings, lists and dicts item by item."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)):
        return [_json_setting(item) for item in value]
    if isinstance(value, Mapping):
        return {str(key): _json_setting(item) for key, item in value.items()}
    name = getattr(value, "name_or_path", None)
    return name if isinstance(name, str) and name else None


def fit_compensation(model: nn.Module, plan: PruningPlan, text: torch.Tensor | list[dict[str, torch.Tensor]],
                     batch_size: int, granularity: str, check_blocks: torch.Tensor | None = None,
                     loss_without: float | None = None, unchecked: str = "applied as asked"
                     ) -> tuple[Compensation | None, dict[str, Any]]:
    """Fit ``plan``'s compensation on the **unpruned** ``model`` over ``text`` (at most a quarter of its tokens,
    :func:`~ompmoe.engine.apply.compensation.fitting_tokens`) and, with ``check_blocks``, keep it unless the pruned
    model's loss there rises by more than :data:`CHECK_TOLERANCE` (``loss_without``: that loss when ``auto``'s trial
    measured it already); without them it is applied, and ``unchecked`` says why in the record.

    Returns the compensation to apply (``None``: not applied) and the record for ``plan.extra["compensation"]``.
    """
    if granularity == "down":
        return _fit_down(model, plan, text, check_blocks, loss_without, unchecked, batch_size)
    text, max_tokens = fitting_text_of(model, granularity, text)
    compensation = compensate(model, plan, text, batch_size, granularity=granularity, max_tokens=max_tokens)
    if check_blocks is None:
        return compensation, dict(compensation.record, applied=True, checked=unchecked)
    if loss_without is None:
        loss_without, loss_with = heldout_losses(model, plan, compensation, check_blocks, batch_size)
    else:
        with compensated_view(model, plan, compensation):
            loss_with = math.log(perplexity(model, check_blocks, batch_size))
    return checked_choice({granularity: compensation}, {granularity: loss_with}, loss_without,
                          int(check_blocks.shape[0]))


def fitting_text_of(model: nn.Module, granularity: str, text: torch.Tensor | list[dict[str, torch.Tensor]]
                    ) -> tuple[torch.Tensor | list[dict[str, torch.Tensor]], int]:
    """The calibration text ``granularity`` fits on and its ``max_tokens`` (``down``: every token up to
    :data:`~.down_refit.MAX_TOKENS`; the others: 16 per hidden dimension, at most a quarter): batches of different
    lengths cut to the fewest evenly spaced ones holding them (padding cannot be re-cut); a tensor is cut by the
    fit itself."""
    tokens = int(text.numel()) if isinstance(text, torch.Tensor) else sum(int(b["input_ids"].numel()) for b in text)
    max_tokens = down_fitting_tokens(model, tokens) if granularity == "down" else fitting_tokens(model, tokens)
    if not isinstance(text, torch.Tensor):
        rows = spread_rows(len(text), max(1, tokens // len(text)), max_tokens)
        text = text if rows is None else [text[i] for i in rows]
    return text, max_tokens


def refit_alphas(checked: bool) -> tuple[float, ...]:
    """The ``alpha`` values the ``down`` refit fits: each of :data:`~.down_refit.DOWN_ALPHAS` when the choice blocks
    pick one, else :data:`~.down_refit.DEFAULT_ALPHA`."""
    return DOWN_ALPHAS if checked else (DEFAULT_ALPHA,)


def refit_candidates(linear: Compensation, refits: Mapping[float, Compensation]) -> dict[str, Compensation]:
    """What ``down``'s choice blocks choose among: the ``linear`` map and each ``alpha``'s refit, by name."""
    return {"linear": linear, **{f"down, alpha {alpha:g}": refit for alpha, refit in refits.items()}}


def checked_choice(candidates: Mapping[str, Compensation], losses: Mapping[str, float], loss_without: float,
                   check_blocks: int) -> tuple[Compensation | None, dict[str, Any]]:
    """The candidate with the lowest loss on the ``check_blocks`` choice blocks, kept unless it raises the pruned
    model's loss there (``loss_without``) by more than :data:`CHECK_TOLERANCE`; ``(None, record)`` when not kept. A
    single candidate's record is its own; among several (``down``) it lists them all (``tried``)."""
    best = min(losses, key=losses.__getitem__)
    compensation = candidates[best]
    record = dict(compensation.record, applied=True) if len(candidates) == 1 else dict(compensation.record)
    record.update(checked="held-out calibration loss", check_blocks=check_blocks, loss_without=loss_without,
                  loss_with=losses[best], tolerance=CHECK_TOLERANCE)
    if len(candidates) > 1:
        record.update(tried={name: round(loss, 6) for name, loss in losses.items()}, fitted="down")
        compensation.record.update(tried=record["tried"])
    record["applied"] = losses[best] < loss_without + CHECK_TOLERANCE
    if not record["applied"]:
        return None, record
    # the kept map carries the check it passed: config.json and the card read the model's record only
    compensation.record.update({key: record[key] for key in
                                ("checked", "check_blocks", "loss_without", "loss_with", "tolerance")})
    return compensation, record


def unchecked_refit(refit: Compensation, unchecked: str) -> tuple[Compensation, dict[str, Any]]:
    """The ``down`` refit applied without choice blocks, and its record."""
    return refit, dict(refit.record, applied=True, checked=unchecked, fitted="down")


def _fit_down(model: nn.Module, plan: PruningPlan, text: torch.Tensor | list[dict[str, torch.Tensor]],
              check_blocks: torch.Tensor | None, loss_without: float | None, unchecked: str, batch_size: int
              ) -> tuple[Compensation | None, dict[str, Any]]:
    """``down``: the refit for each of :data:`~.down_refit.DOWN_ALPHAS` and the ``linear`` map it starts from, fitted
    in one pass; with ``check_blocks`` the one with the lowest loss there, kept unless it raises the loss by more
    than :data:`CHECK_TOLERANCE`; without them the refit at :data:`~.down_refit.DEFAULT_ALPHA`."""
    text, max_tokens = fitting_text_of(model, "down", text)
    linear, refits = refit_down(model, plan, text, max_tokens=max_tokens, alphas=refit_alphas(check_blocks is not None))
    if check_blocks is None:
        return unchecked_refit(refits[DEFAULT_ALPHA], unchecked)
    candidates = refit_candidates(linear, refits)
    losses = {}
    for name, candidate in candidates.items():
        with compensated_view(model, plan, candidate):
            losses[name] = math.log(perplexity(model, check_blocks, batch_size))
    if loss_without is None:
        with pruned_view(model, plan):
            loss_without = math.log(perplexity(model, check_blocks, batch_size))
    return checked_choice(candidates, losses, loss_without, int(check_blocks.shape[0]))


def compensation_line(record: dict[str, Any]) -> str:
    """``ompmoe: compensation (linear, 4096 tokens): held-out calibration loss 3.9510 -> 3.9020, applied``; a map
    kept although it raised the loss says by how much and the tolerance it is within (``applied (it raised the loss by
    0.0100 nats, within the 0.02-nat tolerance)``), so the rise does not read as a mistake (the card says it in the same
    words)."""
    if "num_tokens" not in record:
        return f"ompmoe: compensation ({record['granularity']}) not fitted: {record['checked']}"
    alpha = f", alpha {record['ridge_alpha']:g}" if record.get("granularity") == "down" else ""
    fitted = f"{record['granularity']}{alpha}, {record['num_tokens']} tokens"
    if "loss_with" not in record:
        return f"ompmoe: compensation ({fitted}): {record['checked']}"
    note = within_tolerance(record)
    verdict = (f"applied ({note})" if note else "applied") if record["applied"] else (
        f"not applied (it raised the loss by more than {record['tolerance']})")
    return (f"ompmoe: compensation ({fitted}): held-out calibration loss {record['loss_without']:.4f} -> "
            f"{record['loss_with']:.4f}, {verdict}")


__all__ = ["AUTO_GRANULARITY", "CHECK_TOLERANCE", "COMPENSATION_MODES", "calibration_data", "check_compensation_mode",
           "checks_compensation", "compensation_granularity", "compensation_line", "data_blocks", "fit_compensation",
           "fitting_text", "run_granularity"]
