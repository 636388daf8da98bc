"""Fine-tuning a pruned model: causal-LM loss plus a load-balancing loss that allows per-layer counts.

transformers' router auxiliary loss pools all layers into one ``config.num_experts`` vector, so it fails on a
non-uniformly pruned model: :func:`causal_lm_loss` switches it off and adds :func:`load_balancing_loss`, per layer
from router hooks. No Lightning here (``FinetuneModule`` wraps it); details: docs/recipes.md, "Fine-tuning".
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..engine.adapters import find_moe_layers

IGNORE_INDEX = -100
"""Label value that the causal-LM loss ignores (padding)."""


def load_balancing_loss(router_logits: Sequence[torch.Tensor], top_k: int | Sequence[int],
                        attention_mask: torch.Tensor | None = None, per_layer: bool = True) -> torch.Tensor:
    r"""Switch-Transformer load-balancing loss over MoE layers that may have different expert counts.

    Per layer ``N_l * sum_e f_{l,e} P_{l,e}`` (``f``: top-``k_l`` assignments per token going to ``e``,
    ``P``: mean router probability of ``e``; ``k_l`` at perfect balance), padding left out.

    Args:
        router_logits: One ``(tokens, N_l)`` tensor per MoE layer (``tokens = batch * seq``).
        top_k: Experts per token, one int for all layers or one per layer.
        attention_mask: ``(batch, seq)`` mask of the same tokens, or ``None``.
        per_layer: ``True``: mean over layers of each layer's loss (any counts). ``False``:
            transformers' ``load_balancing_loss_func``, which sums ``f`` and ``P`` over layers
            before the product; needs every layer to have the same count.
    """
    logits = list(router_logits)
    if not logits:
        raise ValueError("load_balancing_loss needs the router logits of at least one MoE layer.")
    top_ks = [int(top_k)] * len(logits) if isinstance(top_k, int) else [int(k) for k in top_k]
    if len(top_ks) != len(logits):
        raise ValueError(f"Got {len(top_ks)} top-k values for {len(logits)} layers of router logits.")
    device = logits[0].device
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    fractions, probabilities, rows = [], [], []
    for layer_logits, k in zip(logits, top_ks):
        probs = torch.softmax(layer_logits.to(device).float(), dim=-1)
        if mask is not None and mask.numel() != probs.shape[0]:
            raise ValueError(f"attention_mask has {mask.numel()} tokens but the router logits have {probs.shape[0]}.")
        weights = torch.ones(probs.shape[0], device=device) if mask is None else mask
        selected = torch.topk(probs, k, dim=-1).indices
        counts = torch.zeros(probs.shape[-1], dtype=torch.float32, device=device)
        fractions.append(counts.scatter_add_(0, selected.reshape(-1), weights.repeat_interleave(k)))
        probabilities.append((probs * weights.unsqueeze(-1)).sum(dim=0))
        rows.append(weights.sum())
    if per_layer:
        losses = [f.shape[0] * torch.sum((f / n) * (p / n)) for f, p, n in zip(fractions, probabilities, rows)]
        return torch.stack(losses).mean()
    sizes = {f.shape[0] for f in fractions}
    if len(sizes) != 1:
        raise ValueError(
            f"per_layer=False (transformers' pooled loss) needs the same number of experts in every layer; "
            f"these layers have {sorted(sizes)}. Use per_layer=True for a non-uniformly pruned model."
        )
    total = torch.stack(rows).sum()
    f = torch.stack(fractions).sum(dim=0) / total
    p = torch.stack(probabilities).sum(dim=0) / total
    return torch.sum(f * p) * sizes.pop()


def moe_routers(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """``(router module, top_k)`` of every MoE layer, in module order.

    Take them before wrapping the model: PEFT replaces the experts modules, which hides the layers.
    """
    return [(layer.router, layer.top_k) for layer in find_moe_layers(model)]


@contextmanager
def capture_router_logits(model_or_routers: nn.Module | Sequence[tuple[nn.Module, int]]
                          ) -> Iterator[list[torch.Tensor]]:
    """Collect each MoE layer's router logits (router output 0), in module order, during the forwards inside.

    Takes a model or the list of :func:`moe_routers`; the hooks are removed on exit.
    """
    routers = moe_routers(model_or_routers) if isinstance(model_or_routers, nn.Module) else model_or_routers
    captured: list[torch.Tensor] = []

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        captured.append(output[0] if isinstance(output, (tuple, list)) else output)

    handles = [router.register_forward_hook(hook) for router, _ in routers]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class LossParts:
    """The pieces of a fine-tuning loss: ``loss = lm_loss + aux_coef * aux_loss``."""

    loss: torch.Tensor
    lm_loss: torch.Tensor
    aux_loss: torch.Tensor | None
    logits: torch.Tensor


def causal_lm_labels(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token labels for ``input_ids``: the ids themselves, padding set to ``IGNORE_INDEX``."""
    labels = input_ids.clone()
    if attention_mask is not None:
        labels[attention_mask == 0] = IGNORE_INDEX
    return labels


def causal_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor], aux_coef: float = 0.0, per_layer: bool = True,
                   routers: Sequence[tuple[nn.Module, int]] | None = None) -> LossParts:
    """Causal-LM loss of ``batch`` (``input_ids``, optional ``attention_mask`` and ``labels``).

    With ``aux_coef > 0`` :func:`load_balancing_loss` is added with that weight; the model's own aux loss
    is switched off (it fails on per-layer counts). Give ``routers`` when ``model`` wraps the HF model (PEFT).
    """
    input_ids = batch["input_ids"]
    attention_mask = batch.get("attention_mask")
    labels = causal_lm_labels(input_ids, attention_mask) if batch.get("labels") is None else batch["labels"]
    kwargs: dict[str, Any] = {"use_cache": False}
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        kwargs["output_router_logits"] = False
    if aux_coef:
        routers = moe_routers(model) if routers is None else list(routers)
    with capture_router_logits(routers if aux_coef else []) as logits:
        output = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
    if not aux_coef:
        return LossParts(loss=output.loss, lm_loss=output.loss, aux_loss=None, logits=output.logits)
    if len(logits) != len(routers):
        raise RuntimeError(f"Captured {len(logits)} router outputs for {len(routers)} MoE layers in one forward.")
    aux = load_balancing_loss(logits, [k for _, k in routers], attention_mask, per_layer=per_layer)
    loss = output.loss + aux_coef * aux.to(output.loss.device)
    return LossParts(loss=loss, lm_loss=output.loss, aux_loss=aux, logits=output.logits)


def router_aux_coef(config: Any) -> float:
    """The router aux-loss weight the model's own training uses: 0 unless ``output_router_logits``."""
    trained_with_aux = getattr(config, "output_router_logits", False) or (
        (getattr(config, "ompmoe", None) or {}).get("router_aux_loss", False)  # turned off by a non-uniform prune
    )
    return float(getattr(config, "router_aux_loss_coef", 0.001) or 0.0) if trained_with_aux else 0.0
