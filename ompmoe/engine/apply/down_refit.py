"""The ``down`` compensation: every kept routed expert's down projection (and bias) refit by least squares to the
unpruned block's routed output, on the real pruned block (rerouting and renormalization included), by block
coordinate descent over the experts (Gauss-Seidel sweeps), with a ridge toward the ``linear`` map's compensated
weights. Folded into the weights: the pruned model stays a stock checkpoint.

Per MoE layer, with the fitting tokens' pruned pairs ``(x, e)`` (``e`` among ``x``'s pruned top-k, weight ``g'``),
``u = g' h_e(x)`` (``h_e`` the expert's intermediate activation, the down projection's input; with a bias ``[u, g']``)
and the target ``Y(x)`` (unpruned routed output), the refit minimizes

    sum_x ||Y(x) - sum_e W_e u_e(x)||^2 + sum_e lam_e ||W_e - W0_e||^2,   lam_e = alpha * tr(A_e) / n_e

(``A_e = sum u_e u_e^T``, ``n_e`` its size, ``W0_e = M W_e`` the ``linear`` map ``M`` folded in). One expert at a
time, the others fixed: ``W_e = (R_e^T U_e + lam_e W0_e)(A_e + lam_e I)^-1`` with ``R_e`` the target minus the other
experts' part, over that expert's tokens only; the prediction is updated in place. Only ``m x m`` systems per
expert (one Cholesky factor per ``alpha``, shared by the sweeps): no ``K*m``-sized joint system.
Measured in docs/quality/compensation.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack, suppress
from typing import Any

import torch
from torch import nn

from ..adapters import MoELayer, architecture_of
from ..collect.collector import as_model_inputs, check_calibration_inputs
from ..perplexity import eval_mode
from ..planning.plan import PruningPlan
from .adaptive import adaptive_paused
from .compensation import (
    Compensation,
    CompensationError,
    _concatenated,
    _count_tokens,
    _down_projection,
    _fit_layer,
    _LayerPass,
    _Stop,
    check_compensable,
    layer_summary,
    record_of_summaries,
    routed_and_pruned,
    spread_blocks,
    transposed,
)
from ..input_weighted import pair_intermediates

DOWN_ALPHAS = (0.1,)
"""The ridge strengths ``alpha`` a run tries (toward the ``linear`` map's weights; large: the map itself), the map
included; it keeps the one with the lowest loss on its choice blocks. 0.1 was the best of 0.01, 0.1 and 1 in 15 of
18 measured cases, and each more ``alpha`` costs as much again as the first (docs/quality/compensation.md)."""
DEFAULT_ALPHA = 0.1
"""The ``alpha`` of ``compensation="down"`` and where nothing chooses (no choice blocks)."""
SWEEPS = 3
"""Gauss-Seidel sweeps over the kept experts: three matched the joint solve within 0.02 % of perplexity."""
MAX_TOKENS = 65_536
"""The most fitting tokens (all of a run's calibration text up to this): they run as one batch, whose pruned pairs'
outputs a layer holds at once (Qwen3-30B-A3B: 65,536 tokens x 8 pairs x 2,048 x 4 bytes = 4 GiB)."""
CHECKED_PAIRS = 8192
"""Pairs (evenly spread) on which the refit checks its ``down(h)`` against the experts' own outputs."""
MATCH_TOLERANCE = 1e-3
"""Largest relative difference between the experts' own outputs and ``down(h)`` from the intermediate activations
computed here (in float32; in a lower precision, :func:`match_tolerance`): beyond it the refit would fit a different
function, and it is refused."""


def match_tolerance(dtype: torch.dtype) -> float:
    """:data:`MATCH_TOLERANCE`, or four rounding units of ``dtype`` where that is more: the experts' own bfloat16
    outputs differ from the float32 ``down(h)`` by about 2e-3 (a different function: by order 1)."""
    return max(MATCH_TOLERANCE, 4 * torch.finfo(dtype).eps) if dtype.is_floating_point else MATCH_TOLERANCE


def down_fitting_tokens(model: nn.Module, calibration_tokens: int | None = None) -> int:
    """Tokens the refit fits on: every calibration token, at most :data:`MAX_TOKENS` (fewer overfit: a quarter of
    the shipped models' 15,360 made it worse than the ``linear`` map, docs/quality/compensation.md)."""
    return MAX_TOKENS if calibration_tokens is None else max(1, min(MAX_TOKENS, int(calibration_tokens)))


def check_down_refit(layer: MoELayer) -> None:
    """Refuse a layer whose experts the refit cannot take apart into intermediate activation and down projection:
    those not built on transformers' experts interface (``has_gate``, ``gate_up_proj`` or ``up_proj``, ``act_fn``)."""
    _down_projection(layer)
    if layer.input_weighted:  # Llama 4's experts: their intermediate activation is computed as they compute it
        return
    experts = layer.experts
    gated = has_gate(experts)
    inner = "gate_up_proj" if gated else "up_proj"
    if (gated is None or not isinstance(getattr(experts, inner, None), nn.Parameter)
            or (not gated and not callable(getattr(experts, "act_fn", None)))):
        raise CompensationError(
            f"compensation='down' computes each expert's intermediate activation itself, for experts built on "
            f"transformers' experts interface (has_gate, gate_up_proj or up_proj); {layer.name}.experts "
            f"({type(experts).__name__}) is not. Use compensation='linear'.")


def has_gate(experts: nn.Module) -> bool | None:
    """Whether the experts gate their up projection (``gate_up_proj``): transformers' experts interface says so in
    ``has_gate``; transformers' own experts with their own forward by a ``gate_up_proj`` and an ``_apply_gate``
    (Step 3.7's, which clamps) or an ``act_fn`` (LongCat-Flash's, ``act(gate) * up`` of its halves, as the
    interface's), which the matrix checks type by type; ``None`` when it cannot be told (a module of remote code
    must say ``has_gate``). The refit checks what it computes against the experts' own outputs either way."""
    if hasattr(experts, "has_gate"):
        return bool(experts.has_gate)
    if (type(experts).__module__.startswith("transformers.models.")
            and isinstance(getattr(experts, "gate_up_proj", None), nn.Parameter)
            and any(callable(getattr(experts, name, None)) for name in ("_apply_gate", "act_fn"))):
        return True
    return None


def gated_activation(experts: nn.Module, projected: torch.Tensor) -> torch.Tensor:
    """The experts' activation of their ``gate_up_proj`` output: their own ``_apply_gate``, else ``act(gate) * up``
    of its halves, as transformers' experts interface computes it."""
    if callable(getattr(experts, "_apply_gate", None)):
        return experts._apply_gate(projected)
    gate, up = projected.chunk(2, dim=-1)
    return experts.act_fn(gate) * up


def expert_intermediate(experts: nn.Module, hidden: torch.Tensor, token_ids: torch.Tensor,
                        expert_ids: torch.Tensor) -> torch.Tensor:
    """``h_e(x)``, the down projection's input, for each pair ``(x, e)``: the token ``hidden[token_ids]`` and its
    expert ``expert_ids`` (both ``(P,)``), computed as transformers' experts compute the up (and gate) projection and
    activation; the pairs' inputs are gathered one expert at a time (never ``(P, d)`` at once)."""
    gated = bool(has_gate(experts))
    weight = experts.gate_up_proj if gated else experts.up_proj
    bias = getattr(experts, "gate_up_proj_bias" if gated else "up_proj_bias", None) if getattr(
        experts, "has_bias", False) else None
    transposed = bool(getattr(experts, "is_transposed", False))
    width = weight.shape[2] if transposed else weight.shape[1]
    projected = hidden.new_empty(token_ids.shape[0], width)
    for expert in torch.unique(expert_ids).tolist():
        where = (expert_ids == expert).nonzero().squeeze(-1)
        out = hidden[token_ids[where]] @ (weight[expert] if transposed else weight[expert].T)
        if bias is not None:
            out = out + bias[expert]
        projected[where] = out.to(projected.dtype)
    return gated_activation(experts, projected) if gated else experts.act_fn(projected)


def _down_rows(layer: MoELayer, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kept experts' down projections as ``(K, d, m)`` float32 (whatever the storage layout) and biases."""
    weight, bias = _down_projection(layer)
    rows = weight.detach().index_select(0, kept.to(weight.device)).float()
    if transposed(layer):
        rows = rows.transpose(1, 2)
    return rows.contiguous(), None if bias is None else bias.detach().index_select(0, kept.to(bias.device)).float()


def stored_rows(layer: MoELayer, rows: torch.Tensor) -> torch.Tensor:
    """``(K, d, m)`` rows back in the experts' layout and dtype."""
    weight = _down_projection(layer)[0]
    if transposed(layer):
        rows = rows.transpose(1, 2)
    return rows.to(weight.dtype).contiguous()


def expert_segments(experts: torch.Tensor, count: int) -> list[torch.Tensor]:
    """The pair indices of each of ``count`` experts (``experts`` ``(P,)`` their positions), in pair order."""
    order = torch.argsort(experts, stable=True)
    bounds = [0, *torch.bincount(experts, minlength=count).cumsum(0).tolist()]
    return [order[bounds[e]:bounds[e + 1]] for e in range(count)]


def predict(inputs: torch.Tensor, tokens: torch.Tensor, segments: list[torch.Tensor], weights: torch.Tensor,
            num_tokens: int) -> torch.Tensor:
    """``sum_r W_{e_r} u_r`` per token ``(T, d)``: one matmul per expert, no per-pair weights gathered."""
    prediction = inputs.new_zeros(num_tokens, weights.shape[1])
    for e, rows in enumerate(segments):
        if rows.numel():
            prediction.index_add_(0, tokens[rows], inputs[rows] @ weights[e].T)
    return prediction


def gauss_seidel(target: torch.Tensor, inputs: torch.Tensor, tokens: torch.Tensor, segments: list[torch.Tensor],
                 start: torch.Tensor, alphas: Sequence[float], sweeps: int = SWEEPS) -> dict[float, torch.Tensor]:
    """Per ``alpha``, the refit weights ``(K, d, n)`` minimizing ``sum_t ||target_t - sum_r W_{e_r} u_r||^2`` plus
    the ridge toward ``start``: ``inputs`` ``(P, n)`` the pairs' ``u``, ``tokens`` ``(P,)`` their rows of ``target``
    ``(T, d)``, ``segments`` the pairs of each of the ``K`` kept experts (:func:`expert_segments`)."""
    prediction = predict(inputs, tokens, segments, start, target.shape[0])
    systems: list[tuple[torch.Tensor, torch.Tensor | None, float] | None] = []
    for rows in segments:  # per expert once, for every alpha and sweep: A_e and, with more pairs than unknowns,
        if rows.numel() == 0:  # target^T U_e (then a sweep needs one (d, n) product of the pairs, not two)
            systems.append(None)
            continue
        u = inputs[rows]
        gram = u.T @ u
        cross = target[tokens[rows]].T @ u if rows.numel() >= u.shape[1] else None
        scale = float(gram.trace()) / gram.shape[0]
        systems.append((gram, cross, scale) if scale > 0 else None)  # only padding: the expert keeps its start
    fitted = {}
    eye = torch.eye(inputs.shape[1], dtype=torch.float64, device=inputs.device)
    for alpha in alphas:
        weights, current = start.clone(), prediction.clone()
        factors: dict[int, torch.Tensor] = {}
        for _ in range(sweeps):
            for e, rows in enumerate(segments):
                if systems[e] is None:
                    continue
                gram, cross, scale = systems[e]  # type: ignore[misc]
                lam = alpha * scale
                u, where = inputs[rows], tokens[rows]
                # (target - the others)^T U_e: from target^T U_e - current^T U_e + W_e A_e, or directly with few pairs
                if cross is not None:
                    rhs = cross - current[where].T @ u + weights[e] @ gram
                else:
                    rhs = (target[where] - current[where] + u @ weights[e].T).T @ u
                if e not in factors:  # (A_e + lam I)^-1 once per alpha, through a float64 Cholesky factor
                    factors[e] = torch.cholesky_inverse(torch.linalg.cholesky(gram.double() + lam * eye)).to(rhs)
                new = (rhs + lam * start[e]) @ factors[e]  # (d, n); (A + lam I) symmetric
                current.index_add_(0, where, u @ (new - weights[e]).T)
                weights[e] = new
        fitted[float(alpha)] = weights
    return fitted


def _own_outputs(inner: torch.Tensor, positions: torch.Tensor, down: torch.Tensor, bias: torch.Tensor | None
                 ) -> torch.Tensor:
    """``W_e h + b_e`` per pair, one matmul per expert."""
    out = inner.new_empty(inner.shape[0], down.shape[1])
    for e, rows in enumerate(expert_segments(positions, down.shape[0])):
        if rows.numel():
            out[rows] = inner[rows] @ down[e].T + (0 if bias is None else bias[e])
    return out


class _RefitPass(_LayerPass):
    """One MoE layer: the ``linear`` map and the down refit fitted on the spot from the one batch holding every
    fitting token; the unpruned output is returned, so the next layer sees the unpruned model's inputs."""

    def __init__(self, layer: MoELayer, kept: list[int], count_attributes: tuple[str, ...], last: bool,
                 ridge: float | None, alphas: Sequence[float], sweeps: int, num_tokens: float) -> None:
        super().__init__(layer, kept, count_attributes, last, True, None)
        self.ridge, self.alphas, self.sweeps = ridge, tuple(alphas), sweeps
        self.num_tokens = num_tokens
        """The fitting tokens (the ``linear`` map's automatic ridge is ``d / num_tokens``)."""
        self.linear_map: torch.Tensor | None = None
        self.summary: dict[str, Any] = {}
        """What the record keeps of the ``linear`` map's fit (:func:`~.compensation.layer_summary`)."""
        self.refits: dict[float, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.errors: dict[str, float] = {}

    def _forward(self, native: Callable) -> Callable:
        def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
            ids, weights = self._take_routing()
            target, contributions, pruned = routed_and_pruned(self.layer, native, hidden_states, top_k_index,
                                                              top_k_weights, self.original_ids(ids), weights)
            output = target
            ids, fixed, contributions, pruned, measured = self.identity_split(ids, contributions, pruned)
            target = target.float() - fixed  # what the kept experts' down projections can correct
            self._add(ids, contributions, target)
            del contributions
            self._refit(hidden_states, ids, weights, pruned, target, measured)
            if self.last:
                raise _Stop
            return output.to(hidden_states.dtype)

        return forward

    def _refit(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, pruned: torch.Tensor,
               target: torch.Tensor, measured: torch.Tensor | None = None) -> None:
        """``measured``: the pairs that are experts' (the others, identity pairs under a kept id, fit nothing)."""
        layer = self.layer
        tokens, top = ids.shape
        token_of_pair = torch.arange(tokens, device=ids.device).repeat_interleave(top)
        positions = ids.reshape(-1)
        kept = self.kept_on_device.to(ids.device)
        if layer.input_weighted:  # h_e(g' x): the weight is inside it, so the pairs' inputs are not scaled again
            inner = pair_intermediates(layer.experts, hidden, kept[ids], weights).float()
            weights = torch.ones_like(weights)
        else:
            inner = expert_intermediate(layer.experts, hidden, token_of_pair, kept[positions]).float()
        down, bias = _down_rows(layer, self.kept)
        down, bias = down.to(inner.device), None if bias is None else bias.to(inner.device)
        segments = expert_segments(positions, len(self.sums.kept))
        # the experts' own outputs against down(h) on up to CHECKED_PAIRS pairs spread over all (memory: no (P, d))
        sample = torch.linspace(0, inner.shape[0] - 1, min(inner.shape[0], CHECKED_PAIRS), device=inner.device).long()
        if measured is not None:  # experts' pairs only
            weights = weights.masked_fill(~measured, 0)
            rows = measured.reshape(-1).nonzero().squeeze(-1)
            sample = rows[torch.linspace(0, rows.numel() - 1, min(rows.numel(), CHECKED_PAIRS),
                                         device=rows.device).long()] if rows.numel() else rows
        own = _own_outputs(inner[sample], positions[sample], down, bias)
        expected = pruned.reshape(-1, pruned.shape[-1])[sample].float()
        mismatch = float((own - expected).norm() / expected.norm().clamp(min=1e-30))
        if mismatch > match_tolerance(pruned.dtype):
            raise CompensationError(
                f"compensation='down': {layer.name}.experts computes something other than a down projection of the "
                f"intermediate activation its gate and up projections give (relative difference {mismatch:.2e}); "
                "use compensation='linear'.")
        gate = weights.reshape(-1, 1).float()
        if self.token_weight is not None:  # padded tokens fit nothing
            gate = gate * (self.token_weight.to(gate.device) > 0).repeat_interleave(top).unsqueeze(-1).float()
            target = target * (self.token_weight.to(target.device) > 0).unsqueeze(-1).float()
        inputs = inner * gate
        start = down
        if bias is not None:  # [W b] [g'h; g']
            inputs = torch.cat([inputs, gate], dim=1)
            start = torch.cat([down, bias.unsqueeze(-1)], dim=2)
        self.linear_map = _fit_layer(self.sums, "linear", self.ridge, self.num_tokens)
        self.summary = layer_summary(self.sums, self.linear_map)
        self.sums.output_gram = self.sums.output_cross = None  # the d x d sums: only the record needed them
        start = torch.einsum("ij,kjn->kin", self.linear_map.to(start), start)
        fitted = gauss_seidel(target, inputs, token_of_pair, segments, start, self.alphas, self.sweeps)
        for alpha, rows in fitted.items():
            self.refits[alpha] = (stored_rows(layer, rows[..., :down.shape[2]]),
                                  None if bias is None else rows[..., -1].to(_down_projection(layer)[1]))
        energy = float(target.square().sum().clamp(min=1e-30))
        for name, rows in {"linear": start, **{f"down {a:g}": r for a, r in fitted.items()}}.items():
            predicted = predict(inputs, token_of_pair, segments, rows, target.shape[0])
            self.errors[name] = float((target - predicted).square().sum()) / energy


@torch.no_grad()
def refit_down(model: nn.Module, plan: PruningPlan, blocks: torch.Tensor | list[dict[str, torch.Tensor]], *,
               max_tokens: int | None = None, alphas: Sequence[float] = DOWN_ALPHAS, sweeps: int = SWEEPS,
               ridge: float | None = None) -> tuple[Compensation, dict[float, Compensation]]:
    """Fit, on the **unpruned** ``model`` (before ``prune``), the ``linear`` map of ``plan`` and the down refit
    toward it for each of ``alphas``, in one forward of the fitting tokens as one batch (the fewest of ``blocks``
    holding ``max_tokens``, evenly spaced; ``None``: all). Returns the map's compensation and, per ``alpha``, the
    refit's (``Compensation.weights``); each applies as any compensation does."""
    if not alphas or any(not isinstance(a, (int, float)) or isinstance(a, bool) or not a > 0 for a in alphas):
        raise CompensationError(f"alphas must be positive numbers; got {list(alphas)!r}.")
    if isinstance(sweeps, bool) or not isinstance(sweeps, int) or sweeps < 1:
        raise CompensationError(f"sweeps must be a positive int; got {sweeps!r}.")
    layers = check_compensable(model, plan)
    for layer in layers:
        check_down_refit(layer)
    if isinstance(blocks, torch.Tensor) and max_tokens is not None:
        blocks = spread_blocks(blocks, max_tokens)
    device = next(model.parameters()).device
    inputs = [as_model_inputs(batch, device) for batch in ([blocks] if isinstance(blocks, torch.Tensor) else blocks)]
    if not inputs:
        raise CompensationError("Compensation needs at least one batch of calibration tokens.")
    batch = _joined(inputs) if len(inputs) > 1 else inputs[0]
    num_tokens = _count_tokens(torch.zeros((), dtype=torch.float64, device=device), batch)
    spec = architecture_of(model)
    passes = [_RefitPass(layer, sorted(int(i) for i in layer_plan.kept), spec.count_attributes,
                         index == len(layers) - 1, ridge, alphas, sweeps, float(num_tokens))
              for index, (layer, layer_plan) in enumerate(zip(layers, plan.layers))]
    mask = batch.get("attention_mask")
    for each in passes:
        each.token_weight = None if mask is None else mask.reshape(-1)
    with eval_mode(model), adaptive_paused(model), ExitStack() as stack:
        for each in passes:
            stack.enter_context(each.attached())
        check_calibration_inputs(model, batch)
        with suppress(_Stop):
            model(**batch, use_cache=False)
    return refit_compensations(passes, float(num_tokens), ridge, alphas, sweeps)


def refit_compensations(passes: Sequence[_RefitPass], num_tokens: float, ridge: float | None,
                        alphas: Sequence[float], sweeps: int) -> tuple[Compensation, dict[float, Compensation]]:
    """The ``linear`` map's compensation and each ``alpha``'s refit from the fitted layer passes (in model order)."""
    maps = {each.layer.name: each.linear_map for each in passes}
    kept = {each.layer.name: list(each.sums.kept) for each in passes}
    summaries = {each.layer.name: each.summary for each in passes}
    linear = Compensation(maps, kept, record_of_summaries(summaries, num_tokens, "linear", ridge))
    refits = {}
    for alpha in alphas:
        refits[float(alpha)] = Compensation(maps, kept, refit_record(linear.record, alpha, sweeps, [
            each.errors[f"down {alpha:g}"] for each in passes]), weights={p.layer.name: p.refits[float(alpha)]
                                                                       for p in passes})
    return linear, refits


def refit_record(linear: dict[str, Any], alpha: float, sweeps: int, errors: Sequence[float]) -> dict[str, Any]:
    """The refit's record: the ``linear`` map's (which it starts from) with its ``alpha``, sweeps and the layers'
    routed-output error after it (mean)."""
    return dict(linear, granularity="down", ridge_alpha=float(alpha), sweeps=sweeps,
                routed_error_linear=linear["routed_error_after"], routed_error_after=sum(errors) / len(errors))


def _joined(inputs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The batches as one: concatenated, or, where their lengths differ, right-padded to the longest with the padding
    masked (a causal model computes the real tokens exactly as unpadded; padded ones fit nothing)."""
    lengths = {int(batch["input_ids"].shape[1]) for batch in inputs if "input_ids" in batch}
    if len(lengths) <= 1 or any(set(batch) - {"input_ids", "attention_mask"} for batch in inputs):
        return _concatenated(inputs)
    width = max(lengths)
    padded = []
    for batch in inputs:
        ids = batch["input_ids"]
        mask = batch.get("attention_mask", torch.ones_like(ids))
        extra = width - ids.shape[1]
        padded.append({"input_ids": torch.nn.functional.pad(ids, (0, extra)),
                       "attention_mask": torch.nn.functional.pad(mask, (0, extra))})
    return _concatenated(padded)


def compensate_down(model: nn.Module, plan: PruningPlan, blocks: torch.Tensor | list[dict[str, torch.Tensor]], *,
                    alpha: float = DEFAULT_ALPHA, max_tokens: int | str | None = "auto", sweeps: int = SWEEPS,
                    ridge: float | None = None) -> Compensation:
    """:func:`~.compensation.compensate` for ``granularity="down"``: the refit at ``alpha`` on the **unpruned**
    ``model``, applied after ``prune`` (``compensation.apply(model)``); ``max_tokens``: ``"auto"`` every token of
    ``blocks`` up to :data:`MAX_TOKENS`, ``None`` all."""
    if max_tokens == "auto":
        tokens = int(blocks.numel()) if isinstance(blocks, torch.Tensor) else sum(
            int(batch["input_ids"].numel()) for batch in blocks)
        max_tokens = down_fitting_tokens(model, tokens)
    return refit_down(model, plan, blocks, max_tokens=max_tokens, alphas=(alpha,), sweeps=sweeps, ridge=ridge
                      )[1][float(alpha)]


__all__ = ["DEFAULT_ALPHA", "DOWN_ALPHAS", "MAX_TOKENS", "SWEEPS", "check_down_refit", "compensate_down",
           "down_fitting_tokens", "match_tolerance",
           "expert_intermediate", "expert_segments", "gauss_seidel", "predict", "refit_down"]
