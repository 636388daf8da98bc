"""Architecture adapters: find the routed-expert blocks of a transformers 5.x MoE model.

Every supported architecture shares one layout: a sparse block with a router (``.gate``, or
``.router`` in GPT-OSS) that returns ``(logits, top_k_weights, top_k_index)`` and a fused
``.experts`` module whose parameters are 3-D tensors indexed by expert on their first axis.
The per-architecture hooks below only describe what differs: where the router lives, which
config key stores the expert count, and whether routing is group-limited.
Shared experts and dense layers are never matched, so they are left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn


class UnsupportedModelError(ValueError):
    """The model is not one of the architectures ompmoe knows how to prune."""


@dataclass(frozen=True)
class ArchitectureSpec:
    """What differs between architectures that share the transformers 5.x sparse-MoE layout."""

    router_attr: str
    """Attribute of the sparse block holding the router module."""
    expert_count_key: str
    """Config attribute that stores the number of routed experts per layer."""
    is_group_limited: Callable[[nn.Module], bool]
    """Whether the router first picks groups of experts and then experts inside them."""
    group_score_topk: int = 1
    """How many experts per group score a group (DeepSeek-V3 sums its top-2)."""


def _never(router: nn.Module) -> bool:
    return False


def _deepseek_v2_grouped(router: nn.Module) -> bool:
    return getattr(router, "topk_method", "greedy") == "group_limited_greedy"


def _always_grouped(router: nn.Module) -> bool:
    return True


ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "qwen3_moe": ArchitectureSpec("gate", "num_experts", _never),
    "qwen2_moe": ArchitectureSpec("gate", "num_experts", _never),
    "mixtral": ArchitectureSpec("gate", "num_local_experts", _never),
    "olmoe": ArchitectureSpec("gate", "num_experts", _never),
    "deepseek_v2": ArchitectureSpec("gate", "n_routed_experts", _deepseek_v2_grouped),
    "deepseek_v3": ArchitectureSpec("gate", "n_routed_experts", _always_grouped, group_score_topk=2),
    "glm4_moe": ArchitectureSpec("gate", "n_routed_experts", _always_grouped, group_score_topk=2),
    "gpt_oss": ArchitectureSpec("router", "num_local_experts", _never),
}
"""Supported ``config.model_type`` values and their router hooks."""


@dataclass
class MoELayer:
    """One sparse block of a model, with its router and fused experts."""

    name: str
    """Module path of the sparse block, e.g. ``model.layers.3.mlp``."""
    block: nn.Module
    router: nn.Module
    experts: nn.Module
    num_experts: int
    top_k: int
    num_groups: int
    """Number of expert groups the router picks from (1 when routing is not group-limited)."""
    topk_group: int
    """Number of groups the router keeps per token (equals ``num_groups`` when not grouped)."""
    group_score_topk: int

    @property
    def routing(self) -> dict[str, int]:
        """Router facts the planner needs, in a form that serializes to JSON."""
        return {
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "num_groups": self.num_groups,
            "topk_group": self.topk_group,
            "group_score_topk": self.group_score_topk,
        }


WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")
"""Module-path segments added by FSDP1, activation checkpointing and torch.compile wrappers."""


def clean_module_name(name: str) -> str:
    """The module path as in the unwrapped model, so names match across wrappers and processes."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def supported_model_types() -> list[str]:
    return sorted(ARCHITECTURES)


def architecture_of(model: nn.Module) -> ArchitectureSpec:
    """Return the spec for ``model`` or raise an error naming the supported architectures."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"ompmoe does not support model_type={model_type!r} ({type(model).__name__}). "
            f"Supported architectures: {', '.join(supported_model_types())}. "
            "Pass a transformers 5.x model of one of these types."
        )
    return ARCHITECTURES[model_type]


def _is_fused_experts(module: nn.Module) -> bool:
    has_count = isinstance(getattr(module, "num_experts", None), int)
    has_3d_weight = any(p.dim() == 3 for p in module.parameters(recurse=False))
    return has_count and has_3d_weight


def find_moe_layers(model: nn.Module) -> list[MoELayer]:
    """List the routed-expert blocks of ``model`` in module order.

    Raises a clear error for unsupported architectures and for models with no MoE layer.
    """
    spec = architecture_of(model)
    layers: list[MoELayer] = []
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        router = getattr(module, spec.router_attr, None)
        if not isinstance(experts, nn.Module) or not isinstance(router, nn.Module):
            continue
        if not _is_fused_experts(experts):
            continue
        num_experts = int(experts.num_experts)
        grouped = spec.is_group_limited(router)
        num_groups = int(getattr(router, "num_group", 1) or 1) if grouped else 1
        topk_group = int(getattr(router, "topk_group", num_groups) or num_groups) if grouped else 1
        layers.append(
            MoELayer(
                name=clean_module_name(name),
                block=module,
                router=router,
                experts=experts,
                num_experts=num_experts,
                top_k=int(router.top_k),
                num_groups=num_groups,
                topk_group=topk_group,
                group_score_topk=spec.group_score_topk if grouped else 1,
            )
        )
    if not layers:
        raise ValueError(
            f"No MoE layer found in {type(model).__name__}: expected sparse blocks with "
            f"`.{spec.router_attr}` and fused `.experts` (transformers>=5). Check that every layer "
            "is not dense (num_experts > 0, mlp_only_layers, first_k_dense_replace) and that the "
            "model was built by transformers 5.x."
        )
    return layers
