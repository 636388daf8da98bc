"""One forward pass that streams per-layer statistics, running every expert FFN exactly once.

Each MoE layer's own ``experts`` module (whatever implementation the model uses) is called with its top-k slots
flattened to one (token, expert) pair per row and unit weights, which exposes ``F_e(x)`` for every routed pair; the
block still gets exactly ``sum_k g_k F_{e_k}(x)``. No atom outlives the batch.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DistributedSampler

from ..adapters import MoELayer, architecture_of, find_moe_layers
from ..identity_experts import as_unmeasured, first_identity, pair_call
from ..input_weighted import pair_outputs, per_unit_weight, routed_form
from ..perplexity import eval_mode
from ..progress import progress as progress_bar
from .errors import CalibrationInputError
from .extensions import (
    PairCallback,
    StatisticsExtension,
    extension,
    selected_statistics,
)
from .replay import replayable
from .statistics import LayerStats, MoEStats, model_fingerprint

if TYPE_CHECKING:
    from torchmetrics import Metric


@contextmanager
def expose_expert_outputs(layers: list[MoELayer], callback: PairCallback) -> Iterator[None]:
    """Within the context, every expert call reports unweighted per-pair outputs to ``callback`` (Llama 4's blocks in
    their routed form, :mod:`ompmoe.engine.input_weighted`; LongCat-Flash's identity pairs as "no expert" pairs,
    :mod:`ompmoe.engine.identity_experts`)."""
    patched: list[tuple[nn.Module, Any]] = []
    with routed_form(layers):
        try:
            for index, layer in enumerate(layers):
                patched.append((layer.experts, layer.experts.__dict__.get("forward")))
                if layer.input_weighted:
                    layer.experts.forward = _input_weighted_forward(layer.experts.forward, index, callback)
                else:
                    identity = first_identity(layer.num_experts, layer.identity_experts)
                    report = callback if identity is None else _without_identity_pairs(callback, identity)
                    layer.experts.forward = _flattened_forward(layer.experts.forward, index, report, identity)
            yield
        finally:
            for experts, previous in patched:
                del experts.forward  # the class forward (and its implementation dispatch) is back
                if previous is not None:  # or the routed form's
                    experts.forward = previous


def _without_identity_pairs(callback: PairCallback, num_experts: int) -> PairCallback:
    """``callback`` given a layer's identity pairs as "no expert" pairs that add nothing to any sum."""
    def report(index: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, outputs: torch.Tensor,
               atoms: torch.Tensor) -> None:
        callback(index, *as_unmeasured(top_k_index, top_k_weights, outputs, atoms, num_experts))

    return report


def _input_weighted_forward(native_forward: Callable, index: int, callback: PairCallback) -> Callable:
    """The routed form's experts call reporting each pair's ``F_e(g x)`` as its atom, and ``F_e(g x) / g`` as its
    output: the routing weight scales the input, so there is no unweighted output to call for."""
    experts = native_forward.__self__

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        atoms = pair_outputs(experts, hidden_states, top_k_index, top_k_weights)
        outputs = per_unit_weight(atoms, top_k_weights)
        flat = atoms.shape[0] * atoms.shape[1]
        callback(index, top_k_index, top_k_weights, outputs.view(flat, -1), atoms.detach().reshape(flat, -1))
        return atoms.sum(dim=1).to(hidden_states.dtype)

    return forward


