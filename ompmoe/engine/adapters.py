"""Architecture adapters: find the routed-expert blocks (a router and fused ``.experts`` indexed by expert on their
first axis) of a transformers 5.x MoE model; an :class:`ArchitectureSpec` holds what differs between architectures.
Shared experts and dense layers are never matched."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
    experts_arguments: tuple[str, str, str] = ("hidden_states", "top_k_index", "top_k_weights")
    """Names of the fused experts' ``forward`` arguments (GPT-OSS: ``router_indices``, ``routing_weights``)."""
    count_attributes: tuple[str, ...] = ("num_experts", "n_routed_experts", "num_local_experts")
    """Attributes of the router and experts modules that hold the expert count (updated by pruning)."""
    auto: tuple[tuple[str, str], ...] = ("omp_normalized", "loss"), ("omp", "waterfill")
    """``(method, allocation)`` settings ``method="auto"`` tries for this layout (the first without held-out blocks);
    softmax routers: the best with a few large experts and with many small ones (docs/quality/intervals.md)."""
    tiny_config: tuple[str, dict[str, Any]] | None = field(default=None, compare=False)
    """``(transformers config class name, overrides)`` of a tiny random test model (:mod:`ompmoe.engine.tiny`)."""


def _never(router: nn.Module) -> bool:
    return False


def _deepseek_v2_grouped(router: nn.Module) -> bool:
    return getattr(router, "topk_method", "greedy") == "group_limited_greedy"


def _always_grouped(router: nn.Module) -> bool:
    return True


SIGMOID_SHARED_GROUPED = (("reap", "waterfill"),)
"""What ``auto`` takes on the DeepSeek-V3 / GLM-4.5 layout (measured on ``shipped:tiny-moe-64``), without a trial:
there the lowest held-out calibration loss did not find the best plan."""

ARCHITECTURES: dict[str, ArchitectureSpec] = {}
"""Supported ``config.model_type`` values and their specs (add one with :func:`register_architecture`)."""


def register_architecture(model_type: str, spec: ArchitectureSpec) -> ArchitectureSpec:
    """Support ``config.model_type == model_type``: statistics, selection, pruning, loading, adaptive inference."""
    if not isinstance(spec, ArchitectureSpec):
        raise TypeError(f"register_architecture needs an ArchitectureSpec; got {type(spec).__name__}.")
    existing = ARCHITECTURES.get(model_type)
    if existing is not None and existing != spec:
        raise ValueError(f"model_type {model_type!r} is already registered with another spec.")
    ARCHITECTURES[model_type] = spec
    return spec


register_architecture("qwen3_moe", ArchitectureSpec(
    "gate", "num_experts", _never,
    tiny_config=("Qwen3MoeConfig", dict(
        head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=True, mlp_only_layers=[0]))))
register_architecture("qwen2_moe", ArchitectureSpec(
    "gate", "num_experts", _never,
    tiny_config=("Qwen2MoeConfig", dict(
        intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1))))
register_architecture("mixtral", ArchitectureSpec(
    "gate", "num_local_experts", _never,
    tiny_config=("MixtralConfig", dict(intermediate_size=24, num_local_experts=8, num_experts_per_tok=2))))
register_architecture("olmoe", ArchitectureSpec(
    "gate", "num_experts", _never,
    tiny_config=("OlmoeConfig", dict(
        intermediate_size=16, num_experts=16, num_experts_per_tok=4, norm_topk_prob=False))))
register_architecture("deepseek_v2", ArchitectureSpec(
    "gate", "n_routed_experts", _deepseek_v2_grouped,
    tiny_config=("DeepseekV2Config", dict(
        intermediate_size=48, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, num_key_value_heads=4, topk_method="greedy", n_group=4, topk_group=2,
        routed_scaling_factor=1.0))))
register_architecture("deepseek_v3", ArchitectureSpec(
    "gate", "n_routed_experts", _always_grouped, group_score_topk=2, auto=SIGMOID_SHARED_GROUPED,
    tiny_config=("DeepseekV3Config", dict(
        intermediate_size=48, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, num_key_value_heads=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True))))
register_architecture("glm4_moe", ArchitectureSpec(
    "gate", "n_routed_experts", _always_grouped, group_score_topk=2, auto=SIGMOID_SHARED_GROUPED,
    tiny_config=("Glm4MoeConfig", dict(
        head_dim=8, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.5,
        norm_topk_prob=True))))
register_architecture("gpt_oss", ArchitectureSpec(
    "router", "num_local_experts", _never,
    experts_arguments=("hidden_states", "router_indices", "routing_weights"),
    tiny_config=("GptOssConfig", dict(
        head_dim=8, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=16,
        swiglu_limit=7.0))))


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
        return {key: getattr(self, key) for key in ROUTING_KEYS}


ROUTING_KEYS = ("num_experts", "top_k", "num_groups", "topk_group", "group_score_topk")
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")
"""Module-path segments added by FSDP1, activation checkpointing and torch.compile wrappers."""


def clean_module_name(name: str) -> str:
    """The module path as in the unwrapped model, so names match across wrappers and processes."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def supported_model_types() -> list[str]:
    return sorted(ARCHITECTURES)


def architecture_of(model: nn.Module) -> ArchitectureSpec:
    """Return the spec for ``model`` or raise an error naming the supported architectures."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(f"ompmoe does not support model_type={model_type!r} ({type(model).__name__}). "
                                    f"Supported architectures: {', '.join(supported_model_types())}. "
                                    "Pass a transformers 5.x model of one of these types.")
    return ARCHITECTURES[model_type]


def sparse_blocks(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module, nn.Module]]:
    """``(name, block, router, experts)`` of every module with a router and an ``.experts`` child, fused or not
    (quantized experts too; :func:`find_moe_layers` keeps the prunable ones). Empty for an unsupported architecture."""
    spec = ARCHITECTURES.get(getattr(getattr(model, "config", None), "model_type", None))
    if spec is None:
        return []
    blocks = []
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        router = getattr(module, spec.router_attr, None)
        if isinstance(experts, nn.Module) and isinstance(router, nn.Module):
            blocks.append((name, module, router, experts))
    return blocks


def find_moe_layers(model: nn.Module) -> list[MoELayer]:
    """The routed-expert blocks (fused 3-D expert weights) of ``model`` in module order; a clear error for unsupported
    architectures and for models with no MoE layer."""
    spec = architecture_of(model)
    layers: list[MoELayer] = []
    for name, module, router, experts in sparse_blocks(model):
        fused = any(p.dim() == 3 for p in experts.parameters(recurse=False))
        if not (isinstance(getattr(experts, "num_experts", None), int) and fused):
            continue
        grouped = spec.is_group_limited(router)
        num_groups = int(getattr(router, "num_group", 1) or 1) if grouped else 1
        layers.append(MoELayer(
            name=clean_module_name(name), block=module, router=router, experts=experts,
            num_experts=int(experts.num_experts), top_k=int(router.top_k), num_groups=num_groups,
            topk_group=int(getattr(router, "topk_group", num_groups) or num_groups) if grouped else 1,
            group_score_topk=spec.group_score_topk if grouped else 1))
    if not layers:
        raise ValueError(f"No MoE layer found in {type(model).__name__}: expected sparse blocks with "
                         f"`.{spec.router_attr}` and fused `.experts` (transformers>=5). Check that every layer "
                         "is not dense (num_experts > 0, mlp_only_layers, first_k_dense_replace) and that the "
                         "model was built by transformers 5.x.")
    return layers
