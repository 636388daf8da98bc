"""Compensation after pruning: a least-squares correction of each MoE layer's kept routed experts, folded into their
down projections (no inference cost; the pruned model stays a stock checkpoint).

Fitted on the **unpruned** model, before :func:`~ompmoe.engine.apply.pruning.prune`, against the **real pruned block**
(rerouting and renormalization included), from float64 sums that merge by addition across batches and ranks; applied
after pruning. The three systems, memory, cost and measurements: docs/quality/compensation.md.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..adapters import MoELayer, architecture_of, find_moe_layers
from ..io import readable_size
from ..model_classes import text_config
from ..collect.collector import as_model_inputs, check_calibration_inputs
from ..identity_experts import first_identity, original_ids, pair_call, split_identity_pairs
from ..input_weighted import pair_outputs, routed_form, routed_pairs
from ..perplexity import eval_mode, perplexity
from ..planning.plan import PruningPlan
from ..record import CONFIG_KEY, last_pruning_kept, pruning_info
from ..stored_formats import quantized_in_model_layout, stored_quantization
from .adaptive import adaptive_paused
from .pruning import require_plan_model, slice_router, validate_plan
from .trial import pruned_view

GRANULARITIES = ("layer", "expert", "linear", "down")
"""``layer``: one factor per MoE layer; ``expert``: one per kept expert (``ridge`` toward the layer's); ``linear``: a
``d x d`` map of the layer's routed output (``ridge`` toward the layer's factor times the identity); ``down``: every
kept expert's down projection refit (:mod:`.down_refit`, ridge toward the ``linear`` map's weights)."""
SUM_GRANULARITIES = ("layer", "expert", "linear")
"""The granularities fitted from summed statistics (``down`` fits in its own pass)."""

DEFAULT_GRANULARITY = "linear"
DEFAULT_RIDGE: float | None = None
"""``None``: ``d / T`` for ``linear``, :data:`EXPERT_RIDGE` for ``expert`` (:func:`effective_ridge`)."""
EXPERT_RIDGE = 0.1
MAX_SUM_BYTES = 8 * 2**30
"""``linear``'s two ``d x d`` float64 sums per MoE layer, summed over the layers on one device, may take this much."""
TOKENS_PER_DIMENSION = 16
"""``max_tokens="auto"`` fits on ``16 * d`` tokens (``d`` the hidden size): 4,096 on the shipped models, where that
measured within 0.7 % of every calibration token and costs 0.42x a forward over 64 x 256 calibration tokens
(docs/quality/compensation.md)."""

SUM_KEYS = ("gram", "cross", "target_energy")
OUTPUT_KEYS = ("output_gram", "output_cross")


class CompensationError(ValueError):
    """Compensation cannot be fitted or applied as asked (plan, model or factors do not match)."""


@dataclass
class LayerSums:
    """One MoE layer's float64 sums over the fitting tokens (the systems: docs/quality/compensation.md)."""

    name: str
    kept: list[int]
    """Original ids of the kept experts, ascending (factor ``i`` belongs to ``kept[i]``)."""
    gram: torch.Tensor
    """``(K, K)``: ``sum_x <c_e(x), c_f(x)>`` of the pruned block's contributions."""
    cross: torch.Tensor
    """``(K,)``: ``sum_x <c_e(x), Y(x)>`` with the unpruned routed output ``Y``."""
    target_energy: torch.Tensor
    """``()``: ``sum_x ||Y(x)||^2``."""
    output_gram: torch.Tensor | None = None
    """``(d, d)``: ``sum_x Y'(x) Y'(x)^T`` (only for ``granularity="linear"``)."""
    output_cross: torch.Tensor | None = None
    """``(d, d)``: ``sum_x Y(x) Y'(x)^T`` (only for ``granularity="linear"``)."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """The sums by name (``output_*`` only when collected)."""
        keys = SUM_KEYS + (OUTPUT_KEYS if self.output_gram is not None else ())
        return {key: getattr(self, key) for key in keys}

    def residual(self, correction: torch.Tensor) -> float:
        """``sum_x ||Y - Y'_corrected||^2 / sum_x ||Y||^2`` for per-expert factors ``(K,)`` (ones: no compensation)
        or a map ``(d, d)``."""
        c = correction.to(self.cross)
        if c.dim() == 2:
            if self.output_gram is None or self.output_cross is None:
                raise CompensationError("A linear map's residual needs the output sums (granularity='linear').")
            m = c.to(self.output_gram)  # where the sums are: no d x d copy
            error = (self.target_energy.to(m) - 2 * (m * self.output_cross).sum()
                     + ((m @ self.output_gram) * m).sum())
        else:
            error = self.target_energy - 2 * c @ self.cross + c @ self.gram @ c
        return float(error / self.target_energy.clamp(min=torch.finfo(torch.float64).tiny).to(error))


@dataclass
class CompensationSums:
    """The sums of every MoE layer and the token count: add two (``a + b``, or :meth:`all_reduce` over ranks) to
    merge them; :meth:`state_dict` / :meth:`load_state_dict` give and take them as a flat dict of tensors."""

    layers: list[LayerSums]
    num_tokens: torch.Tensor
    fingerprint: str
    sequential: bool = False

    def __add__(self, other: CompensationSums) -> CompensationSums:
        if not isinstance(other, CompensationSums):
            return NotImplemented
        if (self.fingerprint != other.fingerprint or self.sequential != other.sequential
                or [(a.name, a.kept, list(a.tensors())) for a in self.layers]
                != [(b.name, b.kept, list(b.tensors())) for b in other.layers]):
            raise CompensationError("Compensation sums of different models, plans or granularities cannot be added.")
        if self.sequential:
            raise CompensationError("Sequential compensation sums depend on the corrections fitted in their own pass; "
                                    "they do not add across passes (fit with sequential=False to merge sums).")
        layers = [LayerSums(a.name, a.kept, **{key: value + b.tensors()[key] for key, value in a.tensors().items()})
                  for a, b in zip(self.layers, other.layers)]
        return CompensationSums(layers, self.num_tokens + other.num_tokens, self.fingerprint, self.sequential)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{"<layer>.gram": ..., "<layer>.cross": ..., "<layer>.target_energy": ..., "num_tokens": ...}`` (and
        ``"<layer>.output_gram"``, ``"<layer>.output_cross"`` for ``linear``)."""
        return {"num_tokens": self.num_tokens,
                **{f"{layer.name}.{key}": value for layer in self.layers for key, value in layer.tensors().items()}}

    def load_state_dict(self, states: Mapping[str, torch.Tensor]) -> None:
        """Replace the sums by ``states`` (e.g. summed over ranks), checking the shapes."""
        for layer in self.layers:
            for key, current in layer.tensors().items():
                value = states[f"{layer.name}.{key}"]
                if tuple(value.shape) != tuple(current.shape):
                    raise CompensationError(f"Compensation sum {layer.name}.{key} has shape {tuple(value.shape)}; "
                                            f"expected {tuple(current.shape)}.")
                setattr(layer, key, value.to(current))
        self.num_tokens = states["num_tokens"].to(self.num_tokens)

    def all_reduce(self) -> CompensationSums:
        """Sum the sums over the ranks of the default process group (every rank must call it); in place."""
        import torch.distributed as dist

        if self.sequential:
            raise CompensationError("Sequential compensation reduces its sums inside the pass (reduce=...).")
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            staged = dist.get_backend() == "nccl" and torch.cuda.is_available()  # NCCL reduces CUDA tensors only
            for tensor in self.state_dict().values():
                if staged and tensor.device.type == "cpu":  # sums of a model on the CPU
                    on_device = tensor.cuda()
                    dist.all_reduce(on_device)
                    tensor.copy_(on_device.cpu())
                else:
                    dist.all_reduce(tensor)
        return self


