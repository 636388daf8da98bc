"""OMP-MoE+ (the paper's OMP-MoE dagger): energy-based adaptive expert skipping at inference.

Hooks on each fused ``experts`` module evaluate the rule per call and skip the dropped (token, expert) pairs by one of
two paths: ``masked`` (``grouped_mm`` experts; static shapes, no host read, CUDA-graph friendly) or ``compact`` (any
experts implementation; one host read per call). The settings live in ``config.ompmoe_adaptive``, so
``save_pretrained`` keeps them. The paths, ``path="auto"`` and measurements: docs/adaptive.md.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..adapters import ARCHITECTURES, RECOGNIZED, MoELayer, experts_count, find_moe_layers
from ..collect import replay as _replay
from ..collect.collector import pause_during_calibration
from ..collect.statistics import MoEStats
from ..identity_experts import first_identity, identity_slot
from ..input_weighted import enter_routed_form, leave_routed_form
from ..record import ADAPTIVE_KEY, EARLIER_KEY, last_pruning_kept, pruning_info

CONFIG_KEY = ADAPTIVE_KEY
"""Config attribute holding ``{"epsilon", "zeta", "alphas": {layer name: [alpha_e, ...]}}``."""
ZETA = 1e-6
STATE_ATTR = "_ompmoe_adaptive"


@torch.no_grad()
def adaptive_keep_mask(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, alphas: torch.Tensor, epsilon: float,
                       zeta: float = ZETA) -> torch.Tensor:
    """Which of each token's top-k slots OMP-MoE+ keeps (a ``(tokens, K)`` bool mask), given one energy coefficient
    per expert in ``alphas``; computed in float64 (float32 on devices without it)."""
    device = top_k_weights.device
    dtype = torch.float32 if device.type == "mps" else torch.float64
    num_tokens, top_k = top_k_index.shape
    if num_tokens == 0 or top_k == 0:
        return torch.ones(num_tokens, top_k, dtype=torch.bool, device=device)
    weights = top_k_weights.detach().to(dtype)
    energy = weights * weights * alphas.to(device=device, dtype=dtype)[top_k_index]
    order = torch.sort(energy, dim=1, descending=True, stable=True).indices
    prefix = energy.gather(1, order).cumsum(dim=1)
    enough = (1.0 - prefix / (prefix[:, -1:] + zeta)) <= epsilon
    enough[:, -1] = True  # no qualifying prefix: keep all K
    kept_count = enough.to(torch.int8).argmax(dim=1) + 1  # first qualifying prefix length
    keep_sorted = torch.arange(top_k, device=device) < kept_count.unsqueeze(1)
    return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)


MASKED = "masked"
COMPACT = "compact"
AUTO_PATH = "auto"
PATHS = (AUTO_PATH, MASKED, COMPACT)


@dataclass
class _AdaptiveState:
    """Attached to one ``experts`` module (as ``_ompmoe_adaptive``) while adaptive inference is on."""

    name: str
    alphas: torch.Tensor  # float64, CPU, one per expert
    epsilon: float
    zeta: float
    top_k: int
    path: str = AUTO_PATH  # as asked: AUTO_PATH, MASKED or COMPACT (see the module docstring)
    masked_ok: bool = False  # grouped_mm experts whose computation masked_grouped_mm mirrors
    histogram: torch.Tensor | None = None  # (K + 1,) int64 on the layer's device: tokens per kept count
    handles: list[Any] = field(default_factory=list)
    pending: tuple[torch.Tensor, int, torch.dtype] | None = None  # compact path: hook -> post-hook
    keep: torch.Tensor | None = None  # masked path: pre-hook -> masked forward
    forward: Any = None  # masked path: the bound forward installed on the experts module
    routed_form: bool = False  # it holds its block's routed form (Llama 4's), left when switched off
    identity_experts: int = 0  # LongCat-Flash's: always run (they cost nothing), outside the energy rule
    _device_alphas: torch.Tensor | None = None

    def alphas_on(self, device: torch.device) -> torch.Tensor:
        """The alphas on ``device``, with a zero per identity expert (their pairs weigh nothing in the rule)."""
        if self._device_alphas is None or self._device_alphas.device != device:
            dtype = torch.float32 if device.type == "mps" else torch.float64
            alphas = torch.cat([self.alphas, self.alphas.new_zeros(self.identity_experts)])
            self._device_alphas = alphas.to(device=device, dtype=dtype)
        return self._device_alphas

    def record(self, kept_per_token: torch.Tensor, index: torch.Tensor | None = None) -> None:
        """Add one call's kept counts to the histogram on the layer's device, in place (no host read, so also inside
        a captured CUDA graph); the host reads it only when a report asks. With identity experts (``index``: the
        call's routing), the histogram counts the routed experts' pairs only and one slot more holds the identity
        pairs the routing had, which cost nothing (:func:`layer_counts`)."""
        device = kept_per_token.device
        if self.histogram is None or self.histogram.device != device:
            previous = self.histogram
            self.histogram = torch.zeros(self.slots(), dtype=torch.long, device=device)
            if previous is not None:
                self.histogram += previous.to(device)
        # scatter_add_ rather than bincount, which reads the maximum back to the host (a GPU sync).
        self.histogram.scatter_add_(0, kept_per_token.long(), torch.ones_like(kept_per_token, dtype=torch.long))
        if self.identity_experts and index is not None:
            self.histogram[-1:] += (index >= self.alphas.numel()).sum()

    def slots(self) -> int:
        """The histogram's length: tokens per kept count ``0..K``, and the identity pairs' count where there are."""
        return self.top_k + 1 + (1 if self.identity_experts else 0)

    def path_on(self, device: torch.device) -> str:
        if not self.masked_ok or self.path == COMPACT:
            return COMPACT
        return MASKED if self.path == MASKED or device.type != "cpu" else COMPACT

    def counts(self) -> torch.Tensor:
        """The kept-experts histogram since the last reset (``histogram = None``; zeros before the first call)."""
        return self.histogram.clone() if self.histogram is not None else torch.zeros(self.slots(), dtype=torch.long)


def _split_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Per position, the names the registered architectures give the experts' forward arguments.
    specs = [*ARCHITECTURES.values(), *RECOGNIZED.values()]
    positions = [tuple(dict.fromkeys(spec.experts_arguments[position] for spec in specs))
                 for position in range(3)]
    values = list(args[:3])
    for names in positions[len(values):]:
        name = next((name for name in names if name in kwargs), None)
        if name is None:
            raise TypeError(f"ompmoe adaptive inference: experts module called without {names[0]!r}.")
        values.append(kwargs[name])
    if len(args) > 3 or not {name for names in positions for name in names}.issuperset(kwargs):
        raise TypeError("ompmoe adaptive inference: unexpected extra arguments to the experts module.")
    return values[0], values[1], values[2]


def masked_path_supported(experts: nn.Module) -> bool:
    """Whether ``experts`` runs transformers' ``grouped_mm`` computation that :func:`masked_grouped_mm` mirrors (no
    expert parallelism, the transformers helpers importable); other modules use the compact path."""
    return _replay.replayable(experts) is not None


def masked_grouped_mm(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The ``grouped_mm`` experts output with only the ``keep`` slots (a ``(tokens, K)`` bool mask) contributing.

    Mirrors ``transformers.integrations.moe.grouped_mm_experts_forward`` step by step, except that skipped slots get
    the expert id ``num_experts``: the sort puts them after every real group, ``histc`` leaves them out of the group
    sizes, so the grouped GEMMs never compute their rows, and those rows (left uninitialized by the kernel) are zeroed
    before the per-token sum. Every shape is static and nothing is read back to the host. With nothing skipped it is
    the native computation, op for op.
    """
    num_tokens, num_top_k = top_k_index.shape
    expert_ids = top_k_index.reshape(-1).masked_fill(~keep.reshape(-1), experts.num_experts)
    projected, expert_ids_g, perm, inverse = _replay.sorted_expert_outputs(experts, hidden_states, expert_ids,
                                                                           num_top_k)
    weighted = projected * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    del projected
    skipped_g = (expert_ids_g == experts.num_experts).unsqueeze(-1)
    weighted.masked_fill_(skipped_g, 0.0)  # the skipped rows hold whatever the kernel left there (NaN included)
    weighted = weighted[inverse]
    return weighted.view(num_tokens, num_top_k, hidden_states.size(-1)).sum(dim=1).to(hidden_states.dtype)


