"""What a run needs the whole model for, done one decoder layer at a time for a model bigger than memory: the
compensation fit, ``auto``'s check of it on the choice blocks, and held-out perplexity, all in **one** more
layer-major pass over the checkpoint (each layer read once more, whatever is asked).

Per decoder layer, read from the files: the fitting text runs through the unpruned layer while the layer's fit
(:class:`~.down_refit._RefitPass`, or the summed systems' :class:`~.compensation._LayerPass`) gathers what it needs,
exactly as the resident fit's hooks do (the same inputs: the unpruned model's); the layer's correction is fitted on
the spot and written to a scratch directory (a layer's refit rows, never the whole model's); then each variant of the
pruned layer (without compensation, with each candidate, the paper's plan) runs its own copy of the choice blocks
and held-out text, as :func:`~.trial.pruned_view` and :func:`~.compensation.compensated_view` run them on a resident
model. After the last layer the model's head gives each variant's loss; the choice is made as the resident run
makes it (:func:`~.compensation_step.checked_choice`), and the streamed writer folds the chosen correction into the
rows it writes. A quantized checkpoint's corrected down projections are measured as they are written, quantized
again (:meth:`~ompmoe.engine.lazy_checkpoint.LazyCheckpoint.grid`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..._quiet import quiet_calls
from ..adapters import MoELayer, architecture_of, find_moe_layers
from ..collect.collector import as_model_inputs
from ..collect.layerwise import LayerMajor, moe_blocks_by_layer
from ..lazy_checkpoint import LazyCheckpoint
from ..planning.plan import PruningPlan
from .compensation import (
    DEFAULT_RIDGE,
    Compensation,
    _count_tokens,
    _fit_layer,
    _LayerPass,
    check_compensable,
    check_regridable,
    corrected_rows,
    layer_summary,
    record_of_summaries,
    spread_blocks,
)
from .compensation_step import (
    checked_choice,
    fitting_text_of,
    refit_alphas,
    unchecked_refit,
)
from .down_refit import SWEEPS, _joined, _RefitPass, check_down_refit, refit_record
from .plan_choice import PlanChoice, check_choice_arguments, chosen, kept_key
from .trial import pruned_layer_view

OFF, PAPER, LINEAR = "off", "paper", "linear"
"""Variants of the pruned layer besides the fitted candidates: no compensation, the paper's plan, the ``linear`` map."""


