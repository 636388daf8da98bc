"""OMP-MoE+ (the paper's OMP-MoE dagger): energy-based adaptive expert skipping at inference.

For every MoE layer and token, the native top-``K`` experts ``e_1..e_K`` with router weights
``g_1..g_K`` get a predicted contribution energy ``E_j = g_j^2 * alpha_{e_j}``, where
``alpha_e = E||F_e(x)||^2`` comes from the calibration statistics. Sorted by ``E`` (descending,
ties in slot order), the token keeps the shortest prefix ``m`` with
``1 - S_m / (S_K + zeta) <= epsilon`` (``S_m`` the prefix sums, ``zeta = 1e-6``) and treats the
other experts' contributions as zero, without renormalising the kept weights. When no prefix
qualifies (``epsilon = 0``, or a total energy ``S_K`` below ``zeta (1 - epsilon) / epsilon``) the
token keeps all ``K``. The router itself is untouched.

Skipped experts are never computed. A forward pre-hook on each fused ``experts`` module compacts
the kept (token, expert) pairs into a flattened ``(pairs, 1)`` routing, so the model's own
experts implementation (``eager``, ``grouped_mm``, ``batched_mm``, GPT-OSS's clamped biased
experts, ...) runs only the kept pairs with their native weights; a forward hook scatter-adds
the pair outputs back per token. No "empty slot" index is used. When a call skips nothing (always
the case at ``epsilon = 0``), the experts module gets its original arguments, so the output is
bit-identical to the plain model's. With skips, the per-token sum of the kept contributions runs
in slot order (in float32 for half-precision models), which may differ from the native summation
order in the last bits.

Counters per layer (tokens seen, kept pairs, histogram of kept experts per token) count every
token the layer sees, padding included. Epsilon and the alphas live in ``config.ompmoe_adaptive``
so ``save_pretrained`` keeps them and :func:`ompmoe.load_pruned` re-applies them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .adapters import ARCHITECTURES, MoELayer, find_moe_layers
from .record import pruning_info
from .statistics import MoEStats

CONFIG_KEY = "ompmoe_adaptive"
"""Config attribute holding ``{"epsilon", "zeta", "alphas": {layer name: [alpha_e, ...]}}``."""
ZETA = 1e-6
STATE_ATTR = "_ompmoe_adaptive"



def _argument_names() -> tuple[tuple[str, ...], ...]:
    """Per position, the names the registered architectures give the experts' forward arguments."""
    return tuple(
        tuple(dict.fromkeys(spec.experts_arguments[position] for spec in ARCHITECTURES.values()))
        for position in range(3)
    )


# --------------------------------------------------------------------------------------- the rule
@torch.no_grad()
def adaptive_keep_mask(
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    alphas: torch.Tensor,
    epsilon: float,
    zeta: float = ZETA,
) -> torch.Tensor:
    """Which of each token's top-k slots OMP-MoE+ keeps: a ``(tokens, K)`` bool mask.

    ``alphas`` holds one energy coefficient per expert of the layer. Energies and prefix sums are
    computed in float64 (float32 on devices without float64).
    """
    device = top_k_weights.device
    dtype = torch.float32 if device.type == "mps" else torch.float64
    num_tokens, top_k = top_k_index.shape
    if num_tokens == 0 or top_k == 0:
        return torch.ones(num_tokens, top_k, dtype=torch.bool, device=device)
    g = top_k_weights.detach().to(dtype)
    energy = g * g * alphas.to(device=device, dtype=dtype)[top_k_index]
    order = torch.sort(energy, dim=1, descending=True, stable=True).indices
    prefix = energy.gather(1, order).cumsum(dim=1)
    enough = (1.0 - prefix / (prefix[:, -1:] + zeta)) <= epsilon
    enough[:, -1] = True  # no qualifying prefix: keep all K
    kept_count = enough.to(torch.int8).argmax(dim=1) + 1  # first qualifying prefix length
    keep_sorted = torch.arange(top_k, device=device) < kept_count.unsqueeze(1)
    return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)