def _masked_forward(self: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Installed as the ``forward`` of a ``grouped_mm`` experts module: the masked computation when the pre-hook left
    a keep mask, else the module's own forward (hooks paused, ``epsilon = 0``, or nothing to skip)."""
    state: _AdaptiveState | None = getattr(self, STATE_ATTR, None)
    keep = None if state is None else state.keep
    if keep is None:
        return type(self).forward(self, *args, **kwargs)
    state.keep = None
    hidden, index, weights = _split_args(args, kwargs)
    return masked_grouped_mm(self, hidden, index, weights, keep)


def _install_masked_forward(module: nn.Module, state: _AdaptiveState) -> bool:
    """Put the masked forward on ``module`` unless something else already replaced its forward; whether it is there."""
    current = module.__dict__.get("forward")
    if current is None:
        state.forward = types.MethodType(_masked_forward, module)
        module.forward = state.forward
        return True
    return current is state.forward


def _pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    state: _AdaptiveState = getattr(module, STATE_ATTR)
    state.pending = None
    state.keep = None
    hidden, index, weights = _split_args(args, kwargs)
    count = experts_count(module)
    if state.alphas.numel() != count:
        raise RuntimeError(f"ompmoe adaptive inference: layer {state.name} has {count} experts but its "
                           f"alphas have {state.alphas.numel()} (was the model pruned after enable_adaptive?). Call "
                           "ompmoe.enable_adaptive(model, stats) again.")
    if state.epsilon == 0.0:  # no prefix can qualify: every token keeps all K, the native call
        state.record((index < count).sum(dim=1) if state.identity_experts else torch.full(
            (index.shape[0],), index.shape[1], dtype=torch.long, device=index.device), index)
        return None
    keep = adaptive_keep_mask(index, weights, state.alphas_on(index.device), state.epsilon, state.zeta)
    if state.identity_experts:  # the rule over the experts' pairs; identity pairs always run, counted apart
        identity = index >= count
        state.record((keep & ~identity).sum(dim=1), index)
        keep = keep | identity
    else:
        state.record(keep.sum(dim=1))
    if state.path_on(index.device) == MASKED:
        if state.forward is not None and module.__dict__.get("forward") is state.forward:
            state.keep = keep  # the masked forward runs this call: no host read
            return None
        # Someone replaced the forward (an instrumenting context, or it was deleted): this call takes the compact
        # path; the masked forward comes back for the next call if nothing else holds the slot.
        _install_masked_forward(module, state)
    pairs = keep.reshape(-1).nonzero().squeeze(1)  # token-major, slots ascending; the one host sync
    if pairs.numel() == keep.numel():
        return None  # nothing skipped: the native call, bit for bit
    token_ids = torch.div(pairs, index.shape[1], rounding_mode="floor")
    state.pending = (token_ids, hidden.shape[0], hidden.dtype)
    compact = (
        hidden.index_select(0, token_ids),  # index_select: several times faster than hidden[token_ids] on CPU
        *identity_slot(index.reshape(-1).index_select(0, pairs).unsqueeze(1),
                       weights.reshape(-1).index_select(0, pairs).unsqueeze(1),
                       first_identity(state.alphas.numel(), state.identity_experts)),
    )
    return compact, {}


def _post_hook(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor | None:
    state: _AdaptiveState = getattr(module, STATE_ATTR)
    state.keep = None  # unused if the forward was not the masked one
    if state.pending is None:
        return None
    token_ids, num_tokens, dtype = state.pending
    state.pending = None
    # Kept contributions summed in slot order (float32 for half precision): may differ in the last bits.
    accumulate = torch.float32 if output.dtype in (torch.float16, torch.bfloat16) else output.dtype
    summed = torch.zeros(num_tokens, output.shape[-1], dtype=accumulate, device=output.device)
    summed.index_add_(0, token_ids, output.to(accumulate))
    return summed.to(dtype)


def _set_hooks(module: nn.Module, state: _AdaptiveState, on: bool) -> None:
    for handle in state.handles:
        handle.remove()
    state.handles = [module.register_forward_pre_hook(_pre_hook, with_kwargs=True),
                     module.register_forward_hook(_post_hook, with_kwargs=True)] if on else []


def resolve_alphas(model: nn.Module, stats_or_alphas: Any,
                   layers: Sequence[MoELayer] | None = None) -> dict[str, torch.Tensor]:
    """Per-layer alphas for ``model``'s current experts (float64, CPU), matched by layer name: as given when they
    have one per current expert, else (statistics of the unpruned model) indexed with the kept ids in ``config.ompmoe``.
    """
    layers = list(layers) if layers is not None else find_moe_layers(model)
    counts: dict[str, torch.Tensor] = {}
    if isinstance(stats_or_alphas, MoEStats):
        if stats_or_alphas.model_type not in (None, model.config.model_type):
            raise ValueError(f"These statistics are of a {stats_or_alphas.model_type!r} model; this model is "
                             f"{model.config.model_type!r}.")
        source = {layer.name: layer.alpha for layer in stats_or_alphas.layers}
        counts = {layer.name: layer.token_count for layer in stats_or_alphas.layers}
    elif isinstance(stats_or_alphas, Mapping):
        source = {str(name): torch.as_tensor(value, dtype=torch.float64) for name, value in stats_or_alphas.items()}
    else:
        raise TypeError("enable_adaptive needs ompmoe.MoEStats or a dict {layer name: alphas}; got "
                        f"{type(stats_or_alphas).__name__}.")
    unknown = sorted(set(source) - {layer.name for layer in layers})
    if unknown:
        raise ValueError(f"Alphas given for layers this model does not have: {unknown}.")
    record = pruning_info(model) or {}
    kept = record.get("kept_experts", {})
    original = record.get("original_num_experts", {})
    # a re-pruned model: statistics of the model its last pruning cut, numbered as that model numbers its experts
    before = (record.get(EARLIER_KEY) or [{}])[-1].get("kept_experts") or {}
    last = last_pruning_kept(record) or {}
    resolved: dict[str, torch.Tensor] = {}
    unseen: dict[str, list[int]] = {}
    for layer in layers:
        if layer.name not in source:
            raise KeyError(f"No alphas for MoE layer {layer.name!r}; got layers {sorted(source)}.")
        alphas = source[layer.name].detach().reshape(-1).to("cpu", torch.float64)
        ids = torch.arange(alphas.numel())  # ids in the statistics of this layer's current experts
        if alphas.numel() != layer.num_experts:
            if layer.name in kept and alphas.numel() == original.get(layer.name):
                ids = torch.tensor(kept[layer.name], dtype=torch.long)
            elif layer.name in last and alphas.numel() == len(before.get(layer.name, ())):
                ids = torch.tensor(last[layer.name], dtype=torch.long)
            else:
                pruned = f" (pruned from {original[layer.name]})" if layer.name in original else ""
                raise ValueError(f"Layer {layer.name} has {layer.num_experts} experts{pruned} but {alphas.numel()} "
                                 "alphas were given: use statistics collected on this model, or on a model it was "
                                 "pruned from.")
            alphas = alphas[ids]
        if not bool(torch.isfinite(alphas).all()) or bool((alphas < 0).any()):
            raise ValueError(f"Alphas of layer {layer.name} must be finite and non-negative.")
        resolved[layer.name] = alphas.clone()
        if layer.name in counts:  # only experts this model still has: pruned-away ones are not news
            never = (counts[layer.name].reshape(-1)[ids] == 0).nonzero().reshape(-1)
            if never.numel():
                unseen[layer.name] = [int(i) for i in never]
    if unseen:
        warnings.warn("ompmoe adaptive inference: some experts of this model were never routed during calibration, "
                      "so their alpha is 0 and OMP-MoE+ skips them whenever other experts cover 1 - epsilon (current "
                      f"expert ids per layer): {unseen}. Calibrate on more tokens to avoid this.", stacklevel=3)
    return resolved


def enable_adaptive(model: nn.Module, stats_or_alphas: MoEStats | Mapping[str, Any], epsilon: float = 0.1, *,
                    zeta: float = ZETA, path: str = AUTO_PATH) -> nn.Module:
    """Switch on OMP-MoE+ in every MoE layer of ``model`` (in place; again: new settings, counters reset), with alphas
    from :class:`ompmoe.MoEStats` or a dict ``{layer name: alphas}`` (:func:`resolve_alphas`); ``epsilon`` in
    ``[0, 1]`` is the relative energy a token may drop (0 keeps every expert), ``zeta`` the rule's stabiliser.
    ``path`` picks how skipped pairs are skipped: ``auto`` (``masked`` for ``grouped_mm`` experts on an accelerator,
    ``compact`` on CPU, per call), ``masked`` (wherever the experts are ``grouped_mm``: :func:`masked_path_supported`)
    or ``compact``; all compute the same rule and the same output up to rounding."""
    epsilon = float(epsilon)
    if not 0.0 <= epsilon <= 1.0:  # NaN too
        raise ValueError(f"epsilon must lie in [0, 1]; got {epsilon}.")
    if not zeta > 0:
        raise ValueError(f"zeta must be positive; got {zeta}.")
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}; got {path!r}.")
    layers = find_moe_layers(model)
    alphas = resolve_alphas(model, stats_or_alphas, layers)
    disable_adaptive(model)
    for layer in layers:
        state = _AdaptiveState(layer.name, alphas[layer.name], epsilon, float(zeta), layer.top_k, path=path,
                               masked_ok=masked_path_supported(layer.experts), identity_experts=layer.identity_experts)
        state.routed_form = enter_routed_form(layer)  # Llama 4's experts see ids and weights only in that form
        setattr(layer.experts, STATE_ATTR, state)
        weight = next(layer.experts.parameters(), None)
        if weight is not None:  # now, so that no call copies them to the device (a host sync on a GPU)
            state.alphas_on(weight.device)
        if state.masked_ok and path != COMPACT and not _install_masked_forward(layer.experts, state):
            state.masked_ok = False  # its forward is already replaced by something else: compact
        _set_hooks(layer.experts, state, on=True)
    alpha_lists = {name: [float(alpha) for alpha in values] for name, values in alphas.items()}
    setattr(model.config, CONFIG_KEY, {"epsilon": epsilon, "zeta": float(zeta), "alphas": alpha_lists})
    return model


def _states(model: nn.Module) -> dict[nn.Module, _AdaptiveState]:
    return {module: state for module in model.modules()
            if isinstance(state := getattr(module, STATE_ATTR, None), _AdaptiveState)}


def disable_adaptive(model: nn.Module) -> nn.Module:
    """Remove adaptive inference (hooks, counters and ``config.ompmoe_adaptive``); plain model again."""
    layers = {layer.experts: layer for layer in find_moe_layers(model)} if _states(model) else {}
    for module, state in _states(model).items():
        _set_hooks(module, state, on=False)
        if state.forward is not None and module.__dict__.get("forward") is state.forward:
            del module.forward  # the class forward (and its implementation dispatch) is back
        if state.routed_form and module in layers:
            leave_routed_form(layers[module])
        delattr(module, STATE_ATTR)
    if hasattr(getattr(model, "config", None), CONFIG_KEY):
        delattr(model.config, CONFIG_KEY)
    return model


@contextmanager
def adaptive_paused(model: nn.Module) -> Iterator[bool]:
    """Detach OMP-MoE+ adaptive hooks meanwhile (statistics need the full top-k); yields whether any were on."""
    paused = _states(model)
    for module, state in paused.items():
        _set_hooks(module, state, on=False)
    try:
        yield bool(paused)
    finally:
        for module, state in paused.items():
            if getattr(module, STATE_ATTR, None) is state:  # not switched off (disable_adaptive) meanwhile
                _set_hooks(module, state, on=True)


def is_adaptive(model: nn.Module) -> bool:
    """Whether adaptive inference is switched on in ``model``."""
    return bool(_states(model))


def adaptive_info(model_or_config: Any) -> dict[str, Any] | None:
    """The saved ``ompmoe_adaptive`` record of a model or config, or ``None``."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, CONFIG_KEY, None)


def restore_adaptive(model: nn.Module) -> bool:
    """Re-apply the adaptive settings saved in ``model.config`` after ``from_pretrained`` (``load_pruned`` does);
    whether a record was found."""
    record = adaptive_info(model)
    if not record:
        return False
    enable_adaptive(model, record["alphas"], record["epsilon"], zeta=record.get("zeta", ZETA))
    return True


def adaptive_report(model: nn.Module, reset: bool = False) -> dict[str, dict[str, Any]]:
    """Counters since the last reset per MoE layer: ``tokens``, ``top_k``, ``kept_pairs`` (expert executions),
    ``native_pairs`` (``tokens * top_k``, less identity experts' pairs), ``avg_experts_per_token``, ``skip_ratio`` (of
    the native ones), ``flops_ratio`` (kept over native),
    ``histogram`` (tokens that kept ``m = 0..K`` experts) and ``epsilon``."""
    report = {state.name: layer_counts(state.counts(), state.top_k, epsilon=state.epsilon)
              for state in _states(model).values()}
    if reset:
        reset_adaptive_counters(model)
    return report


def _ratios(tokens: int, kept: int, total: int) -> dict[str, float]:
    return {
        "avg_experts_per_token": kept / tokens if tokens else float("nan"),
        "skip_ratio": 1.0 - kept / total if total else float("nan"),
        "flops_ratio": kept / total if total else float("nan"),
    }


def layer_counts(histogram: torch.Tensor, top_k: int, epsilon: float | None = None) -> dict[str, Any]:
    """Counters of one layer from its kept-experts histogram (also after summing ranks). A histogram one slot longer
    (a layer with identity experts) counts the routed experts' pairs only, and its last slot the identity pairs of
    the routing: those are neither native expert executions nor kept ones (``native_pairs``)."""
    histogram = histogram.reshape(-1).to(torch.long).cpu()
    identity = int(histogram[top_k + 1:].sum())
    histogram = histogram[:top_k + 1]
    tokens = int(histogram.sum())
    kept = int((histogram * torch.arange(histogram.numel())).sum())
    native = tokens * top_k - identity
    return {"tokens": tokens, "top_k": top_k, "kept_pairs": kept, "native_pairs": native,
            **_ratios(tokens, kept, native), "histogram": histogram.tolist(), "epsilon": epsilon}


def adaptive_totals(report: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """All layers together: ``avg_experts_per_token`` (per token and layer), ``skip_ratio``, ``flops_ratio``."""
    tokens = sum(entry["tokens"] for entry in report.values())
    kept = sum(entry["kept_pairs"] for entry in report.values())
    total = sum(entry.get("native_pairs", entry["tokens"] * entry["top_k"]) for entry in report.values())
    return {"tokens": float(tokens), **_ratios(tokens, kept, total)}


def adaptive_summary(model_or_report: nn.Module | Mapping[str, Mapping[str, Any]]) -> str:
    """One model-wide line from a model's counters (or an :func:`adaptive_report`), e.g. ``adaptive (epsilon 0.1):
    2.91 of 4 experts per token and layer, skip ratio 0.272, routed-expert FLOPs ratio 0.728, over 2048 tokens in 6
    MoE layers``."""
    report = adaptive_report(model_or_report) if isinstance(model_or_report, nn.Module) else model_or_report
    if not report:
        return "adaptive inference is off (no MoE layer has it enabled)"
    totals = adaptive_totals(report)
    top_ks = sorted({entry["top_k"] for entry in report.values()})
    epsilons = sorted({entry["epsilon"] for entry in report.values()}, key=str)
    tokens = max(entry["tokens"] for entry in report.values())
    return (
        f"adaptive (epsilon {', '.join(f'{e:g}' for e in epsilons if e is not None) or '?'}): "
        f"{totals['avg_experts_per_token']:.2f} of {'/'.join(str(k) for k in top_ks)} experts per token and layer, "
        f"skip ratio {totals['skip_ratio']:.3f}, routed-expert FLOPs ratio {totals['flops_ratio']:.3f}, "
        f"over {tokens} tokens in {len(report)} MoE layers"
    )


def reset_adaptive_counters(model: nn.Module) -> None:
    """Zero every layer's counters."""
    for state in _states(model).values():
        state.histogram = None


def adaptive_paths(model: nn.Module) -> dict[str, str]:
    """Per MoE layer, the skipping path its calls take where its experts' weights now are (``masked`` or
    ``compact``)."""
    return {state.name: state.path_on(next((p.device for p in module.parameters()), torch.device("cpu")))
            for module, state in _states(model).items()}


def adaptive_histograms(model: nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    """Raw per-layer ``(histogram, top_k)``, for summing over distributed ranks before reporting."""
    return {state.name: (state.counts(), state.top_k) for state in _states(model).values()}


__all__ = [
    "CONFIG_KEY", "ZETA", "adaptive_histograms", "adaptive_info", "adaptive_keep_mask", "adaptive_paths",
    "adaptive_report", "adaptive_summary", "adaptive_totals", "disable_adaptive", "enable_adaptive",
    "is_adaptive", "layer_counts", "masked_grouped_mm", "masked_path_supported", "reset_adaptive_counters",
    "resolve_alphas", "restore_adaptive",
]


ADAPTIVE_WARNING = ("Adaptive inference (OMP-MoE+) is on: it is switched off while statistics are collected, so "
                    "they cover the full top-k routing, and switched back on afterwards.")
pause_during_calibration(adaptive_paused, ADAPTIVE_WARNING)
