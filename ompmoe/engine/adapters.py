"""Architecture adapters: find the routed-expert blocks (a router and fused ``.experts`` indexed by expert on their
first axis) of a transformers 5.x MoE model; an :class:`ArchitectureSpec` holds what differs between architectures.
Shared experts and dense layers are never matched."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .model_classes import TEXT_MODEL_INSTEAD, default_model_class, text_config


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
    count_attributes: tuple[str, ...] = ("num_experts", "n_routed_experts", "num_local_experts", "num_routed_experts")
    """Attributes of the router and experts modules that hold the expert count (updated by pruning)."""
    auto: tuple[tuple[str, str], ...] = ("omp_normalized", "loss"), ("omp", "waterfill")
    """``(method, allocation)`` settings ``method="auto"`` tries for this layout (the first without held-out blocks);
    softmax routers: the best with a few large experts and with many small ones (docs/quality/intervals.md)."""
    tiny_config: tuple[str, dict[str, Any]] | None = field(default=None, compare=False)
    """``(transformers config class name, overrides)`` of a tiny random test model (:mod:`ompmoe.engine.tiny`)."""
    input_weighted: bool = False
    """Llama 4's layout: the routing weights scale the experts' input, and the experts take the hidden states alone
    (:mod:`ompmoe.engine.input_weighted`)."""


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
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}
"""Checkpoints whose ``config.json`` names a type transformers does not have (its remote code does) for an architecture
it has: Kimi K2 and K2 Thinking are DeepSeek-V3's model (their ``architectures`` say so; transformers' own Kimi-K2.5
config reads its ``kimi_k2`` text model as ``deepseek_v3``), so ompmoe reads them with the stock class, as
``deepseek_v3``."""


def with_stock_type(config_dict: dict[str, Any]) -> dict[str, Any]:
    """``config_dict`` (a ``config.json``) with the stock ``model_type`` of an aliased one (:data:`MODEL_TYPE_ALIASES`)
    and without the ``auto_map`` to its remote code; any other as it is."""
    stock = MODEL_TYPE_ALIASES.get(config_dict.get("model_type"))  # type: ignore[arg-type]
    if stock is None:
        return config_dict
    return {**{key: value for key, value in config_dict.items() if key != "auto_map"}, "model_type": stock}


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
    input_weighted: bool = False
    """The routing weights scale the experts' input (Llama 4): a pair's atom is ``F_e(g x)``
    (:mod:`ompmoe.engine.input_weighted`)."""
    identity_experts: int = 0
    """Zero-computation experts past the routed ones (LongCat-Flash's: ids ``num_experts ..``, each returning its
    input): never pruned nor measured, like shared experts (:mod:`ompmoe.engine.identity_experts`)."""

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
    """The model types registered with facts (:data:`ARCHITECTURES`); others are recognized by their modules."""
    return sorted(ARCHITECTURES)


ROUTER_ATTRS = ("gate", "router")
"""Attributes of a sparse block that may hold its router (the first that is a module)."""
EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
"""Config attributes that may hold the number of routed experts (the one equal to the experts' ``num_experts``)."""


TOP_K_KEYS = ("top_k_experts", "num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token")
"""Config attributes a router without its own ``top_k`` may read its top-k from at call time (Gemma 4's)."""


def router_top_k(router: nn.Module) -> int | None:
    """How many experts ``router`` picks per token: its ``top_k``, else the top-k key of the config it holds."""
    top_k = getattr(router, "top_k", None)
    if isinstance(top_k, int):
        return top_k
    config = getattr(router, "config", None)
    return next((value for key in TOP_K_KEYS if isinstance(value := getattr(config, key, None), int)), None)


def text_decoder_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``named_modules()`` of ``model`` inside its text decoder: a multimodal container's vision or audio towers (a
    vision MoE too) never see text calibration and are left alone."""
    try:
        decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else model
    except Exception:  # noqa: BLE001 - a model whose get_decoder cannot answer: all of it
        decoder = model
    inside = {id(module) for module in decoder.modules()} if isinstance(decoder, nn.Module) else None
    return [(name, module) for name, module in model.named_modules() if inside is None or id(module) in inside]


TOKEN_ID_ARGUMENTS = ("input_ids",)
"""Router arguments that make the routing a fixed function of the token (DeepSeek-V4's hash layers): such a block's
experts are never pruned, as the table would send tokens to removed experts; it keeps them all, like a dense layer."""


def routes_by_token_id(router: nn.Module) -> bool:
    """Whether ``router`` needs the token ids (a hash-routed block, left whole)."""
    try:
        parameters = inspect.signature(router.forward).parameters
    except (TypeError, ValueError):
        return False
    return any(name in parameters for name in TOKEN_ID_ARGUMENTS)


def _router_of(block: nn.Module) -> nn.Module | None:
    return next((router for attr in ROUTER_ATTRS if isinstance(router := getattr(block, attr, None), nn.Module)), None)


def hash_routed_blocks(model: nn.Module) -> dict[str, int]:
    """``{name: expert count}`` of the text decoder's sparse blocks routed by token id, which keep every expert: the
    stored expert count must still build them whole."""
    return {clean_module_name(name): int(experts_count(module.experts)) for name, module in text_decoder_modules(model)
            if _is_fused_experts(getattr(module, "experts", None)) and (router := _router_of(module)) is not None
            and routes_by_token_id(router)}


EXTRA_CLASS_KEYS = ("n_total_experts", "num_router_classes", "n_routed_experts", "total_experts")
"""Router (or experts) attributes counting its rows when rows past the routed experts belong to something else
(Inkling's shared experts, Zaya's skip class, LongCat-Flash's identity experts, whose router's ``n_routed_experts`` and
experts' ``total_experts`` count them): those trailing rows are kept whole when experts are pruned. A key counts only
where it exceeds the routed experts (DeepSeek's ``n_routed_experts`` equals them)."""


def router_extra_rows(router: nn.Module, count: int) -> int:
    """How many rows ``router`` (or a fused experts module) has past its ``count`` routed experts (0 for most)."""
    for module in router.modules():
        for key in EXTRA_CLASS_KEYS:
            if isinstance(value := getattr(module, key, None), int) and value > count:
                return value - count
    return 0


EXPERTS_COUNT_ATTRS = ("num_experts", "num_routed_experts")
"""Attributes of a fused experts module holding its expert count (LongCat-Flash's: ``num_routed_experts``)."""


def experts_count(module: Any) -> int | None:
    """The expert count a fused experts module holds (its first int of :data:`EXPERTS_COUNT_ATTRS`), or ``None``."""
    return next((value for attr in EXPERTS_COUNT_ATTRS if isinstance(value := getattr(module, attr, None), int)
                 and not isinstance(value, bool)), None)


IDENTITY_EXPERT_KEYS = ("zero_expert_num",)
"""Attributes of a fused experts module counting zero-computation (identity) experts past its routed ones."""


def identity_expert_count(experts: nn.Module) -> int:
    """How many identity experts follow ``experts``' routed ones (0 for every type but LongCat-Flash)."""
    return next((int(value) for key in IDENTITY_EXPERT_KEYS if isinstance(value := getattr(experts, key, None), int)
                 and value > 0), 0)


def _is_fused_experts(module: Any) -> bool:
    """A transformers 5.x fused experts module: an int expert count and 3-D weights indexed by expert."""
    return (isinstance(module, nn.Module) and experts_count(module) is not None
            and any(p.dim() == 3 for p in module.parameters(recurse=False)))


def _group_count(router: nn.Module) -> tuple[int, int]:
    """``(groups, groups kept per token)`` a router declares (``(1, 1)`` when it declares none)."""
    groups = next((int(value) for attr in ("num_group", "n_group", "num_expert_group")
                   if isinstance(value := getattr(router, attr, None), int)), 1)
    return groups, int(getattr(router, "topk_group", groups) or groups)


GROUP_SCORE_TOPK: dict[str, int] = dict.fromkeys((
    "axk1", "axk2", "bailing_hybrid", "beam", "deepseek_v32", "dots1", "dots3_note_text", "exaone_moe",
    "glm4_moe_lite", "glm4v_moe_text", "glm5_next_text", "glm_moe_dsa", "hy_v4", "hy_v4_vl_text", "kimi_linear",
    "mimo_v2_flash", "mistral4", "mistral_large4_text", "nemotron_h", "solar_open"), 2)
"""How many of a group's experts score it (DeepSeek-V3's layout sums the best two), for recognized types whose
routers pick groups: the one routing fact the modules do not show (read from each type's router code)."""


def _declares_groups(router: nn.Module) -> bool:
    return _group_count(router)[0] > 1


def block_expert_tensors(block: nn.Module, count: int) -> list[str]:
    """Names of the block's own tensors indexed by expert (MiniMax-M2's ``e_score_correction_bias``, a routing bias
    the block passes into its router): pruned with the router's."""
    tensors = [*block.named_parameters(recurse=False), *block.named_buffers(recurse=False)]
    return [name for name, tensor in tensors if tensor is not None and tensor.dim() > 0
            and (tensor.shape[0] == count or tuple(tensor.shape) == (1, count))]


def _zeros_for_meta(value: Any) -> Any:
    """A module (copied) or tensor whose meta tensors are zeros on the CPU, its real ones as they are: a skeleton's
    router mixes meta weights with real buffers (MiniMax-M2's routing bias), which no device runs together."""
    import copy

    import torch

    if isinstance(value, torch.Tensor):
        return torch.zeros(value.shape, dtype=value.dtype) if value.device.type == "meta" else value
    if not isinstance(value, nn.Module):
        return value
    value = copy.deepcopy(value)
    for module in value.modules():
        for name, parameter in module._parameters.items():
            if parameter is not None and parameter.device.type == "meta":
                module._parameters[name] = nn.Parameter(_zeros_for_meta(parameter), requires_grad=False)
        for name, buffer in module._buffers.items():
            module._buffers[name] = _zeros_for_meta(buffer) if buffer is not None else None
    return value


def _probe_router(router: nn.Module, hidden_size: int, extra: list[Any], scores_of: int | None = None) -> str | None:
    """Why ``router`` does not route as the collector expects (``(logits, weights, indices, ...)`` from the hidden states
    and the block's expert-indexed tensors ``extra``; with ``scores_of``, Llama 4's ``(scores, logits)`` of that many
    experts), or ``None``; one token on the router's own device and dtype (a skeleton's meta tensors too)."""
    import torch

    weight = next(iter(router.parameters()), None)
    if weight is not None and weight.device.type == "meta":  # a skeleton's router: probed on a copy of zeros, so
        router, extra = _zeros_for_meta(router), [_zeros_for_meta(tensor) for tensor in extra]  # real buffers fit
        weight = next(iter(router.parameters()))
    options = dict(device=weight.device, dtype=weight.dtype) if weight is not None else {}
    try:
        with torch.no_grad():
            try:
                output = router(torch.zeros(1, hidden_size, **options), *extra)
            except (ValueError, RuntimeError, IndexError):  # a router that takes the block's (batch, sequence,
                output = router(torch.zeros(1, 1, hidden_size, **options), *extra)  # hidden) input itself (AFMoE)
    except Exception as error:  # noqa: BLE001 - any failure is the reason
        inputs = "the hidden states and the block's tensors" if extra else "the hidden states alone"
        return f"{type(router).__name__} cannot route {inputs} ({type(error).__name__}: {error})"
    if scores_of is not None:
        if not (isinstance(output, tuple) and len(output) == 2
                and all(tensor.is_floating_point() and tuple(tensor.shape) == (1, scores_of) for tensor in output)):
            shape = f"{len(output)} values" if isinstance(output, tuple) else type(output).__name__
            return (f"{type(router).__name__} returns {shape}, not (scores, logits) of its {scores_of} experts, which "
                    "experts taking the hidden states alone need")
        return None
    if not (isinstance(output, tuple) and len(output) >= 3 and not output[2].is_floating_point()
            and tuple(output[2].shape) == (1, router_top_k(router))):
        shape = f"{len(output)} values" if isinstance(output, tuple) else type(output).__name__
        return f"{type(router).__name__} returns {shape}, not (logits, weights, expert indices)"
    return None


def _sibling_blocks(names: list[str]) -> tuple[str, list[str]] | None:
    """The first module holding several sparse blocks of ``names`` as named attributes (their parent), with those
    names; ``None`` where each sparse block stands alone (the decoder layers of a list are not siblings)."""
    children: dict[str, list[str]] = {}
    for name in names:
        parent, _, child = name.rpartition(".")
        if not child.isdigit():
            children.setdefault(parent, []).append(child)
    return next(((clean_module_name(parent), found) for parent, found in children.items() if len(found) > 1), None)


def recognize_architecture(model: nn.Module) -> ArchitectureSpec:
    """The facts of an unregistered model type, read off its modules: the sparse blocks (a router and a fused
    ``.experts``), the router's attribute, the experts' arguments and the config key of the expert count. Raises
    :class:`UnsupportedModelError` naming the one fact that cannot be read (register those with
    :func:`register_architecture`)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    config = text_config(model.config) if hasattr(model, "config") else None
    cannot = f"ompmoe cannot prune model_type={model_type!r} ({type(model).__name__}): "
    fix = (f"; if the model has routed experts, register the fact with ompmoe.register_architecture({model_type!r}, "
           "ompmoe.ArchitectureSpec(...)) (docs/methods.md, \"How an architecture is recognized\")")
    if (broken := TEXT_MODEL_INSTEAD.get(type(model).__name__)) is not None:
        import transformers

        raise UnsupportedModelError(
            cannot + f"{type(model).__name__}: " + broken[1].format(version=transformers.__version__) + ", so no "
            "calibration can run it. Read its text model instead: ompmoe.load_pruned(path) and every ompmoe command "
            "do for such a checkpoint, as transformers.AutoModelForCausalLM.from_pretrained(path) does")
    named = [(name, module) for name, module in text_decoder_modules(model)
             if _is_fused_experts(getattr(module, "experts", None))]
    fused = [module for _, module in named]
    blocks = [block for block in fused if (router := _router_of(block)) is None or not routes_by_token_id(router)]
    if (paired := _sibling_blocks([name for name, _ in named])) is not None:
        parent, children = paired
        raise UnsupportedModelError(
            cannot + f"{parent} holds {len(children)} sparse blocks ({', '.join(children)}), each routing its own "
            "share of the tokens into one router-logits tensor of one expert count (ERNIE-4.5-VL: text tokens to "
            "one, image and video tokens to the other): calibration measures only the experts its tokens reach, and "
            "a block pruned alone no longer fits the others (inputs with images would fail)")
    if fused and not blocks:
        raise UnsupportedModelError(cannot + "every sparse block routes by token id (a fixed table, never pruned)")
    if not blocks:
        raise UnsupportedModelError(
            cannot + "no module holds a transformers-5 fused experts module (`.experts` with 3-D expert weights and "
            f"an int `num_experts`). Registered architectures: {', '.join(supported_model_types())}.")
    # the block with the most experts (the first of them): a checkpoint with per-layer counts loaded through its
    # remote code stores the largest count in its config, which the count is matched with
    block = max(blocks, key=lambda module: int(experts_count(module.experts)))  # type: ignore[arg-type]
    routers = [attr for attr in ROUTER_ATTRS if isinstance(getattr(block, attr, None), nn.Module)]
    if not routers:
        raise UnsupportedModelError(cannot + f"cannot tell which module of {type(block).__name__} is its router "
                                    f"(none of {', '.join('.' + a for a in ROUTER_ATTRS)} is a module)" + fix)
    router, experts = getattr(block, routers[0]), block.experts
    if router_top_k(router) is None:
        raise UnsupportedModelError(cannot + f"cannot tell how many experts {type(router).__name__} picks per token "
                                    f"(it has no int `top_k` nor a config with one of {', '.join(TOP_K_KEYS)})" + fix)
    count = int(experts_count(experts))  # type: ignore[arg-type]
    outside = block_expert_tensors(block, count)
    positional = [parameter for parameter in inspect.signature(router.forward).parameters.values()
                  if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)]
    required = [parameter.name for parameter in positional if parameter.default is parameter.empty]
    if not len(required) <= 1 + len(outside) <= len(positional):
        taken = f" besides the block's {', '.join(outside)}" if outside else ""
        raise UnsupportedModelError(
            cannot + f"{type(router).__name__}.forward takes ({', '.join(required)}){taken}: routing that depends on "
            "more than the hidden states and the block's expert-indexed tensors (token ids, the previous layer's "
            "router state) is not supported yet" + fix)
    arguments = [parameter.name for parameter in inspect.signature(experts.forward).parameters.values()
                 if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)]
    input_weighted = len(arguments) == 1 and not outside
    if input_weighted:  # Llama 4: the scores scale the experts' input, the experts run on the hidden states alone
        arguments = list(ArchitectureSpec.experts_arguments)
    elif len(arguments) != 3:
        raise UnsupportedModelError(
            cannot + f"{type(experts).__name__}.forward takes ({', '.join(arguments)}), not (hidden states, expert "
            "indices, routing weights): the router's weights are not applied inside the experts" + fix)
    keys = [key for key in EXPERT_COUNT_KEYS if getattr(config, key, None) == count]
    if not keys:
        raise UnsupportedModelError(cannot + "cannot tell which config attribute holds the number of routed experts "
                                    f"({count}; none of {', '.join(EXPERT_COUNT_KEYS)})" + fix)
    if (problem := _probe_router(router, int(getattr(config, "hidden_size", 0) or 0),
                                 [getattr(block, name) for name in outside], count if input_weighted else None)
            ) is not None:
        raise UnsupportedModelError(cannot + problem + fix)
    groups, kept_groups = _group_count(router)
    text_type = getattr(config, "model_type", None)  # a container's text decoder type (glm4v_moe_text)
    if 1 < groups and kept_groups < groups and text_type not in GROUP_SCORE_TOPK:
        raise UnsupportedModelError(
            cannot + f"cannot tell how {type(router).__name__} scores its {groups} expert groups (by the best "
            "expert or the sum of the best two)" + fix)
    grouped = text_type in GROUP_SCORE_TOPK
    return ArchitectureSpec(routers[0], keys[0], _declares_groups, group_score_topk=GROUP_SCORE_TOPK.get(text_type, 1),
                            experts_arguments=tuple(arguments),  # type: ignore[arg-type]
                            input_weighted=input_weighted, **({"auto": SIGMOID_SHARED_GROUPED} if grouped else {}))


RECOGNIZED: dict[str, ArchitectureSpec] = {}
"""Specs of unregistered model types read off their modules in this process (:func:`recognize_architecture`);
kept apart from :data:`ARCHITECTURES`, which holds what was registered."""


def known_spec(model_type: str | None) -> ArchitectureSpec | None:
    """The spec of ``model_type`` if it is registered or was recognized in this process."""
    return ARCHITECTURES.get(model_type) or RECOGNIZED.get(model_type)  # type: ignore[arg-type]


def architecture_of(model: nn.Module) -> ArchitectureSpec:
    """The spec of ``model``: registered for its model type, else recognized by its modules (once per process);
    raises :class:`UnsupportedModelError` naming what could not be recognized."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    spec = known_spec(model_type)
    if spec is None:
        spec = RECOGNIZED[model_type] = recognize_architecture(model)
    return spec


def architecture_for_config(config: Any) -> ArchitectureSpec:
    """The spec of the model ``config`` builds, without weights (a skeleton on the meta device when it must be
    recognized): for a saved checkpoint's config, or statistics' model type, before a model exists."""
    spec = known_spec(config.model_type)
    if spec is None:
        import torch

        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            spec = architecture_of(default_model_class(config)._from_config(config))
    return spec


def spec_for_model_type(model_type: str | None) -> ArchitectureSpec | None:
    """The spec of ``model_type`` without a model or config (statistics name only the type): registered,
    recognized, or recognized on a skeleton of the type's default config; ``None`` if it cannot be."""
    spec = known_spec(model_type)
    if spec is None and model_type is not None:
        import transformers

        try:
            spec = architecture_for_config(transformers.CONFIG_MAPPING[model_type]())
        except Exception:  # noqa: BLE001 - unknown type, a default config that does not build, or refused
            return None
    return spec


def sparse_blocks(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module, nn.Module]]:
    """``(name, block, router, experts)`` of every module with a router and an ``.experts`` child, fused or not
    (quantized experts too; :func:`find_moe_layers` keeps the prunable ones). Empty for an unsupported architecture."""
    try:
        spec = architecture_of(model)
    except UnsupportedModelError:
        return []
    blocks = []
    for name, module in text_decoder_modules(model):
        experts = getattr(module, "experts", None)
        router = getattr(module, spec.router_attr, None)
        if isinstance(experts, nn.Module) and isinstance(router, nn.Module) and not routes_by_token_id(router):
            blocks.append((name, module, router, experts))
    return blocks


def find_moe_layers(model: nn.Module) -> list[MoELayer]:
    """The routed-expert blocks (fused 3-D expert weights) of ``model`` in module order; a clear error for unsupported
    architectures and for models with no MoE layer."""
    spec = architecture_of(model)
    layers: list[MoELayer] = []
    for name, module, router, experts in sparse_blocks(model):
        fused = any(p.dim() == 3 for p in experts.parameters(recurse=False))
        if not (experts_count(experts) is not None and fused):
            continue
        grouped = spec.is_group_limited(router)
        num_groups, topk_group = _group_count(router) if grouped else (1, 1)  # what recognition read, the same way
        layers.append(MoELayer(
            name=clean_module_name(name), block=module, router=router, experts=experts,
            num_experts=int(experts_count(experts)), top_k=int(router_top_k(router)),  # type: ignore[arg-type]
            num_groups=num_groups, topk_group=topk_group, group_score_topk=spec.group_score_topk if grouped else 1,
            input_weighted=spec.input_weighted, identity_experts=identity_expert_count(experts)))
    if not layers:
        raise ValueError(f"No MoE layer found in {type(model).__name__}: expected sparse blocks with "
                         f"`.{spec.router_attr}` and fused `.experts` (transformers>=5). Check that every layer "
                         "is not dense (num_experts > 0, mlp_only_layers, first_k_dense_replace) and that the "
                         "model was built by transformers 5.x.")
    return layers


def moe_model_types(multimodal: bool = False) -> list[str]:
    """The causal-LM model types of the installed transformers whose modeling file defines a fused ``*Experts``
    module (read from the source files, nothing imported): what ompmoe recognizes or refuses by name. With
    ``multimodal``, instead the containers with a ``text_config`` that no causal-LM class loads (Qwen3-VL-MoE)."""
    import importlib.util
    import re

    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    from transformers import CONFIG_MAPPING

    causal = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    containers = {model_type for model_type in {*modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
                                                *modeling_auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES} - set(causal)
                  if "text_config" in getattr(CONFIG_MAPPING[model_type], "sub_configs", {})}
    candidates = containers if multimodal else set(causal)
    experts_class = re.compile(r"^class \w+Experts\(", re.MULTILINE)
    found = []
    for model_type in sorted(candidates):
        module = model_type_to_module_name(model_type)
        try:
            spec = importlib.util.find_spec(f"transformers.models.{module}.modeling_{module}")
        except ModuleNotFoundError:
            continue
        if spec is not None and spec.origin and experts_class.search(open(spec.origin, encoding="utf-8").read()):
            found.append(model_type)
    return found