@dataclass
class Compensation:
    """The fitted correction of every MoE layer and what was fitted; :meth:`apply` folds it into a pruned model."""

    scales: dict[str, torch.Tensor]
    """Per layer: ``(K,)`` factors of the kept experts (ordered as their ascending ids), or a ``(d, d)`` map."""
    kept: dict[str, list[int]]
    record: dict[str, Any] = field(default_factory=dict)
    """JSON-able summary for the plan's ``extra`` and the model card (granularity, ridge, tokens, factors, errors)."""
    weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]] | None = None
    """``down`` (:mod:`.down_refit`): per layer the kept experts' refit down projections ``(K, ...)`` in the
    experts' layout and dtype, and biases; they replace those rows (``scales`` then only records the map they were
    regularized toward)."""

    def apply(self, pruned_model: nn.Module) -> nn.Module:
        return apply_compensation(pruned_model, self)


# -- the pass ----------------------------------------------------------------------------------------------------------


class _Stop(Exception):
    """Raised after the last MoE layer: the rest of the model (and the LM head) is not needed."""


class _LayerPass:
    """Hooks on one MoE layer: the sliced router's routing on its own input, the unpruned routed output as the target,
    the kept contributions' sums; returns the unpruned output, or in sequential mode the corrected pruned one."""

    def __init__(self, layer: MoELayer, kept: list[int], count_attributes: tuple[str, ...], last: bool,
                 outputs: bool, fit: Callable[[LayerSums], torch.Tensor] | None) -> None:
        self.layer = layer
        self.kept = torch.tensor(kept, dtype=torch.long)
        self.router = copy.deepcopy(layer.router)
        slice_router(self.router, self.kept, layer.num_experts, count_attributes)
        device = _down_projection(layer)[0].device
        k, d = len(kept), _hidden_size(layer)  # kept experts, hidden size
        self.kept_on_device = self.kept.to(device)  # indexed per batch: no host-to-device copy there
        zeros = dict(dtype=torch.float64, device=device)  # on the experts' device: no batch goes to the host
        self.sums = LayerSums(
            layer.name, list(kept), torch.zeros(k, k, **zeros), torch.zeros(k, **zeros), torch.zeros((), **zeros),
            torch.zeros(d, d, **zeros) if outputs else None, torch.zeros(d, d, **zeros) if outputs else None)
        self.last = last
        self.fit = fit
        self.token_weight: torch.Tensor | None = None
        self._routing: tuple[torch.Tensor, torch.Tensor] | None = None

    @contextmanager
    def attached(self) -> Iterator[None]:
        experts = self.layer.experts
        with routed_form([self.layer]):  # Llama 4's experts take ids only in the routed form
            handle = self.layer.router.register_forward_hook(self._router_hook, with_kwargs=True)
            previous = experts.__dict__.get("forward")
            experts.forward = self._forward(type(experts).forward.__get__(experts))
            try:
                yield
            finally:
                del experts.forward
                if previous is not None:
                    experts.forward = previous
                handle.remove()
                self._routing = None

    def _router_hook(self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        self.router.train(module.training)
        # The block's expert-indexed arguments (a routing bias it keeps) cut to the kept experts, as pruning cuts them.
        args = (args[0], *(self._kept_only(value) for value in args[1:]))
        kwargs = {name: self._kept_only(value) for name, value in kwargs.items()}
        routed = self.router(*args, **kwargs)
        if self.layer.input_weighted:  # (scores, logits) of the kept experts
            ids, weights = routed_pairs(routed[0], routed[1], self.layer.top_k)
            self._routing = (ids.detach(), weights.detach())
        else:
            self._routing = (routed[2].detach(), routed[1].detach())  # (ids among the kept, weights)

    def _kept_only(self, value: Any) -> Any:
        count = self.layer.num_experts
        if isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape[0] == count:  # not a batch of count
            return value.index_select(0, self.kept.to(value.device))
        if isinstance(value, torch.Tensor) and tuple(value.shape) == (1, count):
            return value.index_select(1, self.kept.to(value.device))
        return value

    def _take_routing(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The sliced router's ``(ids among the kept, weights)`` for this call of the experts (used once)."""
        if self._routing is None:
            raise CompensationError(f"The router of {self.layer.name} was not called before its experts; "
                                    "compensation needs the router's own input.")
        routing, self._routing = self._routing, None
        return routing

    def _forward(self, native: Callable) -> Callable:
        def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
            ids, weights = self._take_routing()
            target, contributions, pruned = routed_and_pruned(
                self.layer, native, hidden_states, top_k_index, top_k_weights, self.original_ids(ids), weights)
            ids, fixed, contributions, _, _ = self.identity_split(ids, contributions, pruned)
            self._add(ids, contributions, target.float() - fixed)
            result = target
            if self.fit is not None:  # sequential: this batch holds every fitting token, so the correction is final
                correction = self.fit(self.sums).to(contributions.device)
                if correction.dim() == 2:
                    result = contributions.sum(1).double() @ correction.T
                else:
                    result = (contributions * correction[ids].unsqueeze(-1).to(contributions.dtype)).sum(1)
                result = result + fixed.to(result.dtype)
            if self.last:
                raise _Stop
            return result.to(hidden_states.dtype)

        return forward

    def original_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The sliced router's ids as the unpruned layer's (identity experts' too)."""
        return original_ids(self.kept_on_device, ids, self.layer.num_experts)

    def identity_split(self, ids: torch.Tensor, contributions: torch.Tensor, pruned: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:func:`~ompmoe.engine.identity_experts.split_identity_pairs` on a layer with identity experts; else the
        pairs as they are, with nothing fixed (``fixed`` 0, ``measured`` ``None``)."""
        if not self.layer.identity_experts:
            return ids, contributions.new_zeros(()), contributions, pruned, None
        return split_identity_pairs(ids, len(self.sums.kept), contributions, pruned)

    def _add(self, ids: torch.Tensor, contributions: torch.Tensor, target: torch.Tensor) -> None:
        """Add one batch: ``ids`` ``(T, k')`` positions among the kept experts, ``contributions`` ``(T, k', d)``,
        ``target`` ``(T, d)``; padded tokens add zeros (zeroed, not dropped: a boolean index reads back to the
        host)."""
        if self.token_weight is not None:
            keep = (self.token_weight.to(ids.device) > 0).unsqueeze(-1)
            contributions = torch.where(keep.unsqueeze(-1), contributions, 0.0)  # where: a padded NaN adds nothing
            target = torch.where(keep, target, 0.0)
        sums = self.sums
        k = sums.cross.numel()
        device = sums.gram.device
        products = torch.bmm(contributions, contributions.transpose(1, 2)).to(device, torch.float64)  # (T, k, k)
        flat = (ids.unsqueeze(-1) * k + ids.unsqueeze(-2)).reshape(-1).to(device)
        sums.gram.view(-1).index_add_(0, flat, products.reshape(-1))
        inner = torch.einsum("tkd,td->tk", contributions, target).to(device, torch.float64)
        sums.cross.index_add_(0, ids.reshape(-1).to(device), inner.reshape(-1))
        sums.target_energy += target.square().sum().to(device, torch.float64)
        if sums.output_gram is not None and sums.output_cross is not None:
            # float64 products on the CPU; on an accelerator float32 per batch (float64 is slow on most), summed in
            # float64 over batches where the sums are
            dtype = torch.float64 if target.device.type == "cpu" else torch.float32
            pruned, target = contributions.sum(1).to(dtype), target.to(dtype)
            sums.output_gram += (pruned.T @ pruned).to(device)
            sums.output_cross += (target.T @ pruned).to(device)


def routed_and_pruned(layer: MoELayer, native: Callable, hidden: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor, pruned_ids: torch.Tensor, pruned_weights: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(target, contributions, pruned)`` of one experts call: the unpruned routed output ``(T, d)``, the pruned
    routing's contributions ``g' F`` in float32 ``(T, k', d)``, and its pairs' expert outputs ``F`` ``(T, k', d)``
    (original ids ``pruned_ids``). Where the weights scale the experts' input (Llama 4) a contribution is ``F(g' x)``
    itself, and so are the pairs' outputs."""
    if layer.input_weighted:
        target = pair_outputs(layer.experts, hidden, top_k_index, top_k_weights).sum(1)
        pruned = pair_outputs(layer.experts, hidden, pruned_ids, pruned_weights)
        return target, pruned.float(), pruned
    outputs, pruned = _pair_outputs(native, hidden, top_k_index, pruned_ids,
                                    first_identity(layer.num_experts, layer.identity_experts))
    target = (outputs * top_k_weights.unsqueeze(-1).to(outputs.dtype)).sum(1)
    return target, pruned.float() * pruned_weights.float().unsqueeze(-1), pruned


def transposed(layer: MoELayer) -> bool:
    """Whether the layer's experts store their projections as ``(E, in, out)`` (``out = h @ W``): transformers'
    ``is_transposed`` experts (gpt-oss), and Llama 4's."""
    return bool(getattr(layer.experts, "is_transposed", False)) or layer.input_weighted


def _pair_outputs(native: Callable, hidden: torch.Tensor, ids: torch.Tensor, pruned_ids: torch.Tensor,
                  identity: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Unweighted expert outputs ``F`` of the native pairs ``(T, k, d)`` and of the pruned routing's pairs
    ``(T, k', d)`` (original ids), from one flattened call of the experts: a pruned pair whose expert the token had
    already is not evaluated again, so only the replacements cost a second expert call."""
    num_tokens, top_k = ids.shape
    matches = pruned_ids.unsqueeze(-1) == ids.unsqueeze(-2)  # (T, k', k)
    missing = (~matches.any(-1)).nonzero(as_tuple=True)
    rows = torch.cat([hidden.repeat_interleave(top_k, dim=0), hidden[missing[0]]])
    experts = torch.cat([ids.reshape(-1), pruned_ids[missing]]).view(-1, 1)
    unit = torch.ones(rows.shape[0], 1, dtype=hidden.dtype, device=hidden.device)
    flat = pair_call(native, rows, experts, unit, identity)
    outputs = flat[: num_tokens * top_k].view(num_tokens, top_k, -1)
    slot = matches.to(torch.uint8).argmax(-1)  # where a kept pair's output already is
    pruned = outputs.gather(1, slot.unsqueeze(-1).expand(-1, -1, outputs.shape[-1]))
    pruned[missing] = flat[num_tokens * top_k:]
    return outputs, pruned


def check_compensable(model: nn.Module, plan: PruningPlan) -> list[MoELayer]:
    """The model's MoE layers after checking that ``plan`` was made for this (unpruned) model and that its experts
    have down projections a correction folds into; a clear error otherwise."""
    layers = find_moe_layers(model)
    require_plan_model(model, plan, "Compensation runs on the unpruned model the plan was made for, before "
                                    "ompmoe.prune.")
    validate_plan(model, plan, layers)
    check_single_pass(model)
    for layer in layers:
        _down_projection(layer)
    return layers


def check_single_pass(model: nn.Module) -> None:
    """Refuse a model whose forward runs decoder layers more than once (Inkling2-Loop's ``loop_num_passes``): a
    correction is fitted to each layer's one call."""
    config = text_config(getattr(model, "config", None))
    passes, start, end = (getattr(config, key, None) for key in ("loop_num_passes", "loop_layer_index_start",
                                                                   "loop_layer_index_end"))
    layers = getattr(config, "num_hidden_layers", 0)
    if all(isinstance(value, int) for value in (passes, start, end, layers)) and passes > 1 and start < min(end, layers):
        raise CompensationError(
            f"{type(model).__name__} runs decoder layers {start} to {end} {passes} times per forward "
            "(loop_num_passes): compensation fits each layer's one call; run without compensation.")


def check_foldable(layer: MoELayer) -> None:
    """Refuse a layer whose experts' fused down projection cannot take a correction: every granularity folds there
    (no 3-D ``down_proj`` indexed by expert, or each expert's output normalized after it: MuseSpark)."""
    _down_projection(layer)


def _down_projection(layer: MoELayer) -> tuple[nn.Parameter, nn.Parameter | None]:
    """The fused down projection (and its bias) of a layer's experts, indexed by expert on the first axis."""
    experts = layer.experts
    weight = getattr(experts, "down_proj", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 3 or weight.shape[0] != layer.num_experts:
        raise CompensationError(
            f"Compensation folds its correction into the experts' fused down projection; {layer.name}.experts "
            f"({type(experts).__name__}) has no 3-D `down_proj` indexed by expert. Run without compensation.")
    if getattr(experts, "has_post_expert_norm", False):
        raise CompensationError(
            f"{layer.name}.experts normalizes each expert's output after its down projection, so a correction there "
            "does not reach the output; run without compensation.")
    bias = getattr(experts, "down_proj_bias", None)
    return weight, bias if isinstance(bias, nn.Parameter) else None


def _hidden_size(layer: MoELayer) -> int:
    """The output width of the experts: ``down_proj`` is ``(E, d, inner)``, or ``(E, inner, d)`` when transposed."""
    return int(_down_projection(layer)[0].shape[2 if transposed(layer) else 1])


def _corrected(layer: MoELayer, parameter: torch.Tensor, correction: torch.Tensor) -> torch.Tensor:
    """Down projection rows ``(K, d, inner)`` (``(K, inner, d)`` when transposed) or bias rows ``(K, d)`` with the
    correction folded in: factors ``(K,)`` scale each expert's rows, a map ``(d, d)`` multiplies every output."""
    value = parameter.detach().to(torch.float64)
    c = correction.to(value.device, torch.float64)
    if c.dim() == 1:
        return (value * c.view((-1,) + (1,) * (value.dim() - 1))).to(parameter.dtype)
    if value.dim() == 2:  # bias (K, d): M b
        return (value @ c.T).to(parameter.dtype)
    if transposed(layer):  # out = h @ W, W (K, inner, d): M out = h @ (W M^T)
        return torch.einsum("kfj,ij->kfi", value, c).to(parameter.dtype)
    return torch.einsum("ij,kjf->kif", c, value).to(parameter.dtype)  # out = W h, W (K, d, inner)


@torch.no_grad()
def compensation_sums(model: nn.Module, plan: PruningPlan, batches: torch.Tensor | Iterable[Any], *,
                      batch_size: int | None = 4, granularity: str = DEFAULT_GRANULARITY, sequential: bool = False,
                      ridge: float | None = DEFAULT_RIDGE,
                      reduce: Callable[[dict[str, torch.Tensor]], None] | None = None,
                      max_sum_bytes: int | None = MAX_SUM_BYTES) -> CompensationSums:
    """Per MoE layer, the compensation sums of the pruned block (via ``plan``) against the unpruned one, over
    ``batches`` (a ``(n, seq)`` token tensor cut into ``batch_size`` rows, or an iterable of input-id tensors or dicts
    for ``model(**batch)``; padding masked by ``attention_mask`` counts nothing), on the **unpruned** ``model``.
    ``granularity="linear"`` also collects the ``d x d`` output sums the map needs, refused before any forward when
    they would take more than ``max_sum_bytes`` on one device (``None``: no limit).

    ``sequential``: the batches run as one batch (all their tokens at once) through the pruned model, each layer
    corrected with what ``fit_scales(sums, granularity, ridge)`` gives on its sums before the next layer runs;
    ``reduce`` (in place on a layer's ``{"gram": ..., "cross": ..., ...}``, e.g. an all-reduce) merges a layer's sums
    across ranks before its fit. Without ``sequential`` the model runs unpruned and the returned sums add across batches
    and ranks (``a + b``, :meth:`CompensationSums.all_reduce`).
    """
    _check_options(granularity, ridge)
    _check_summed(granularity)
    layers = check_compensable(model, plan)
    if granularity == "linear":
        check_sum_budget(layers, max_sum_bytes)
    spec = architecture_of(model)
    device = next(model.parameters()).device
    if isinstance(batches, torch.Tensor):
        if batches.dim() != 2 or batches.shape[0] == 0 or batches.shape[1] == 0:
            raise CompensationError(f"Compensation needs (num_blocks, seq_len) token ids; got shape "
                                    f"{tuple(batches.shape)}.")
        batches = batches.split(batch_size) if batch_size else [batches]
    inputs = [as_model_inputs(batch, device) for batch in batches]
    if not inputs:
        raise CompensationError("Compensation needs at least one batch of calibration tokens.")
    if sequential and len(inputs) > 1:
        inputs = [_concatenated(inputs)]
    fit = None
    if sequential:  # the one batch's tokens (over ranks) set the automatic ridge
        count = {"num_tokens": _count_tokens(torch.zeros((), dtype=torch.float64, device=device), inputs[0])}
        if reduce is not None:
            reduce(count)
        tokens = float(count["num_tokens"])
        fit = lambda sums: _fit_layer(_reduce_layer(sums, reduce), granularity, ridge, tokens)  # noqa: E731
    passes = [_LayerPass(layer, sorted(int(i) for i in layer_plan.kept), spec.count_attributes,
                         index == len(layers) - 1, granularity == "linear", fit)
              for index, (layer, layer_plan) in enumerate(zip(layers, plan.layers))]
    num_tokens = torch.zeros((), dtype=torch.float64, device=device)
    with eval_mode(model), adaptive_paused(model), ExitStack() as stack:
        for each in passes:
            stack.enter_context(each.attached())
        for batch in inputs:
            check_calibration_inputs(model, batch)
            mask = batch.get("attention_mask")
            weight = None if mask is None else mask.reshape(-1)
            for each in passes:
                each.token_weight = weight
            _count_tokens(num_tokens, batch)
            with suppress(_Stop):
                model(**batch, use_cache=False)
    return CompensationSums([each.sums for each in passes], num_tokens, plan.fingerprint, sequential)


def _count_tokens(total: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Add ``batch``'s real tokens (mask sum, or all positions) to ``total`` in place, on its device: no host read."""
    mask = batch.get("attention_mask")
    if mask is None:
        source = batch.get("input_ids", batch.get("inputs_embeds"))
        return total.add_(int(source.shape[0] * source.shape[1]))
    return total.add_(mask.sum().to(total.device))


def linear_sum_bytes(layers: list[MoELayer]) -> dict[torch.device, int]:
    """Bytes of ``linear``'s two ``d x d`` float64 sums per MoE layer, summed per device they accumulate on."""
    sizes: dict[torch.device, int] = {}
    for layer in layers:
        device, d = _down_projection(layer)[0].device, _hidden_size(layer)
        sizes[device] = sizes.get(device, 0) + 2 * d * d * 8
    return sizes


def check_sum_budget(layers: list[MoELayer], max_sum_bytes: int | None) -> None:
    """Refuse ``linear`` when its sums would take more than ``max_sum_bytes`` on one device: before any forward, not
    as an out-of-memory error after the calibration pass."""
    if max_sum_bytes is None:
        return
    if isinstance(max_sum_bytes, bool) or not isinstance(max_sum_bytes, int) or max_sum_bytes <= 0:
        raise CompensationError(f"max_sum_bytes must be a positive int or None (no limit); got {max_sum_bytes!r}.")
    for device, size in linear_sum_bytes(layers).items():
        if size > max_sum_bytes:
            d = _hidden_size(layers[0])
            raise CompensationError(
                f"granularity='linear' needs {readable_size(size)} of float64 sums on {device} (two {d} x {d} per "
                f"MoE layer), over max_sum_bytes={max_sum_bytes} ({readable_size(max_sum_bytes)}); pass "
                "granularity='expert' or a larger max_sum_bytes.")


def _reduce_layer(sums: LayerSums, reduce: Callable[[dict[str, torch.Tensor]], None] | None) -> LayerSums:
    """``reduce`` (in place, e.g. an all-reduce; ``None``: none) on one layer's sums; returns them."""
    if reduce is not None:
        states = sums.tensors()
        reduce(states)
        for key, value in states.items():
            setattr(sums, key, value)
    return sums


def _concatenated(inputs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    keys = set(inputs[0])
    if any(set(batch) != keys for batch in inputs):
        raise CompensationError("Sequential compensation joins its batches into one: every batch needs the same keys.")
    lengths = {batch[key].shape[1] for batch in inputs for key in keys}
    if len(lengths) != 1:
        raise CompensationError(f"Sequential compensation joins its batches into one: they need one sequence length; "
                                f"got {sorted(lengths)}.")
    return {key: torch.cat([batch[key] for batch in inputs]) for key in keys}


# -- the fit -----------------------------------------------------------------------------------------------------------


def _check_options(granularity: str, ridge: float | None) -> None:
    if granularity not in GRANULARITIES:
        raise CompensationError(f"granularity must be one of {', '.join(GRANULARITIES)}; got {granularity!r}.")
    if ridge is not None and (isinstance(ridge, bool) or not isinstance(ridge, (int, float))
                              or not math.isfinite(ridge) or ridge < 0):
        raise CompensationError(f"ridge must be a finite number >= 0 or None (automatic); got {ridge!r}.")


def _check_summed(granularity: str) -> None:
    if granularity not in SUM_GRANULARITIES:
        raise CompensationError(f"granularity={granularity!r} is not fitted from summed statistics: call "
                                "compensate(..., granularity='down') (or ompmoe.engine.apply.down_refit.refit_down).")


def effective_ridge(granularity: str, ridge: float | None, num_tokens: float, hidden_size: int) -> float:
    """The ridge a fit uses: ``ridge`` itself, or for ``None`` ``hidden_size / num_tokens`` (``linear``),
    :data:`EXPERT_RIDGE` (``expert``), 0 (``layer``, which has none)."""
    if ridge is not None:
        return float(ridge)
    if granularity == "linear":
        return hidden_size / max(float(num_tokens), 1.0)
    return EXPERT_RIDGE if granularity == "expert" else 0.0


def layer_factor(sums: LayerSums) -> float:
    """``<Y', Y> / ||Y'||^2``: the one least-squares factor of the layer (1 when the pruned output is zero)."""
    energy = float(sums.gram.sum())
    return float(sums.cross.sum()) / energy if energy > 0 else 1.0


def _solve(system: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """``system x = rhs`` in float64 on the system's device (a ``linear`` map's ``d x d`` sums and result stay where
    they are; applying the map moves it to the weights), least squares on the CPU where the system is singular."""
    try:
        return torch.linalg.solve(system, rhs)
    except RuntimeError:  # singular: e.g. ridge 0 with fewer fitting tokens than unknowns (gelsd: CPU only)
        return torch.linalg.lstsq(system.cpu(), rhs.cpu(), driver="gelsd").solution.to(system.device)


def _fit_layer(sums: LayerSums, granularity: str, ridge: float | None, num_tokens: float) -> torch.Tensor:
    base = layer_factor(sums)
    if granularity == "linear":
        if sums.output_gram is None or sums.output_cross is None:
            raise CompensationError("granularity='linear' needs the output sums: collect them with "
                                    "compensation_sums(..., granularity='linear').")
        d = sums.output_gram.shape[0]
        lam = effective_ridge(granularity, ridge, num_tokens, d) * float(sums.output_gram.trace()) / d
        eye = torch.eye(d, dtype=torch.float64, device=sums.output_gram.device)
        # M (P + lam I) = C + lam s I, P symmetric: (P + lam I) M^T = (C + lam s I)^T
        return _solve(sums.output_gram + lam * eye, (sums.output_cross + lam * base * eye).T).T.contiguous()
    scales = torch.full((sums.cross.numel(),), base, dtype=torch.float64)
    if granularity == "layer":
        return scales
    gram, cross = sums.gram.cpu(), sums.cross.cpu()
    diagonal = gram.diagonal()
    active = diagonal > 0  # experts no fitting token reached keep the layer's factor
    if not bool(active.any()):
        return scales
    index = active.nonzero().squeeze(-1)
    d = diagonal[index]
    # Contributions of experts outside the active set are zero, so the active block is the whole problem.
    ridge = effective_ridge(granularity, ridge, num_tokens, 0)
    system = gram[index][:, index] + ridge * torch.diag(d)
    scales[index] = _solve(system, (cross[index] + ridge * d * base).unsqueeze(-1)).squeeze(-1)
    return scales


def fit_scales(sums: CompensationSums, granularity: str = DEFAULT_GRANULARITY, ridge: float | None = DEFAULT_RIDGE
               ) -> dict[str, torch.Tensor]:
    """Per layer, the float64 correction (docs/quality/compensation.md): ``layer`` one factor repeated per kept
    expert (ascending ids), ``expert`` ridge-shrunk per-expert factors (CPU), ``linear`` the ``(d, d)`` map (where its
    sums are)."""
    _check_options(granularity, ridge)
    _check_summed(granularity)
    tokens = float(sums.num_tokens)
    return {layer.name: _fit_layer(layer, granularity, ridge, tokens) for layer in sums.layers}


def layer_summary(sums: LayerSums, scale: torch.Tensor) -> dict[str, Any]:
    """What the record keeps of one layer's fit (its sums can then be freed: layer by layer, or a ``d x d`` pair per
    layer): the factors (a map's diagonal), the routed-output error before and after, the layer's factor and a map's
    off-diagonal share."""
    return {"values": (scale if scale.dim() == 1 else scale.diagonal()).detach().to("cpu", torch.float64),
            "before": sums.residual(torch.ones_like(sums.cross)), "after": sums.residual(scale),
            "factor": round(layer_factor(sums), 6), "hidden": int(scale.shape[0]),
            "off_diagonal": float((scale - torch.diag(scale.diagonal())).norm() / scale.norm().clamp(min=1e-30))
            if scale.dim() == 2 else None}


def record_of_summaries(summaries: Mapping[str, dict[str, Any]], num_tokens: float, granularity: str,
                        ridge: float | None, sequential: bool = False) -> dict[str, Any]:
    """:func:`compensation_record` from the layers' :func:`layer_summary` (in model order)."""
    layers = list(summaries.values())
    values = torch.cat([layer["values"] for layer in layers])
    record: dict[str, Any] = {
        "method": "least_squares", "granularity": granularity,
        "ridge": None if granularity == "layer" else effective_ridge(granularity, ridge, float(num_tokens),
                                                                     layers[0]["hidden"]),
        "ridge_rule": "given" if ridge is not None or granularity == "layer" else (
            "hidden_size / tokens" if granularity == "linear" else f"default {EXPERT_RIDGE:g}"),
        "sequential": bool(sequential),
        "num_tokens": int(round(float(num_tokens))),
        "scale_mean": float(values.mean()), "scale_min": float(values.min()), "scale_max": float(values.max()),
        "layer_scales": {name: layer["factor"] for name, layer in summaries.items()},
        "routed_error_before": sum(layer["before"] for layer in layers) / len(layers),
        "routed_error_after": sum(layer["after"] for layer in layers) / len(layers),
    }
    if granularity == "linear":
        record["map_off_diagonal"] = sum(layer["off_diagonal"] for layer in layers) / len(layers)
    return record


def compensation_record(sums: CompensationSums, scales: Mapping[str, torch.Tensor], granularity: str,
                        ridge: float | None) -> dict[str, Any]:
    """What was fitted, JSON-able: settings, tokens, the factors' range (a map's diagonal; ``map_off_diagonal`` is
    the Frobenius norm of the rest over the map's, mean over layers), and the fitting tokens' relative routed-output
    error ``||Y - Y'||^2 / ||Y||^2`` (mean over layers) before and after."""
    summaries = {layer.name: layer_summary(layer, scales[layer.name]) for layer in sums.layers}
    return record_of_summaries(summaries, float(sums.num_tokens), granularity, ridge, sums.sequential)


# -- applying it -------------------------------------------------------------------------------------------------------


def _check_correction(layer: MoELayer, correction: torch.Tensor, count: int) -> None:
    d = _hidden_size(layer)
    expected = (d, d) if correction.dim() == 2 else (count,)
    if tuple(correction.shape) != expected:
        raise CompensationError(f"The correction of {layer.name} has shape {tuple(correction.shape)}; expected "
                                f"{expected} (factors of the {count} kept experts, or a {d} x {d} map).")
    if not bool(torch.isfinite(correction).all()):
        raise CompensationError(f"The correction of {layer.name} is not all finite.")


def check_compensation_fits(model: nn.Module, scales: Mapping[str, Any], kept: Mapping[str, list[int]],
                            owner: str) -> dict[str, Any]:
    """Refuse corrections that were not fitted for the plan the **pruned** ``model`` (weights or a skeleton) was
    pruned with: other layers, other kept ids, or shapes and values that cannot be folded in. Returns its record."""
    info = pruning_info(model)
    if not isinstance(info, dict) or "kept_experts" not in info:
        raise CompensationError(f"{owner} works on a pruned model (ompmoe.prune(model, plan) first); this "
                                "model carries no pruning record.")
    if info.get("compensation") is not None:
        raise CompensationError("This model was compensated already; prune the original model again to refit.")
    layers = find_moe_layers(model)
    names = [layer.name for layer in layers]
    if sorted(scales) != sorted(names):
        raise CompensationError(f"The corrections cover layers {sorted(scales)} but the model's MoE layers are "
                                f"{names}.")
    pruned_with = last_pruning_kept(info)  # numbered as the plan numbers them (a re-pruned model's too)
    if pruned_with is None:
        raise CompensationError("This model was pruned again by an ompmoe that did not record which experts its "
                                "earlier pruning kept, so a correction cannot be matched to its experts; prune the "
                                "original model (or that earlier output) again with this ompmoe, then compensate.")
    for layer in layers:
        ids = [int(i) for i in kept[layer.name]]
        if pruned_with.get(layer.name) != ids or layer.num_experts != len(ids):
            raise CompensationError(
                f"The correction of {layer.name} was fitted for kept experts {ids} but the model keeps "
                f"{pruned_with.get(layer.name)}; fit it with the plan the model was pruned with.")
        _check_correction(layer, torch.as_tensor(scales[layer.name]), len(ids))
    return info


@torch.no_grad()
def apply_compensation(model: nn.Module, compensation: Compensation | Mapping[str, torch.Tensor],
                       kept: Mapping[str, list[int]] | None = None) -> nn.Module:
    """Fold the corrections into the kept experts' down projections (and biases) of the **pruned** ``model``, in
    place, and add the record to its ``config.ompmoe`` (saved in ``config.json``); returns ``model``.

    ``compensation``: a :class:`Compensation`, or ``{layer: factors (K,) or map (d, d)}`` with ``kept`` (the ids the
    factors belong to, numbered as the plan numbers them: the original's after a first pruning, the pruned model's
    positions after a re-pruning). They must be those the model was pruned to; a model compensated already is
    refused.
    """
    weights = None
    if isinstance(compensation, Compensation):
        scales, kept, record, weights = compensation.scales, compensation.kept, compensation.record, compensation.weights
    else:
        scales, record = dict(compensation), {}
        if kept is None:
            raise CompensationError("apply_compensation needs the kept ids of each layer (kept=...) with bare factors.")
    info = check_compensation_fits(model, scales, kept, "apply_compensation")
    for layer in find_moe_layers(model):
        compensate_layer(layer, torch.as_tensor(scales[layer.name]), _replacements(weights, layer.name))
    setattr(model.config, CONFIG_KEY, {**info, "compensation": dict(record or {"method": "least_squares"})})
    return model


@torch.no_grad()
def compensate_layer(layer: MoELayer, scale: torch.Tensor,
                     replacement: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)) -> None:
    """Fold one **pruned** layer's correction into its kept experts' down projection (and bias), or put the refit
    rows ``replacement`` in their place: :func:`apply_compensation` for one layer (the streamed writer's)."""
    for parameter, rows in zip(_down_projection(layer), replacement):
        if parameter is not None:
            parameter.data.copy_(_corrected(layer, parameter, scale) if rows is None else rows.to(parameter))


def record_compensation(model: nn.Module, record: Mapping[str, Any]) -> None:
    """Add the compensation ``record`` to a pruned model's ``config.ompmoe``, without touching its weights: a
    weightless skeleton whose files get the compensated rows as they are written (layer by layer)."""
    info = pruning_info(model)
    if not isinstance(info, dict) or "kept_experts" not in info:
        raise CompensationError("record_compensation records on a pruned model (ompmoe.prune(model, plan) first).")
    setattr(model.config, CONFIG_KEY, {**info, "compensation": dict(record)})


def _replacements(weights: Mapping[str, tuple[torch.Tensor, torch.Tensor | None]] | None, name: str
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The refit rows replacing a layer's kept down projection and bias (``(None, None)``: the correction folds)."""
    if weights is None:
        return None, None
    return weights[name]


@contextmanager
def compensated_view(model: nn.Module, plan: PruningPlan, compensation: Compensation) -> Iterator[nn.Module]:
    """Within the context, the **unpruned** ``model`` computes what ``prune`` then ``compensation.apply`` would
    (:func:`~ompmoe.engine.apply.trial.pruned_view` with the kept experts' down projections corrected meanwhile); the
    weights are restored bit for bit afterwards, also when the body raises."""
    layers = check_compensable(model, plan)
    kept = [sorted(int(i) for i in layer_plan.kept) for layer_plan in plan.layers]
    for layer, ids in zip(layers, kept):
        if compensation.kept.get(layer.name) != ids:
            raise CompensationError(f"The compensation of {layer.name} was fitted for kept experts "
                                    f"{compensation.kept.get(layer.name)}, but the plan keeps {ids}.")
        _check_correction(layer, compensation.scales[layer.name], len(ids))
    with ExitStack() as stack:
        for layer, ids in zip(layers, kept):
            stack.enter_context(corrected_rows(layer, ids, compensation.scales[layer.name],
                                               _replacements(compensation.weights, layer.name)))
        with pruned_view(model, plan):
            yield model


@contextmanager
def corrected_rows(layer: MoELayer, kept: list[int], scale: torch.Tensor,
                   replacement: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
                   grid: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Iterator[None]:
    """Within the context, the **unpruned** ``layer``'s rows ``kept`` of its down projection (and bias) carry the
    correction (or the refit rows); restored bit for bit afterwards, also when the body raises. ``grid``: the values
    corrected down projections are read back as once written quantized again
    (:meth:`~ompmoe.engine.lazy_checkpoint.LazyCheckpoint.grid`), so a run measures what it writes."""
    saved: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for position, (parameter, rows_in) in enumerate(zip(_down_projection(layer), replacement)):
                if parameter is None:
                    continue
                rows = torch.tensor(kept, dtype=torch.long, device=parameter.device)
                original = parameter.data.index_select(0, rows)
                saved.append((parameter, rows, original))
                corrected = _corrected(layer, original, scale) if rows_in is None else rows_in.to(original)
                if grid is not None and position == 0:  # the weight; a bias stays full precision
                    corrected = grid(corrected)
                parameter.data.index_copy_(0, rows, corrected)
        yield
    finally:
        with torch.no_grad():
            for parameter, rows, original in reversed(saved):
                parameter.data.index_copy_(0, rows, original)


def compensation_obstacle(model: nn.Module) -> CompensationError | None:
    """Why no correction can be folded into ``model``'s experts, or written (``None``: it can): a layer run twice per
    forward (:func:`check_single_pass`), a down projection a correction does not reach (:func:`check_foldable`), or,
    for a skeleton of a quantized checkpoint, one that cannot be quantized again in the files' layout
    (:func:`check_regridable`). Every front door asks it before any work."""
    try:
        check_single_pass(model)
        for layer in find_moe_layers(model):
            check_foldable(layer)
            if (settings := stored_quantization(model)) is not None:  # its down projections are quantized again
                check_regridable(layer, settings)
    except CompensationError as error:
        return error
    return None


def without_fix(error: CompensationError) -> str:
    """``error``'s reason without its closing advice to run without compensation (the caller says what it does)."""
    return str(error).removesuffix("; run without compensation.").removesuffix(" Run without compensation.")


def check_regridable(layer: MoELayer, settings: dict[str, Any]) -> None:
    """Refuse quantizing a layer's corrected down projection again (the files' format ``settings``) where the model's
    layout may not be the files' (a transposed experts module, as Aria's, in block FP8 or compressed-tensors; none is
    released so). MXFP4 reads gpt-oss's transposed experts into the model's layout, and quantizes them back from it."""
    if transposed(layer) and not quantized_in_model_layout(settings):
        raise CompensationError(f"{layer.name}.experts stores its down projection transposed; ompmoe quantizes "
                                "compensated down projections again only in the files' layout. Run without "
                                "compensation.")


def heldout_losses(model: nn.Module, plan: PruningPlan, compensation: Compensation, blocks: torch.Tensor,
                   batch_size: int = 4) -> tuple[float, float]:
    """Mean next-token loss (nats) of the pruned model on ``blocks`` without and with ``compensation``, both run on
    the unpruned ``model`` (no copy): where compensation helps, the second is lower."""
    with pruned_view(model, plan):
        without = math.log(perplexity(model, blocks, batch_size))
    with compensated_view(model, plan, compensation):
        with_ = math.log(perplexity(model, blocks, batch_size))
    return without, with_


def spread_blocks(blocks: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """The fewest of ``blocks`` (``(n, seq)``) holding ``max_tokens`` tokens, evenly spaced over them (a set made
    of several sources one after the other gives each its share), in order; all of them when they hold fewer."""
    if blocks.dim() != 2 or blocks.shape[1] == 0:
        raise CompensationError(f"Compensation needs (num_blocks, seq_len) token ids; got shape {tuple(blocks.shape)}.")
    rows = spread_rows(blocks.shape[0], blocks.shape[1], max_tokens)
    return blocks if rows is None else blocks[rows]


def spread_rows(num_rows: int, row_tokens: int, max_tokens: int) -> list[int] | None:
    """The indices :func:`spread_blocks` takes of ``num_rows`` rows of ``row_tokens`` tokens; ``None``: all rows."""
    count = -(-max_tokens // int(row_tokens))
    return None if count >= num_rows else torch.linspace(0, num_rows - 1, count).round().long().tolist()


def fitting_tokens(model: nn.Module, calibration_tokens: int | None = None) -> int:
    """Tokens to fit on: :data:`TOKENS_PER_DIMENSION` per hidden dimension of the experts' output (the ``linear``
    map's unknowns per row), at most a quarter of ``calibration_tokens`` when given (the pass costs about 1.6x a
    forward per token, so at most 0.4x a forward over the calibration text), at least one token."""
    tokens = TOKENS_PER_DIMENSION * _hidden_size(find_moe_layers(model)[0])
    if calibration_tokens is not None:
        tokens = min(tokens, calibration_tokens // 4)
    return max(1, int(tokens))


# -- the one call ------------------------------------------------------------------------------------------------------


def compensate(model: nn.Module, plan: PruningPlan, blocks: torch.Tensor | Iterable[Any], batch_size: int = 4, *,
               granularity: str = DEFAULT_GRANULARITY, ridge: float | None = DEFAULT_RIDGE, sequential: bool = False,
               max_tokens: int | str | None = "auto",
               reduce: Callable[[dict[str, torch.Tensor]], None] | None = None,
               max_sum_bytes: int | None = MAX_SUM_BYTES) -> Compensation:
    """Fit the compensation of ``plan`` on the **unpruned** ``model``: call it before ``prune(model, plan)``, then
    ``compensation.apply(model)`` after. ``blocks``: ``(n, seq)`` calibration token ids, of which the fewest holding
    ``max_tokens`` tokens, evenly spaced, are used (:func:`spread_blocks`; ``"auto"``: :func:`fitting_tokens`, 16
    tokens per hidden dimension; ``None``: all), run ``batch_size`` rows at a time (``sequential``: all at once); or an
    iterable of batches, all used.

    ``reduce`` (distributed runs): called in place on each layer's sums (``{"gram": ..., "cross": ..., ...}``) and on
    ``{"num_tokens": ...}``, e.g. ``lambda d: [dist.all_reduce(t) for t in d.values()]``, so every rank fits the same
    correction.

    ``max_sum_bytes``: ``linear`` is refused before any forward when its ``d x d`` sums would take more on one device
    (:data:`MAX_SUM_BYTES`, 8 GiB; ``None``: no limit): pass ``granularity="expert"`` or a larger budget then.
    """
    _check_options(granularity, ridge)
    if granularity == "down":
        raise CompensationError("granularity='down' is fitted in its own pass: "
                                "ompmoe.engine.apply.down_refit.compensate_down(model, plan, blocks) (a run: "
                                "compensation='down').")
    if max_tokens == "auto":
        max_tokens = fitting_tokens(model)
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0):
        raise CompensationError(f"max_tokens must be a positive int, 'auto' or None (every block); got "
                                f"{max_tokens!r}.")
    if isinstance(blocks, torch.Tensor) and max_tokens is not None:
        blocks = spread_blocks(blocks, max_tokens)
    sums = compensation_sums(model, plan, blocks, batch_size=batch_size, granularity=granularity,
                             sequential=sequential, ridge=ridge, reduce=reduce if sequential else None,
                             max_sum_bytes=max_sum_bytes)
    if reduce is not None:
        if not sequential:
            for layer in sums.layers:
                _reduce_layer(layer, reduce)
        count = {"num_tokens": sums.num_tokens}
        reduce(count)
        sums.num_tokens = count["num_tokens"]
    scales = fit_scales(sums, granularity, ridge)
    kept = {layer.name: list(layer.kept) for layer in sums.layers}
    return Compensation(scales, kept, compensation_record(sums, scales, granularity, ridge))


__all__ = ["Compensation", "CompensationError", "CompensationSums", "check_foldable", "check_single_pass", "DEFAULT_GRANULARITY", "DEFAULT_RIDGE",
           "EXPERT_RIDGE", "GRANULARITIES", "SUM_GRANULARITIES", "LayerSums", "MAX_SUM_BYTES", "TOKENS_PER_DIMENSION",
           "apply_compensation", "check_compensable", "check_regridable", "compensation_obstacle", "without_fix", "check_sum_budget", "compensate", "compensate_layer",
           "compensated_view", "compensation_record", "corrected_rows", "layer_summary", "record_compensation",
           "record_of_summaries", "compensation_sums", "effective_ridge", "fit_scales", "fitting_tokens",
           "heldout_losses", "layer_factor", "linear_sum_bytes", "spread_blocks", "spread_rows"]