def _flattened_forward(native_forward: Callable, index: int, callback: PairCallback, identity: int | None = None
                       ) -> Callable:
    experts = getattr(native_forward, "__self__", None)
    replay = replayable(experts) if experts is not None else None

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if replay is not None:  # the module's own grouped computation: no flattened copy, same output bits
            output, outputs, atoms = replay(experts, hidden_states, top_k_index, top_k_weights)
            callback(index, top_k_index, top_k_weights, outputs, atoms)
            return output
        num_tokens, top_k = top_k_index.shape
        graph_inputs = (hidden_states, top_k_weights, *(experts.parameters() if experts is not None else ()))
        if torch.is_grad_enabled() and any(t.requires_grad for t in graph_inputs):
            outputs = _per_expert_forward(native_forward, hidden_states, top_k_index, top_k_weights.dtype, identity)
        else:
            pairs_hidden = hidden_states.repeat_interleave(top_k, dim=0)
            unit_weights = torch.ones(num_tokens * top_k, 1, dtype=top_k_weights.dtype, device=top_k_weights.device)
            outputs = pair_call(native_forward, pairs_hidden, top_k_index.reshape(-1, 1), unit_weights, identity)
        weighted = outputs.view(num_tokens, top_k, -1) * top_k_weights.unsqueeze(-1).to(outputs.dtype)
        callback(index, top_k_index, top_k_weights, outputs, weighted.detach().view(num_tokens * top_k, -1))
        return weighted.sum(dim=1).to(hidden_states.dtype)

    return forward


def _per_expert_forward(native_forward: Callable, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        weight_dtype: torch.dtype, identity: int | None = None) -> torch.Tensor:
    """The flattened call's per-pair outputs ``(tokens * top_k, d)``, one native call per expert's pairs.

    Used under autograd: one call over all pairs makes each per-expert gather's backward add a zero
    tensor the size of all pairs (2x a plain backward on 64 experts). Per expert (stable sort) the
    bits are the same, forward and backward.
    """
    num_tokens, top_k = top_k_index.shape
    sorted_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.unique_consecutive(sorted_ids, return_counts=True)[1].tolist()
    pairs = _GatherRows.apply(hidden_states, order.div(top_k, rounding_mode="floor"), inverse.view(num_tokens, top_k))
    chunks = [pair_call(native_forward, h, ids.view(-1, 1), torch.ones(len(ids), 1, dtype=weight_dtype,
                                                                        device=ids.device), identity)
              for h, ids in zip(pairs.split(counts), sorted_ids.split(counts))]
    return _GatherRows.apply(torch.cat(chunks), inverse, order)