# ------------------------------------------------------------------------------- per-layer state
@dataclass
class _AdaptiveState:
    """Attached to one ``experts`` module (as ``_ompmoe_adaptive``) while adaptive inference is on."""

    name: str
    alphas: torch.Tensor  # float64, CPU, one per expert
    epsilon: float
    zeta: float
    top_k: int
    histogram: torch.Tensor | None = None  # (K + 1,) int64 on the layer's device: tokens per kept count
    handles: list[Any] = field(default_factory=list)
    pending: tuple[torch.Tensor, int, torch.dtype] | None = None
    _device_alphas: torch.Tensor | None = None

    def alphas_on(self, device: torch.device) -> torch.Tensor:
        if self._device_alphas is None or self._device_alphas.device != device:
            dtype = torch.float32 if device.type == "mps" else torch.float64
            self._device_alphas = self.alphas.to(device=device, dtype=dtype)
        return self._device_alphas

    def record(self, kept_per_token: torch.Tensor) -> None:
        # scatter_add_ rather than bincount, which reads the maximum back to the host (a GPU sync).
        counts = torch.zeros(self.top_k + 1, dtype=torch.long, device=kept_per_token.device)
        counts.scatter_add_(0, kept_per_token.long(), torch.ones_like(kept_per_token, dtype=torch.long))
        if self.histogram is None:
            self.histogram = counts
        else:
            self.histogram = self.histogram.to(counts.device) + counts

    def reset(self) -> None:
        self.histogram = None


def _split_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    values = list(args[:3])
    argument_names = _argument_names()
    for names in argument_names[len(values) :]:
        for name in names:
            if name in kwargs:
                values.append(kwargs[name])
                break
        else:
            raise TypeError(f"ompmoe adaptive inference: experts module called without {names[0]!r}.")
    if len(args) > 3 or any(key not in {n for names in argument_names for n in names} for key in kwargs):
        raise TypeError("ompmoe adaptive inference: unexpected extra arguments to the experts module.")
    return values[0], values[1], values[2]


def _pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    state: _AdaptiveState = getattr(module, STATE_ATTR)
    state.pending = None
    hidden, index, weights = _split_args(args, kwargs)
    if state.alphas.numel() != module.num_experts:
        raise RuntimeError(
            f"ompmoe adaptive inference: layer {state.name} has {module.num_experts} experts but its alphas "
            f"have {state.alphas.numel()} (was the model pruned after enable_adaptive?). Call "
            "ompmoe.enable_adaptive(model, stats) again."
        )
    if state.epsilon == 0.0:  # no prefix can qualify: every token keeps all K, the native call
        state.record(torch.full((index.shape[0],), index.shape[1], dtype=torch.long, device=index.device))
        return None
    keep = adaptive_keep_mask(index, weights, state.alphas_on(index.device), state.epsilon, state.zeta)
    state.record(keep.sum(dim=1))
    pairs = keep.reshape(-1).nonzero().squeeze(1)  # token-major, slots ascending; the one host sync
    if pairs.numel() == keep.numel():
        return None  # nothing skipped: the native call, bit for bit
    token_ids = torch.div(pairs, index.shape[1], rounding_mode="floor")
    state.pending = (token_ids, hidden.shape[0], hidden.dtype)
    compact = (
        hidden.index_select(0, token_ids),  # index_select: several times faster than hidden[token_ids] on CPU
        index.reshape(-1).index_select(0, pairs).unsqueeze(1),
        weights.reshape(-1).index_select(0, pairs).unsqueeze(1),
    )
    return compact, {}