class LayerStore:
    """Per-layer tensors written to a scratch directory as each layer is fitted, read back when asked: the refit rows
    of a model bigger than memory never sit in memory together."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.files: dict[str, Path] = {}

    def put(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        path = self.directory / f"{len(self.files):05d}.safetensors"
        save_file({key: value.detach().contiguous().cpu() for key, value in tensors.items()}, str(path))
        self.files[name] = path

    def get(self, name: str) -> dict[str, torch.Tensor]:
        path = self.files[name]
        if not path.is_file():
            raise FileNotFoundError(
                f"The layer-by-layer correction of {name} was kept in {self.directory}, which no longer exists: a "
                "run's scratch directory is removed when the run ends. Write the model within the run (output_dir), "
                "or keep the directory given to measure_layer_by_layer until save_pruned_from_files returns.")
        return load_file(str(path))


class StoredScales(Mapping):
    """``Compensation.scales`` read from a :class:`LayerStore` on access (a ``d x d`` map per layer)."""

    def __init__(self, store: LayerStore) -> None:
        self.store = store

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.store.get(name)["scale"]

    def __iter__(self) -> Iterator[str]:
        return iter(self.store.files)

    def __len__(self) -> int:
        return len(self.store.files)


class StoredRows(StoredScales):
    """``Compensation.weights`` read from a :class:`LayerStore` on access: a layer's refit rows (and bias) at ``alpha``."""

    def __init__(self, store: LayerStore, alpha: float) -> None:
        super().__init__(store)
        self.alpha = alpha

    def __getitem__(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:  # type: ignore[override]
        tensors = self.store.get(name)
        return tensors[f"rows {self.alpha:g}"], tensors.get(f"bias {self.alpha:g}")


@dataclass
class LayerByLayerMeasures:
    """What the pass gives the run: the compensation to write (``None``: none), its record, and held-out perplexity."""

    compensation: Compensation | None = None
    record: dict[str, Any] | None = None
    heldout: dict[str, tuple[float, float]] = field(default_factory=dict)
    """``{set: (original, pruned)}``: the pruned model as written (its compensation if applied)."""
    paper: dict[str, float] = field(default_factory=dict)
    """``{set: perplexity}`` of the paper's plan without compensation, where asked."""
    seconds: float = 0.0


class _Fit:
    """One layer's compensation fit during the pass: hooks attached while the fitting text runs, then the fit."""

    def __init__(self, layer: MoELayer, kept: list[int], count_attributes: tuple[str, ...], granularity: str,
                 alphas: tuple[float, ...], num_tokens: float) -> None:
        self.granularity, self.num_tokens = granularity, num_tokens
        if granularity == "down":
            self.layer_pass: _LayerPass = _RefitPass(layer, kept, count_attributes, False, None, alphas, SWEEPS,
                                                     num_tokens)
        else:
            self.layer_pass = _LayerPass(layer, kept, count_attributes, False, granularity == "linear", None)

    def fitted(self) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, float]]:
        """The tensors to store (``scale``; ``rows <alpha>``, ``bias <alpha>``), the record's summary and the refit's
        routed-output errors."""
        each = self.layer_pass
        if isinstance(each, _RefitPass):
            tensors = {"scale": each.linear_map}
            for alpha, (rows, bias) in each.refits.items():
                tensors[f"rows {alpha:g}"] = rows
                if bias is not None:
                    tensors[f"bias {alpha:g}"] = bias
            return tensors, each.summary, dict(each.errors)
        scale = _fit_layer(each.sums, self.granularity, DEFAULT_RIDGE, self.num_tokens)
        return {"scale": scale}, layer_summary(each.sums, scale), {}


def _fitting_batches(model: nn.Module, granularity: str, text: Any, batch_size: int, device: torch.device
                     ) -> tuple[list[Any], float]:
    """The fitting text as the resident fit runs it (``down``: one joined batch; the summed systems: ``batch_size``
    rows at a time) and its token count."""
    text, max_tokens = fitting_text_of(model, granularity, text)
    if isinstance(text, torch.Tensor):
        text = spread_blocks(text, max_tokens)
    if granularity == "down":
        inputs = [as_model_inputs(batch, device) for batch in ([text] if isinstance(text, torch.Tensor) else text)]
        batches = [_joined(inputs) if len(inputs) > 1 else inputs[0]]
    else:
        batches = [as_model_inputs(batch, device) for batch in (text.split(batch_size) if isinstance(text, torch.Tensor)
                                                               else text)]
    total = torch.zeros((), dtype=torch.float64)
    for batch in batches:
        _count_tokens(total, {key: value.cpu() for key, value in batch.items()})
    return batches, float(total)


def _candidates(granularity: str | None, alphas: tuple[float, ...], checked: bool) -> list[str]:
    """The fitted compensations the run may keep, by the names its record gives them: ``down`` checked chooses
    between the ``linear`` map and each ``alpha``'s refit (as :func:`~.compensation_step.refit_candidates`)."""
    if granularity == "down":
        refits = [f"down, alpha {alpha:g}" for alpha in alphas]
        return [LINEAR, *refits] if checked else refits
    return [granularity] if granularity else []


