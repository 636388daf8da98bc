"""Fine-tuning losses for pruned models, re-exported from :mod:`ompmoe.lightning.finetune_loss`: they live below the
recipes (Lightning-free) so that :class:`ompmoe.FinetuneModule` imports no recipe."""

from ..lightning.finetune_loss import (
                                       IGNORE_INDEX,
                                       LossParts,
                                       capture_router_logits,
                                       causal_lm_labels,
                                       causal_lm_loss,
                                       load_balancing_loss,
                                       moe_routers,
                                       router_aux_coef,
)

__all__ = ["IGNORE_INDEX", "LossParts", "capture_router_logits", "causal_lm_labels", "causal_lm_loss",
           "load_balancing_loss", "moe_routers", "router_aux_coef"]