class _GatherRows(torch.autograd.Function):
    """``source[rows]`` whose backward gathers too (``grad[back]`` summed over ``back``'s last dim), not scatter-adds.

    ``back`` lists, per source row, the output rows read from it; a token's pairs are summed in slot
    order, as the backward of ``repeat_interleave`` sums them.
    """

    @staticmethod
    def forward(ctx: Any, source: torch.Tensor, rows: torch.Tensor, back: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(back)
        return source.index_select(0, rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (back,) = ctx.saved_tensors
        gathered = grad.index_select(0, back.reshape(-1))
        if back.dim() == 1:
            return gathered, None, None
        return gathered.view(*back.shape, -1).sum(dim=1), None, None


MODEL_INPUT_KEYS = ("input_ids", "attention_mask", "position_ids", "inputs_embeds")
"""What a calibration forward takes from a batch; the rest (labels, texts, ...) is the user's."""


def _model_inputs(batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The model's keys of a dict batch, one unbatched sequence given a batch dimension."""
    inputs = {key: batch[key] for key in MODEL_INPUT_KEYS if batch.get(key) is not None}
    if inputs.get("input_ids") is not None and inputs["input_ids"].dim() == 1:  # one unbatched sequence
        inputs = {key: value.unsqueeze(0) for key, value in inputs.items()}
    return inputs


def as_model_inputs(batch: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """Accept an input-id tensor, a dict for ``model(**batch)`` or an ``(input_ids[, attention_mask])`` tuple/list (a
    ``TensorDataset`` loader's, as :func:`batch_inputs` reads it); move tensors to ``device``."""
    if isinstance(batch, (list, tuple)) and (inputs := _contract_inputs(batch)) is not None:
        batch = inputs
    if isinstance(batch, torch.Tensor):
        batch = {"input_ids": batch if batch.dim() == 2 else batch.unsqueeze(0)}
    if not isinstance(batch, Mapping) or "input_ids" not in batch and "inputs_embeds" not in batch:
        raise TypeError("Each calibration batch must be an input-id tensor (batch, seq), a dict with 'input_ids' "
                        "for model(**batch) or a tuple/list (input_ids[, attention_mask]) of tensors; got "
                        f"{type(batch).__name__}.")
    return {key: value.to(device) for key, value in _model_inputs(batch).items()}


BATCH_CONTRACT = ("a tensor of input_ids, a dict with input_ids, or a tuple/list (input_ids[, attention_mask]) of "
                  "tensors")
"""The batches a loop that runs its own forwards (``ExpertPruning`` in a Trainer) may hand the run."""


def _contract_inputs(batch: Any) -> dict[str, torch.Tensor] | None:
    """``batch`` as model inputs when it keeps :data:`BATCH_CONTRACT`, else ``None``."""
    if isinstance(batch, torch.Tensor):
        return _model_inputs({"input_ids": batch})
    if isinstance(batch, Mapping):
        if not any(isinstance(batch.get(key), torch.Tensor) for key in ("input_ids", "inputs_embeds")):
            return None
        if not all(value is None or isinstance(value, torch.Tensor) for key, value in batch.items()
                   if key in MODEL_INPUT_KEYS):
            return None
        return _model_inputs(batch)
    if isinstance(batch, (tuple, list)) and 1 <= len(batch) <= 2 and isinstance(batch[0], torch.Tensor):
        mask = batch[1] if len(batch) == 2 else None
        if mask is not None and not _is_mask_of(mask, batch[0]):
            return None  # a second element that is no mask (labels, ...) is not guessed at
        return _model_inputs({"input_ids": batch[0], "attention_mask": mask})
    return None


def _is_mask_of(mask: Any, ids: torch.Tensor) -> bool:
    """Whether ``mask`` can be ``ids``' attention mask: shaped like it and only 0 and 1. Labels (the ids again, or
    with -100 at padding) fail this, so an ``(input_ids, labels)`` batch is refused as outside the contract instead
    of being read as a mask."""
    if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
        return False
    return mask.dtype == torch.bool or bool(((mask == 0) | (mask == 1)).all())


def _describe(batch: Any, depth: int = 0) -> str:
    """What a batch is, for a message: ``str``, ``dict with keys ['text']``, ``list of (tensor (2, 32), ...)``."""
    if isinstance(batch, torch.Tensor):
        return f"tensor {tuple(batch.shape)}"
    if isinstance(batch, Mapping):
        keys = list(batch)
        shown = [f"{key}: {_describe(batch[key], depth + 1)}" for key in keys[:4]] if depth == 0 else []
        return f"{type(batch).__name__} with keys {keys}" + (f" ({', '.join(shown)})" if shown else "")
    if isinstance(batch, (tuple, list)) and depth == 0:
        items = [_describe(item, depth + 1) for item in batch[:3]] + (["..."] if len(batch) > 3 else [])
        return f"{type(batch).__name__} of {len(batch)} ({', '.join(items)})"
    return type(batch).__name__


def batch_inputs(batch: Any, batch_to_inputs: Callable[[Any], Any] | None = None,
                 owner: str = "ExpertPruning") -> dict[str, torch.Tensor]:
    """The model inputs of a batch that the user's loop runs its own forward on: the one place such a batch
    becomes ``input_ids`` (and ``attention_mask``, ...), so a batch of another shape is refused in one line before
    its forward instead of failing deep in the statistics. ``batch_to_inputs`` maps a batch of the user's own
    format first; its result must keep the contract too."""
    mapped = batch if batch_to_inputs is None else batch_to_inputs(batch)
    inputs = _contract_inputs(mapped)
    if inputs is not None:
        return inputs
    if batch_to_inputs is not None:
        raise CalibrationInputError(f"{owner}: batch_to_inputs must return {BATCH_CONTRACT}; it returned "
                                    f"{_describe(mapped)} for a batch of {_describe(batch)}.")
    raise CalibrationInputError(
        f"{owner}: a batch must be {BATCH_CONTRACT}; got {_describe(batch)}. Pass "
        f"{owner}(batch_to_inputs=fn), with fn(batch) returning {{'input_ids': ..., 'attention_mask': ...}}, "
        "to map yours.")


def check_calibration_inputs(model: nn.Module, inputs: Mapping[str, torch.Tensor]) -> None:
    """Refuse, before the forward, a batch whose statistics would be wrong: empty, bad token ids or a non-0/1 mask."""
    ids = inputs.get("input_ids")
    source = ids if ids is not None else inputs.get("inputs_embeds")
    key = "input_ids" if ids is not None else "inputs_embeds"
    if source is None or source.dim() < 2 or source.shape[0] == 0 or source.shape[1] == 0:
        shape = None if source is None else tuple(source.shape)
        raise CalibrationInputError(f"Calibration batch {key} has shape {shape}; it needs at least one row and one "
                                    "token, (batch >= 1, seq >= 1). Drop empty batches.")
    if ids is not None:
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise CalibrationInputError(f"input_ids must be integer token ids; got dtype {ids.dtype}.")
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        vocab = getattr(embeddings, "num_embeddings", None) or getattr(model.config, "vocab_size", None)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or (vocab is not None and high >= vocab):
            bad = low if low < 0 else high
            raise CalibrationInputError(
                f"input_ids hold token id {bad} (min {low}, max {high}) but the model's vocabulary has "
                f"{vocab} tokens (valid ids 0..{vocab - 1 if vocab else '?'}); tokenize with this model's tokenizer.")
    mask = inputs.get("attention_mask")
    if mask is not None:
        if tuple(mask.shape) != tuple(source.shape[:2]):
            raise CalibrationInputError(f"attention_mask has shape {tuple(mask.shape)} but {key} has "
                                        f"{tuple(source.shape[:2])}; pass masks shaped like input_ids.")
        if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
            odd = mask[(mask != 0) & (mask != 1)].reshape(-1)[0].item()
            raise CalibrationInputError(
                f"attention_mask must hold only 0 and 1 (padding and real tokens); found {odd}. "
                "Pass the tokenizer's 0/1 mask (a weighted mask would scale every statistic).")


class WeightsChangedError(ValueError):
    """The model's weights changed while statistics were collected (an optimizer stepped): the sums mix several
    models, describe none of them, and would prune a model they were not measured on."""


def weights_changed_message(owner: str, name: str) -> str:
    """The one line that refuses a calibration whose weights changed, naming the first changed parameter."""
    return (f"{owner}: the model's weights changed during calibration ({name} changed after the first calibration "
            "batch, as an optimizer step does), so the statistics mix several models; no plan was made and nothing "
            "was written. Calibrate in a loop that does not step an optimizer (in a Trainer: a LightningModule "
            "without optimizers, such as ompmoe.CalibrationModule, or frozen weights), then prune the trained model "
            "in a run of its own.")


PROBED_VALUES = 8
"""Values of each parameter compared at the end (a strided view each, copied once per device)."""


def _sampled_values(parameter: torch.Tensor) -> torch.Tensor | None:
    """A few values spread over this process's part of ``parameter``, as a view, or ``None`` where they cannot be
    read cheaply (meta or freed storage, a tensor subclass without plain indexing)."""
    from torch.distributed.tensor import DTensor

    try:
        local = (parameter.to_local() if isinstance(parameter, DTensor) else parameter).detach()
        if local.is_meta or local.numel() == 0 or local.untyped_storage().nbytes() == 0:
            return None
        if local.is_contiguous():  # spread over the tensor: a frozen first row (a padding embedding) hides nothing
            flat = local.view(-1)
            return flat[::max(1, flat.numel() // PROBED_VALUES)][:PROBED_VALUES]
        while local.dim() > 1:
            local = local[0]
        return local.reshape(-1)[:PROBED_VALUES]
    except Exception:  # a quantized or other subclass: its version counter still watches it
        return None


class WeightWatch:
    """The model's parameters as the first calibration batch found them, to tell whether they changed since.

    Two cheap signs: the in-place version counters (an optimizer step bumps them) and a few values of each (fused
    optimizers bump no counter). Under FSDP2 only the shards' values are read: the gathered copies it swaps
    in and out are refilled and freed by design.
    """

    def __init__(self, model: nn.Module) -> None:
        from torch.distributed.tensor import DTensor

        named = list(model.named_parameters())
        sharded = any(isinstance(parameter, DTensor) for _, parameter in named)
        self.parameters = [(name, parameter, parameter._version) for name, parameter in named]
        self.probed = [index for index, (_, parameter, _) in enumerate(self.parameters)
                       if not sharded or isinstance(parameter, DTensor)]
        self.values = self._values()

    def _values(self) -> dict[torch.device, tuple[list[tuple[int, int]], torch.Tensor]]:
        """The probed parameters' sampled values, one copy per device: ``{device: ([(parameter index, count)],
        values)}``."""
        groups: dict[torch.device, tuple[list[tuple[int, int]], list[torch.Tensor]]] = {}
        for index in self.probed:
            values = _sampled_values(self.parameters[index][1])
            if values is not None:
                counts, views = groups.setdefault(values.device, ([], []))
                counts.append((index, values.numel()))
                views.append(values)
        return {device: (counts, torch.cat(views)) for device, (counts, views) in groups.items()}

    def changed(self, values: bool = True) -> str | None:
        """The name of a parameter that changed since (its counter; with ``values``, also its sampled values)."""
        for name, parameter, version in self.parameters:
            if parameter._version != version:
                return name
        if not values:
            return None
        for device, (counts, now) in self._values().items():
            before_counts, before = self.values.get(device, ([], now[:0]))
            if counts != before_counts:  # a parameter's values became unreadable (freed): its counter watched it
                continue
            differs = (now != before) & ~(now.isnan() & before.isnan())  # NaN where it was NaN is no change
            if bool(differs.any()):
                position, end = int(differs.nonzero()[0, 0]), 0
                for index, count in counts:
                    end += count
                    if position < end:
                        return self.parameters[index][0]
        return None


CalibrationPause = Callable[[nn.Module], AbstractContextManager[bool]]
CALIBRATION_PAUSES: list[tuple[CalibrationPause, str]] = []
"""Inference-time hooks switched off while statistics are collected (statistics cover the model's native top-k):
``(pause, warning)`` with ``pause(model)`` a context manager that yields whether any hook was on, and the warning
given then. apply/adaptive.py registers OMP-MoE+'s on import (before it, no such hook can be on), so collect/
never imports apply/."""


def pause_during_calibration(pause: CalibrationPause, warning: str) -> None:
    """Register inference-time hooks that every :class:`StatisticsCollector` switches off while it collects."""
    CALIBRATION_PAUSES.append((pause, warning))


class StatisticsCollector:
    """Instruments a model so every forward pass adds to its statistics (driven by ``collect_stats`` or a callback)."""

    def __init__(self, model: nn.Module, model_id: str | None = None, sources: list[str] | None = None,
                 statistics: Iterable[str] = (), **extension_flags: bool) -> None:
        architecture_of(model)
        self._was_training = False
        """The model was in train mode when :meth:`begin_batch` put it in eval mode: :meth:`end_batch` restores it."""
        self.model = model
        self.layers = find_moe_layers(model)
        from .sums import MoEStatsMetric  # torchmetrics on the first collection only (sums.py)

        self.metric = MoEStatsMetric(self.layers)
        names = selected_statistics(statistics, **extension_flags)
        self.extensions: dict[str, StatisticsExtension] = {
            name: extension(name)(model, self.layers, lambda: self.metric.token_weight) for name in names}
        """The optional statistics collected next to the core sums, by name."""
        self.model_id = model_id or getattr(model.config, "_name_or_path", None) or None
        self.sources = list(sources or [])
        self._context: ExitStack | None = None
        self._warned = False
        self.batch_size = 0
        """The most samples a calibration batch had (the batch size of later passes over held-out text)."""
        self.token_batches: list[dict[str, torch.Tensor]] = []
        """This process's calibration token ids (and masks) on the CPU, real samples only: what compensation fits
        on when the data holds no ``blocks`` (a few bytes per token, next to the statistics' megabytes)."""
        self.weights: WeightWatch | None = None
        """The parameters as the first batch found them (:meth:`check_weights`); ``None`` before it."""

    def metrics(self) -> dict[str, Metric]:
        """Every sum-state metric by its checkpoint prefix: ``""`` for the core sums, ``"loss."``, ``"reroute."``..."""
        return {"": self.metric, **{f"{ext.prefix}.": ext.metric for ext in self.extensions.values()}}

    def to(self, device: torch.device | str) -> StatisticsCollector:
        """Move every sum (core and extensions) to ``device``."""
        for metric in self.metrics().values():
            metric.to(device)
        return self

    def __enter__(self) -> StatisticsCollector:
        self._instrument(list(self.extensions.values()))
        return self

    @contextmanager
    def forward_only(self) -> Iterator[StatisticsCollector]:
        """The collector's context without the extensions that run a backward: layer by layer runs those in a
        pass of their own after the forward one (:meth:`StatisticsExtension.collect_layer_by_layer`)."""
        self._instrument([ext for ext in self.extensions.values() if not ext.needs_gradients])
        try:
            yield self
        finally:
            self.__exit__(None, None, None)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Inference-time hooks (OMP-MoE+) off meanwhile, as in the collector's context, with nothing instrumented."""
        with ExitStack() as stack:
            self._pause(stack)
            yield

    def _pause(self, stack: ExitStack) -> None:
        for pause, warning in CALIBRATION_PAUSES:
            if stack.enter_context(pause(self.model)) and not self._warned:
                warnings.warn(warning, stacklevel=4)
                self._warned = True

    def _instrument(self, extensions: list[StatisticsExtension]) -> None:
        with ExitStack() as stack:  # left in reverse: extensions detached, expert calls restored, adaptive resumed
            self._pause(stack)
            update = self.metric.update
            # Extensions that run a backward wrap outermost: they silence the chain during checkpoint recomputes.
            for ext in sorted(extensions, key=lambda ext: ext.needs_gradients):
                update = ext.wrap(update)
            stack.enter_context(expose_expert_outputs(self.layers, update))
            for ext in extensions:
                stack.callback(ext.detach)
                ext.attach()
            self._context = stack.pop_all()

    def __exit__(self, *exc: Any) -> None:
        context, self._context = self._context, None
        if context is not None:
            context.__exit__(*exc)

    def forward(self, inputs: dict[str, torch.Tensor]) -> Any:
        """Run the model once on ``inputs`` (inside the context) and account its tokens; a bad batch counts nothing."""
        check_calibration_inputs(self.model, inputs)
        mask = inputs.get("attention_mask")
        ids = inputs.get("input_ids", inputs.get("inputs_embeds"))
        self.metric.set_token_weight(mask, num_tokens=int(ids.shape[0] * ids.shape[1]))
        try:
            return self.model(**inputs, use_cache=False)
        finally:
            self.metric.token_weight = None

    @property
    def needs_gradients(self) -> bool:
        """Whether an extension runs a backward (the forward must then run with gradients)."""
        return any(ext.needs_gradients for ext in self.extensions.values())

    def begin_batch(self, inputs: Mapping[str, torch.Tensor], first_sample: int = 0,
                    real_samples: int | None = None) -> None:
        """Instrument the next forward on ``inputs`` (a loop that runs it itself, like Lightning's): padding and
        the samples past ``real_samples`` count nothing; ``first_sample`` is the batch's position on this rank.
        The model runs in eval mode until :meth:`end_batch` (a Lightning loop puts it in train mode, where routers of
        Mixtral and PhiMoE jitter and dropout drops), as :meth:`calibrate` runs it."""
        check_calibration_inputs(self.model, inputs)  # before the forward: no wrong sums
        if self.weights is None:
            self.weights = WeightWatch(self.model)
        ids = inputs.get("input_ids", inputs.get("inputs_embeds"))
        assert ids is not None
        self.batch_size = max(self.batch_size, int(ids.shape[0]))
        weight = batch_token_weight(inputs, first_sample, real_samples)
        self.metric.set_token_weight(weight, num_tokens=int(ids.shape[0]) * int(ids.shape[1]))
        rows = ids.shape[0] if real_samples is None else max(0, min(ids.shape[0], real_samples - first_sample))
        if rows and inputs.get("input_ids") is not None:  # the real samples' token ids (none for inputs_embeds)
            self.token_batches.append({key: inputs[key][:rows].detach().cpu()
                                       for key in ("input_ids", "attention_mask") if inputs.get(key) is not None})
        self._was_training = self._was_training or self.model.training
        self.model.eval()
        self.__enter__()

    def changed_weight(self, values: bool = True) -> str | None:
        """A parameter that changed since the first batch (an optimizer step), by name; ``None`` if none did. Without
        ``values`` only the version counters are read (no device sync: cheap enough for every batch)."""
        return self.weights.changed(values) if self.weights is not None else None

    def check_weights(self, owner: str, values: bool = True) -> None:
        """Refuse statistics gathered across changing weights (:func:`weights_changed_message`)."""
        name = self.changed_weight(values)
        if name is not None:
            raise WeightsChangedError(weights_changed_message(owner, name))

    def end_batch(self) -> None:
        """Stop instrumenting (also after a failed forward); the model in its own mode again."""
        if self._context is not None:
            self.__exit__(None, None, None)
            self.metric.token_weight = None
        if self._was_training:
            self.model.train()
            self._was_training = False

    def calibrate(self, inputs: dict[str, torch.Tensor], first_sample: int = 0, real_samples: int | None = None,
                  autocast: Any = None) -> None:
        """One instrumented forward in eval mode (routers of Mixtral and others jitter in train mode), and the
        extensions' backward with the parameters frozen meanwhile (no weight gradient)."""
        model, gradients = self.model, self.needs_gradients
        frozen = [p for p in model.parameters() if p.requires_grad] if gradients else []
        with eval_mode(model):  # its own mode again also when begin_batch refuses the batch
            self.begin_batch(inputs, first_sample, real_samples)
            try:
                with torch.set_grad_enabled(gradients), autocast if autocast is not None else nullcontext():
                    for parameter in frozen:
                        parameter.requires_grad_(False)
                    model(**inputs, use_cache=False)
            finally:
                self.end_batch()
                for parameter in frozen:
                    parameter.requires_grad_(True)

    def collect(self, batches: Iterable[Any], show_progress: bool | None = None) -> int:
        """:meth:`calibrate` on each batch in this process, on the model's device; returns the number of batches."""
        for ext in self.extensions.values():
            ext.standalone()  # the forward's output is dropped: no step reuses its graph
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        self.to(device)
        count = 0
        for batch in progress_bar(batches, "ompmoe statistics", show_progress, unit="batch"):
            self.calibrate(as_model_inputs(batch, device))
            count += 1
        return count

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every sum so far, summed over ranks when distributed, by ``prefix + state name`` (for checkpoints)."""
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        states: dict[str, torch.Tensor] = {}
        for prefix, metric in self.metrics().items():
            with metric.sync_context(should_sync=distributed):
                states.update({prefix + name: getattr(metric, name).detach().cpu().clone()
                               for name in metric._defaults})
        return states

    def load_state_dict(self, states: Mapping[str, torch.Tensor]) -> None:
        """Resume from :meth:`state_dict`: the global sums go to rank 0 only (zeros elsewhere), so the final
        cross-rank sum stays exact; sums of statistics not collected here are ignored."""
        metrics = self.metrics()
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank = torch.distributed.get_rank() if distributed else 0
        for name, value in states.items():
            prefix = name.split(".", 1)[0] + "." if "." in name else ""
            if prefix in metrics:
                target, name = metrics[prefix], name.removeprefix(prefix)
                current = getattr(target, name)
                setattr(target, name, value.to(current) if rank == 0 else torch.zeros_like(current))

    def result(self) -> MoEStats:
        """The statistics so far (after any distributed sync the caller performed)."""
        layers, num_tokens = self.metric.compute()
        for ext in self.extensions.values():
            layers = ext.fill(layers)
        # Planning runs on the CPU whatever device collected (the sums are small; a GPU pass left them on cuda).
        layers = [LayerStats.from_tensors(layer.name, layer.routing, {key: value.cpu() for key, value in
                                                                      layer.tensors().items()}) for layer in layers]
        if num_tokens == 0:
            raise ValueError("No calibration tokens were seen; pass at least one non-empty batch.")
        return MoEStats(layers=layers, num_tokens=num_tokens, fingerprint=model_fingerprint(self.model),
                        model_id=self.model_id, model_type=self.model.config.model_type, sources=self.sources)


def real_sample_count(sampler: Any) -> int | None:
    """How many samples of this rank are real when a ``DistributedSampler`` pads an uneven data set, else ``None``.

    The sampler repeats samples from the start of the data set so every rank gets as many; on each
    rank the repeats come last, after ``len(range(rank, len(dataset), num_replicas))`` real ones.
    """
    if isinstance(sampler, DistributedSampler) and not sampler.drop_last:
        return len(range(sampler.rank, len(sampler.dataset), sampler.num_replicas))  # type: ignore[arg-type]
    return None


def loader_epoch(dataloader: Any) -> tuple[Any, Any]:
    """Which pass over ``dataloader`` its batches now come from (Fabric's count of its iterations, its
    ``DistributedSampler``'s ``set_epoch``): a new one counts from its first sample again, so every epoch counts
    alike on any number of processes (the last one's samples were taken for repeats on 2)."""
    return getattr(dataloader, "_num_iter_calls", None), getattr(getattr(dataloader, "sampler", None), "epoch", None)


class LoaderPosition:
    """Where each batch of a loader lies in the pass over it that gives it (its first sample's position on this rank)
    and how many of the pass's samples are real (the rest: a ``DistributedSampler``'s repeats). A new pass starts with
    a new epoch (:func:`loader_epoch`) or once a pass's samples are used up (:func:`samples_per_pass`)."""

    def __init__(self) -> None:
        self._pass: Any = None
        self.position = 0
        self.real_samples: int | None = None

    def batch(self, dataloader: Any, num_samples: int) -> tuple[int, int | None]:
        """``(first sample's position, real samples of the pass)`` of a batch of ``num_samples`` from
        ``dataloader`` (``None``: the last loader's pass goes on); then past it."""
        if dataloader is not None and (self._pass != (dataloader, loader_epoch(dataloader))
                                       or self.position >= (samples_per_pass(dataloader) or math.inf)):
            self._pass, self.position = (dataloader, loader_epoch(dataloader)), 0
            self.real_samples = real_sample_count(getattr(dataloader, "sampler", None))
        first, self.position = self.position, self.position + num_samples
        return first, self.real_samples


def samples_per_pass(dataloader: Any) -> int | None:
    """How many samples one pass over ``dataloader`` gives this rank when its ``DistributedSampler`` pads them
    (``None``: otherwise): once that many are counted, the next batch starts a new pass, whether or not the loop
    called ``set_epoch`` (PyTorch's docs ask for it; a loop without it still gets a new pass of the same samples)."""
    sampler = getattr(dataloader, "sampler", None)
    if real_sample_count(sampler) is None:
        return None
    return int(sampler.num_samples)


def batch_token_weight(inputs: Mapping[str, torch.Tensor], first_sample: int, real_samples: int | None
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


def collect_stats(model: nn.Module, batches: Iterable[Any], *, model_id: str | None = None, source: str | None = None,
                  progress: bool | None = None, statistics: Iterable[str] = (), **extension_flags: bool) -> MoEStats:
    """Stream OMP-MoE statistics over ``batches`` (input-id tensors or dicts for ``model(**batch)``), one forward each.

    Masked padding is not counted; the model runs in eval mode (some routers jitter in train mode), then is restored.
    ``progress``: a stderr bar (``None``: when stderr is a terminal). ``model_id``/``source`` are recorded.
    ``statistics`` names optional statistics (:data:`ompmoe.engine.collect.extensions.STATISTICS`); a flag named after one
    asks for it too (``loss_aware=True``: one backward of the next-token loss per batch, parameters frozen).
    """
    collector = StatisticsCollector(model, model_id=model_id, sources=[source] if source else None,
                                    statistics=statistics, **extension_flags)
    collector.collect(batches, progress)
    collector.check_weights("collect_stats")  # a generator of batches that trains in between
    return collector.result()