def _replacement(tensors: dict[str, torch.Tensor], candidate: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A candidate's refit rows and bias among a layer's stored tensors (``(None, None)``: the scale folds)."""
    if not candidate.startswith("down, alpha "):
        return None, None
    alpha = candidate.removeprefix("down, alpha ")
    return tensors[f"rows {alpha}"], tensors.get(f"bias {alpha}")


class _MeasuringPass:
    """The one layer-major pass of :func:`measure_layer_by_layer`: its streams, and per layer the fit and the runs of
    each variant of the pruned layer."""

    def __init__(self, passes: LayerMajor, model: nn.Module, plan: PruningPlan, layers: list[MoELayer],
                 granularity: str | None, alphas: tuple[float, ...], variants: list[str],
                 paper_kept: dict[str, list[int]] | None, store: LayerStore,
                 grids: Mapping[str, Callable[[torch.Tensor], torch.Tensor] | None] | None = None) -> None:
        self.passes, self.granularity, self.alphas, self.variants, self.store = (passes, granularity, alphas,
                                                                                   variants, store)
        self.grids = dict(grids or {})
        """Per MoE layer, what its corrected down projections read back as once written quantized again (absent or
        ``None``: as computed)."""
        self.spec = architecture_of(model)
        self.kept = {layer_plan.name: sorted(int(i) for i in layer_plan.kept) for layer_plan in plan.layers}
        self.paper_kept = paper_kept
        positions = moe_blocks_by_layer(passes.prefix, layers)
        self.moe = {index: [layers[p] for p in positions.get(index, [])] for index in range(len(passes.layers))}
        self.num_tokens = 0.0
        self.summaries: dict[str, dict[str, Any]] = {}
        self.errors: dict[str, list[float]] = {}

    def layer(self, index: int, checked: bool, heldout: list[str], original: list[str]) -> None:
        """Decoder layer ``index`` (on the device): the fit, the original's streams (of the sets in ``original``),
        each variant's streams."""
        corrections = self._fit(index) if self.granularity else {}
        for name in original:
            self.passes.run(f"original/{name}", index)
        for variant in self.variants:
            with ExitStack() as stack:
                for layer in self.moe[index]:
                    ids = (self.paper_kept if variant == PAPER else self.kept)[layer.name]  # type: ignore[index]
                    if variant not in (OFF, PAPER):
                        tensors = corrections[layer.name]
                        stack.enter_context(corrected_rows(layer, ids, tensors["scale"],
                                                           _replacement(tensors, variant),
                                                           self.grids.get(layer.name)))
                    stack.enter_context(pruned_layer_view(layer, ids, self.spec.count_attributes,
                                                          self.spec.experts_arguments[1]))
                if checked and variant != PAPER:
                    self.passes.run(f"{variant}/check", index)
                for name in heldout:
                    self.passes.run(f"{variant}/{name}", index)

    def _fit(self, index: int) -> dict[str, dict[str, torch.Tensor]]:
        """The fitting text through the unpruned layer with its MoE layers' fits attached; their corrections, stored."""
        fits = [(layer, _Fit(layer, self.kept[layer.name], self.spec.count_attributes, self.granularity,  # type: ignore[arg-type]
                             self.alphas, self.num_tokens)) for layer in self.moe[index]]

        def weigh(position: int, inputs: dict[str, torch.Tensor]) -> None:
            mask = inputs.get("attention_mask")
            for _, each in fits:
                each.layer_pass.token_weight = None if mask is None else mask.reshape(-1)

        with ExitStack() as stack:
            for _, each in fits:
                stack.enter_context(each.layer_pass.attached())
            self.passes.run("fit", index, weigh)
        corrections = {}
        for layer, each in fits:
            tensors, self.summaries[layer.name], errors = each.fitted()
            for key, value in errors.items():
                self.errors.setdefault(key, []).append(value)
            self.store.put(layer.name, tensors)
            corrections[layer.name] = tensors
        return corrections

    def compensations(self, layers: list[MoELayer]) -> dict[str, Compensation]:
        """Each fitted candidate as a :class:`Compensation` reading its tensors from the store, with its record."""
        names = [layer.name for layer in layers]
        kept = {name: self.kept[name] for name in names}
        maps = StoredScales(self.store)
        granularity = self.granularity
        record = record_of_summaries({name: self.summaries[name] for name in names}, self.num_tokens,
                                     LINEAR if granularity == "down" else granularity, DEFAULT_RIDGE)  # type: ignore[arg-type]
        if granularity != "down":
            return {granularity: Compensation(maps, kept, record)}  # type: ignore[arg-type, dict-item]
        fitted = {LINEAR: Compensation(maps, kept, record)}  # type: ignore[arg-type]
        for alpha in self.alphas:
            fitted[f"down, alpha {alpha:g}"] = Compensation(
                maps, kept, refit_record(record, alpha, SWEEPS, self.errors[f"down {alpha:g}"]),  # type: ignore[arg-type]
                weights=StoredRows(self.store, alpha))  # type: ignore[arg-type]
        return fitted


def measure_layer_by_layer(source: str | os.PathLike, model: nn.Module, plan: PruningPlan, scratch: str | os.PathLike,
                           *, granularity: str | None = None, text: Any = None, batch_size: int = 4,
                           check_blocks: torch.Tensor | None = None, unchecked: str = "applied as asked",
                           heldout: Mapping[str, torch.Tensor] | None = None, paper: PruningPlan | None = None,
                           original: Mapping[str, float] | None = None, device: torch.device | str = "cpu",
                           progress: bool | None = None) -> LayerByLayerMeasures:
    """Fit ``plan``'s compensation (``granularity``; ``None``: none) on ``text`` and measure, on the **unpruned**
    skeleton ``model`` of the checkpoint at ``source``, one decoder layer at a time: with ``check_blocks`` the fit is
    kept as ``auto`` keeps it (:func:`~.compensation_step.checked_choice`), without them applied (``unchecked``
    says why in the record); ``heldout`` sets get the original's and the pruned model's perplexity (and, with
    ``paper``, the paper plan's); ``original``: the unpruned model's perplexity on those sets, already measured (by
    an earlier plan's pass: it does not depend on the plan), is not run again. The correction's per-layer tensors go
    to ``scratch`` (kept until written)."""
    started = time.perf_counter()
    heldout = dict(heldout or {})
    original = dict(original or {})
    unmeasured = [name for name in heldout if name not in original]
    checked = check_blocks is not None
    layers = check_compensable(model, plan) if granularity else find_moe_layers(model)
    if granularity == "down":
        for layer in layers:
            check_down_refit(layer)
    alphas = refit_alphas(checked) if granularity == "down" else ()
    candidates = _candidates(granularity, alphas, checked)
    kept = {layer_plan.name: sorted(int(i) for i in layer_plan.kept) for layer_plan in plan.layers}
    paper_kept = None if paper is None else {p.name: sorted(int(i) for i in p.kept) for p in paper.layers}
    measured = candidates if checked or heldout else []
    variants = ([OFF] if checked or (heldout and (paper_kept == kept or not candidates)) else []) + measured
    if heldout and paper_kept is not None and paper_kept != kept:
        variants.append(PAPER)
    store = LayerStore(scratch)
    with LazyCheckpoint(source, model) as checkpoint, quiet_calls():
        passes = LayerMajor(checkpoint, device)
        names = {id(module): name for name, module in model.named_modules()}
        grids = ({layer.name: checkpoint.grid(f"{names[id(layer.experts)]}.down_proj") for layer in layers}
                 if granularity else {})  # a quantized checkpoint's corrected rows: as written, quantized again
        for layer in layers:
            if grids.get(layer.name) is not None:
                check_regridable(layer, checkpoint.settings)
        run = _MeasuringPass(passes, model, plan, layers, granularity, alphas, variants, paper_kept, store, grids)
        if granularity:
            fit_batches, run.num_tokens = _fitting_batches(model, granularity, text, batch_size, passes.device)
            passes.add("fit", fit_batches)
        for name in unmeasured:
            passes.add(f"original/{name}", heldout[name].split(batch_size))
        for variant in variants:
            if checked and variant != PAPER:
                passes.add(f"{variant}/check", check_blocks.split(batch_size))  # type: ignore[union-attr]
            for name, blocks in heldout.items():
                passes.add(f"{variant}/{name}", blocks.split(batch_size))
        for index, _ in passes.each_layer(progress, "ompmoe compensation and held-out (layer by layer)"):
            run.layer(index, checked, list(heldout), unmeasured)
        losses = {stream: passes.next_token_loss(stream) for stream in passes.inputs if stream != "fit"}
        passes.close()
    loss = {stream: total / count for stream, (total, count) in losses.items()}
    measures = LayerByLayerMeasures()
    chosen = OFF
    if granularity:
        fitted = run.compensations(layers)
        if checked:  # as the resident run takes it: the log of the perplexity it measures
            measures.compensation, measures.record = checked_choice(
                {name: fitted[name] for name in candidates},
                {name: math.log(math.exp(loss[f"{name}/check"])) for name in candidates},
                math.log(math.exp(loss[f"{OFF}/check"])), int(check_blocks.shape[0]))  # type: ignore[union-attr]
        elif granularity == "down":
            measures.compensation, measures.record = unchecked_refit(fitted[candidates[0]], unchecked)
        else:
            measures.compensation = fitted[granularity]
            measures.record = dict(fitted[granularity].record, applied=True, checked=unchecked)
        chosen = next((name for name in candidates if fitted[name] is measures.compensation), OFF)
    for name in heldout:
        before = original[name] if name in original else math.exp(loss[f"original/{name}"])
        measures.heldout[name] = (before, math.exp(loss[f"{chosen}/{name}"]))
        if paper_kept is not None:  # the paper's plan, or the run's own uncompensated where they are the same
            measures.paper[name] = math.exp(loss[f"{PAPER if PAPER in variants else OFF}/{name}"])
    measures.seconds = time.perf_counter() - started
    return measures


def choose_plan_layer_by_layer(source: str | os.PathLike, model: nn.Module, candidates: list[PruningPlan],
                               blocks: torch.Tensor, batch_size: int = 4, device: torch.device | str = "cpu",
                               progress: bool | None = None) -> PlanChoice:
    """:func:`~.plan_choice.choose_plan` on the unpruned skeleton ``model`` of the checkpoint at ``source``, one
    decoder layer at a time: each distinct set of kept experts runs ``blocks`` through its pruned layers (as
    :func:`~.trial.pruned_view` prunes them) in one layer-major pass over the files, and the model's own head gives
    its loss; the same choice and losses as the resident trial."""
    check_choice_arguments(candidates, blocks)
    streams = {key: f"trial/{position}" for position, key in enumerate(dict.fromkeys(map(kept_key, candidates)))}
    kept = {streams[kept_key(plan)]: {layer.name: sorted(int(i) for i in layer.kept) for layer in plan.layers}
            for plan in candidates}
    spec, layers = architecture_of(model), find_moe_layers(model)
    with LazyCheckpoint(source, model) as checkpoint, quiet_calls():
        passes = LayerMajor(checkpoint, device)
        positions = moe_blocks_by_layer(passes.prefix, layers)
        moe = {index: [layers[p] for p in positions.get(index, [])] for index in range(len(passes.layers))}
        for stream in kept:
            passes.add(stream, blocks.split(batch_size))
        with closing(passes.each_layer(progress, "ompmoe trial of auto's settings (layer by layer)")) as sweep:
            for index, _ in sweep:  # closed before the checkpoint, also on an error (its read-ahead waited for)
                for stream, experts in kept.items():
                    with ExitStack() as stack:
                        for layer in moe[index]:
                            stack.enter_context(pruned_layer_view(layer, experts[layer.name], spec.count_attributes,
                                                                  spec.experts_arguments[1]))
                        passes.run(stream, index)
        losses = {stream: passes.next_token_loss(stream) for stream in kept}
        passes.close()
    # perplexity()'s rounding: the log of the exponential of the mean loss
    measured = {key: math.log(math.exp(losses[stream][0] / losses[stream][1])) for key, stream in streams.items()}
    return chosen(candidates, measured)


__all__ = ["LayerByLayerMeasures", "LayerStore", "choose_plan_layer_by_layer", "measure_layer_by_layer"]