def _post_hook(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor | None:
    state: _AdaptiveState = getattr(module, STATE_ATTR)
    if state.pending is None:
        return None
    token_ids, num_tokens, dtype = state.pending
    state.pending = None
    accumulate = torch.float32 if output.dtype in (torch.float16, torch.bfloat16) else output.dtype
    summed = torch.zeros(num_tokens, output.shape[-1], dtype=accumulate, device=output.device)
    summed.index_add_(0, token_ids, output.to(accumulate))
    return summed.to(dtype)


# --------------------------------------------------------------------------------------- alphas
def _as_alpha_source(stats_or_alphas: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(stats_or_alphas, MoEStats):
        if stats_or_alphas.model_type not in (None, model.config.model_type):
            raise ValueError(
                f"These statistics are of a {stats_or_alphas.model_type!r} model; this model is "
                f"{model.config.model_type!r}."
            )
        return {layer.name: layer.alpha for layer in stats_or_alphas.layers}
    if isinstance(stats_or_alphas, Mapping):
        return {str(name): torch.as_tensor(value, dtype=torch.float64) for name, value in stats_or_alphas.items()}
    raise TypeError(
        "enable_adaptive needs ompmoe.MoEStats or a dict {layer name: alphas}; got "
        f"{type(stats_or_alphas).__name__}."
    )


def resolve_alphas(model: nn.Module, stats_or_alphas: Any, layers: Sequence[MoELayer] | None = None) -> dict[str, torch.Tensor]:
    """Per-layer alphas for ``model``'s current experts (float64, CPU), matched by layer name.

    Alphas with one entry per current expert are used as they are (statistics collected on this
    model, pruned or not). On a pruned model, alphas with one entry per ORIGINAL expert (statistics
    of the model before pruning) are indexed with the kept ids recorded in ``config.ompmoe``.
    """
    layers = list(layers) if layers is not None else find_moe_layers(model)
    source = _as_alpha_source(stats_or_alphas, model)
    unknown = sorted(set(source) - {layer.name for layer in layers})
    if unknown:
        raise ValueError(f"Alphas given for layers this model does not have: {unknown}.")
    record = pruning_info(model) or {}
    kept = record.get("kept_experts", {})
    original = record.get("original_num_experts", {})
    counts = ({layer.name: layer.token_count for layer in stats_or_alphas.layers}
              if isinstance(stats_or_alphas, MoEStats) else {})
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
                alphas = alphas[ids]
            else:
                pruned = f" (pruned from {original[layer.name]})" if layer.name in original else ""
                raise ValueError(
                    f"Layer {layer.name} has {layer.num_experts} experts{pruned} but {alphas.numel()} alphas were "
                    "given: use statistics collected on this model, or on the model it was pruned from."
                )
        if not bool(torch.isfinite(alphas).all()) or bool((alphas < 0).any()):
            raise ValueError(f"Alphas of layer {layer.name} must be finite and non-negative.")
        resolved[layer.name] = alphas.clone()
        if layer.name in counts:  # only experts this model still has: pruned-away ones are not news
            never = (counts[layer.name].reshape(-1)[ids] == 0).nonzero().reshape(-1)
            if never.numel():
                unseen[layer.name] = [int(i) for i in never]
    if unseen:
        warnings.warn(
            "ompmoe adaptive inference: some experts of this model were never routed during calibration, so "
            "their alpha is 0 and OMP-MoE+ skips them whenever other experts cover 1 - epsilon (current expert "
            f"ids per layer): {unseen}. Calibrate on more tokens to avoid this.",
            stacklevel=3,
        )
    return resolved


# -------------------------------------------------------------------------------------- the API
def enable_adaptive(
    model: nn.Module,
    stats_or_alphas: MoEStats | Mapping[str, Any],
    epsilon: float = 0.1,
    *,
    zeta: float = ZETA,
) -> nn.Module:
    """Switch on OMP-MoE+ adaptive expert skipping in every MoE layer of ``model`` (in place).

    Args:
        model: A supported transformers 5.x MoE model, pruned or not.
        stats_or_alphas: :class:`ompmoe.MoEStats` (``alpha_e = E||F_e(x)||^2`` per layer) or a dict
            ``{layer name: alphas}``; on a pruned model, statistics of the original model are mapped
            to the kept experts through ``config.ompmoe`` (see :func:`resolve_alphas`).
        epsilon: Relative energy each token may drop, in ``[0, 1]``; 0 keeps every expert.
        zeta: Stabiliser in the denominator of the rule.

    Calling it again replaces the previous settings (and resets the counters). The settings are
    stored in ``model.config.ompmoe_adaptive`` so they are saved with the model.
    """
    epsilon = float(epsilon)
    if not 0.0 <= epsilon <= 1.0 or math.isnan(epsilon):
        raise ValueError(f"epsilon must lie in [0, 1]; got {epsilon}.")
    if not zeta > 0:
        raise ValueError(f"zeta must be positive; got {zeta}.")
    layers = find_moe_layers(model)
    alphas = resolve_alphas(model, stats_or_alphas, layers)
    disable_adaptive(model)
    for layer in layers:
        state = _AdaptiveState(layer.name, alphas[layer.name], epsilon, float(zeta), layer.top_k)
        setattr(layer.experts, STATE_ATTR, state)
        state.handles = [
            layer.experts.register_forward_pre_hook(_pre_hook, with_kwargs=True),
            layer.experts.register_forward_hook(_post_hook, with_kwargs=True),
        ]
    setattr(
        model.config,
        CONFIG_KEY,
        {
            "epsilon": epsilon,
            "zeta": float(zeta),
            "alphas": {name: [float(a) for a in values] for name, values in alphas.items()},
        },
    )
    return model


def _states(model: nn.Module) -> list[_AdaptiveState]:
    return [
        getattr(module, STATE_ATTR)
        for module in model.modules()
        if isinstance(getattr(module, STATE_ATTR, None), _AdaptiveState)
    ]


def disable_adaptive(model: nn.Module) -> nn.Module:
    """Remove adaptive inference (hooks, counters and ``config.ompmoe_adaptive``); plain model again."""
    for module in model.modules():
        state = getattr(module, STATE_ATTR, None)
        if isinstance(state, _AdaptiveState):
            for handle in state.handles:
                handle.remove()
            delattr(module, STATE_ATTR)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, CONFIG_KEY):
        delattr(config, CONFIG_KEY)
    return model


def is_adaptive(model: nn.Module) -> bool:
    """Whether adaptive inference is switched on in ``model``."""
    return bool(_states(model))


def adaptive_info(model_or_config: Any) -> dict[str, Any] | None:
    """The saved ``ompmoe_adaptive`` record of a model or config, or ``None``."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, CONFIG_KEY, None)


def restore_adaptive(model: nn.Module) -> bool:
    """Re-apply the adaptive settings saved in ``model.config`` (after ``from_pretrained``).

    Returns whether a record was found. :func:`ompmoe.load_pruned` calls it for you.
    """
    record = adaptive_info(model)
    if not record:
        return False
    enable_adaptive(model, record["alphas"], record["epsilon"], zeta=record.get("zeta", ZETA))
    return True


def adaptive_report(model: nn.Module, reset: bool = False) -> dict[str, dict[str, Any]]:
    """Counters since the last reset, per MoE layer.

    Each entry: ``tokens``, ``top_k``, ``kept_pairs`` (expert executions), ``avg_experts_per_token``,
    ``skip_ratio`` (skipped share of the ``tokens * top_k`` native executions), ``flops_ratio``
    (routed-expert FLOPs relative to plain top-k, ``E[m] / K``), ``histogram`` (tokens that kept
    ``m`` experts, ``m = 0..K``) and ``epsilon``. :func:`adaptive_summary` gives the model-wide
    line (all layers together) and :func:`adaptive_totals` its numbers.
    """
    report: dict[str, dict[str, Any]] = {}
    for state in _states(model):
        histogram = state.histogram.cpu() if state.histogram is not None else torch.zeros(state.top_k + 1, dtype=torch.long)
        report[state.name] = layer_counts(histogram, state.top_k, epsilon=state.epsilon)
        if reset:
            state.reset()
    return report


def layer_counts(histogram: torch.Tensor, top_k: int, epsilon: float | None = None) -> dict[str, Any]:
    """Counters of one layer from its kept-experts histogram (also after summing ranks)."""
    histogram = histogram.reshape(-1).to(torch.long).cpu()
    tokens = int(histogram.sum())
    kept = int((histogram * torch.arange(histogram.numel())).sum())
    total = tokens * top_k
    return {
        "tokens": tokens,
        "top_k": top_k,
        "kept_pairs": kept,
        "avg_experts_per_token": kept / tokens if tokens else float("nan"),
        "skip_ratio": 1.0 - kept / total if total else float("nan"),
        "flops_ratio": kept / total if total else float("nan"),
        "histogram": histogram.tolist(),
        "epsilon": epsilon,
    }


def adaptive_totals(report: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """All layers together: ``avg_experts_per_token`` (per token and layer), ``skip_ratio``, ``flops_ratio``."""
    tokens = sum(entry["tokens"] for entry in report.values())
    kept = sum(entry["kept_pairs"] for entry in report.values())
    total = sum(entry["tokens"] * entry["top_k"] for entry in report.values())
    return {
        "tokens": float(tokens),
        "avg_experts_per_token": kept / tokens if tokens else float("nan"),
        "skip_ratio": 1.0 - kept / total if total else float("nan"),
        "flops_ratio": kept / total if total else float("nan"),
    }


def adaptive_summary(model_or_report: nn.Module | Mapping[str, Mapping[str, Any]]) -> str:
    """One model-wide line from a model's counters (or an :func:`adaptive_report`).

    ``adaptive (epsilon 0.1): 2.91 of 4 experts per token and layer, skip ratio 0.272, routed-expert
    FLOPs ratio 0.728, over 2048 tokens in 6 MoE layers``.
    """
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
    for state in _states(model):
        state.reset()


def adaptive_histograms(model: nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    """Raw per-layer ``(histogram, top_k)``, for summing over distributed ranks before reporting."""
    return {
        state.name: (
            state.histogram if state.histogram is not None else torch.zeros(state.top_k + 1, dtype=torch.long),
            state.top_k,
        )
        for state in _states(model)
    }


__all__ = [
    "CONFIG_KEY",
    "ZETA",
    "adaptive_histograms",
    "adaptive_info",
    "adaptive_keep_mask",
    "adaptive_report",
    "adaptive_summary",
    "adaptive_totals",
    "disable_adaptive",
    "enable_adaptive",
    "is_adaptive",
    "layer_counts",
    "reset_adaptive_counters",
    "resolve_alphas",
    "restore_adaptive",
]
