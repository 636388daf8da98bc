"""Self-contained remote code that lets stock transformers load a non-uniformly pruned checkpoint.

The stock config has one expert count for all layers, so the directory carries its own config and model classes
(``auto_map``, importing only torch and transformers); ``"experts_implementation": HOW_TO_LOAD`` makes stock model
classes refuse it before any weight is read. How to load and why: docs/checkpoints.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..model_classes import AUTO_CLASSES

CONFIG_FILE = "configuration_ompmoe_pruned.py"
MODELING_FILE = "modeling_ompmoe_pruned.py"
HOW_TO_LOAD = (
    "This pruned checkpoint keeps a different number of experts in each MoE layer. Load it with "
    "transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True) "
    "(lm-eval: --model_args pretrained=path,trust_remote_code=True) or with ompmoe.load_pruned(path)."
)
"""``experts_implementation`` of a non-uniform ``config.json``; stock model classes quote it when they refuse."""


def how_to_load(auto_class: str = "AutoModelForCausalLM") -> str:
    """:data:`HOW_TO_LOAD` naming the Auto class that loads the checkpoint (a multimodal container's
    ``AutoModelForImageTextToText``)."""
    return HOW_TO_LOAD.replace("AutoModelForCausalLM", auto_class)

_CONFIG_TEMPLATE = '''\
"""Config of an expert-pruned {base_model} whose MoE layers keep different numbers of experts.

Written by ompmoe; needs only transformers. config.json stores the largest expert count and
`"experts_implementation": HOW_TO_LOAD`, a value every stock model class refuses while it is built;
this class drops that value (so transformers' default experts kernels run), and the model class
sizes each layer from config.ompmoe.
"""

from transformers import {base_config} as _BaseConfig

HOW_TO_LOAD = {how_to_load!r}
REMOTE_ARCHITECTURE, STOCK_ARCHITECTURE = {model_class!r}, {base_model!r}


def _per_layer(config):
    record = getattr(config, "ompmoe", None) or {{}}
    kept = record.get("kept_experts") or {{}}
    return {{name: len(ids) for name, ids in kept.items()}}


class {config_class}(_BaseConfig):
    """{base_config} whose config.ompmoe lists each MoE layer's experts."""

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        config_dict = dict(config_dict)
        if config_dict.get("experts_implementation") == HOW_TO_LOAD:
            del config_dict["experts_implementation"]
        return super().from_dict(config_dict, **kwargs)

    def to_dict(self):
        output = super().to_dict()
        per_layer = _per_layer(self)
        if per_layer and len(set(per_layer.values())) > 1:
            output["experts_implementation"] = HOW_TO_LOAD
        # save_pretrained names the remote class; ompmoe.load_pruned and other tools look for the stock one.
        if output.get("architectures"):
            output["architectures"] = [
                STOCK_ARCHITECTURE if name == REMOTE_ARCHITECTURE else name for name in output["architectures"]
            ]
        return output
'''

_MODELING_TEMPLATE = '''\
"""An expert-pruned {base_model} whose MoE layers keep different numbers of experts.

Written by ompmoe; needs only torch and transformers. The stock model is built with the largest
count, then each MoE layer listed in config.ompmoe["kept_experts"] is cut to its own count before
the weights load, exactly as ompmoe.load_pruned does; routing and the experts kernels are the stock
code over those experts.
"""

import copy

import torch
from torch import nn
from transformers import {base_model} as _BaseForCausalLM

from .configuration_ompmoe_pruned import {config_class}

ROUTER_ATTR = {router_attr!r}
COUNT_ATTRIBUTES = ("num_experts", "n_routed_experts", "num_local_experts", "num_routed_experts")
# a router's (or experts') rows past the routed experts, kept whole: shared, skip or identity experts
EXTRA_CLASS_KEYS = ("n_total_experts", "num_router_classes", "n_routed_experts", "total_experts")


def _axis(tensor, old, extra=0):
    """The axis indexed by expert: the first, or the second of a (1, experts) row."""
    if tensor.dim() > 0 and tensor.shape[0] in (old, old + extra):
        return 0
    return 1 if tensor.dim() == 2 and tensor.shape[0] == 1 and tensor.shape[1] == old else None


def _kept(tensor, axis, old, new):
    """The first `new` experts, and any rows past the `old` experts (a router's shared or skip rows)."""
    kept = tensor.detach().narrow(axis, 0, new)
    if tensor.shape[axis] > old:
        kept = torch.cat([kept, tensor.detach().narrow(axis, old, tensor.shape[axis] - old)], dim=axis)
    return kept.clone()


def _own_count(experts, count, config):
    """A config of the experts module's own, with its count: transformers' FP8 loading (on a GPU) rebuilds each
    experts module from `module.config` (else the model's), which would size every layer at the largest. Only for
    a quantized checkpoint: a module config of its own no longer follows set_experts_implementation."""
    own = copy.copy(getattr(experts, "config", None) or config.get_text_config())
    for attr in COUNT_ATTRIBUTES:
        if hasattr(own, attr):
            setattr(own, attr, count)
    experts.config = own


def _extra_rows(router, old):
    for module in router.modules():
        for key in EXTRA_CLASS_KEYS:
            value = getattr(module, key, None)
            if isinstance(value, int) and value > old:
                return value - old
    return 0


def _shrink(module, old, new, count_attributes=COUNT_ATTRIBUTES, extra=0):
    """Keep the first `new` experts of every tensor indexed by expert and update the stored counts."""
    for name, tensor in list(module.named_parameters(recurse=False)):
        if (axis := _axis(tensor, old, extra)) is not None:
            setattr(module, name, nn.Parameter(_kept(tensor, axis, old, new), requires_grad=tensor.requires_grad))
    for name, tensor in list(module.named_buffers(recurse=False)):
        if tensor is not None and (axis := _axis(tensor, old, extra)) is not None:
            module._buffers[name] = _kept(tensor, axis, old, new)
    for attr in count_attributes:
        if getattr(module, attr, None) == old:
            setattr(module, attr, new)
    for attr in EXTRA_CLASS_KEYS if extra else ():
        if getattr(module, attr, None) == old + extra:
            setattr(module, attr, new + extra)


class {model_class}(_BaseForCausalLM):
    """{base_model} with each MoE layer sized by config.ompmoe["kept_experts"]."""

    config_class = {config_class}

    @classmethod
    def _can_set_experts_implementation(cls):
        # transformers decides this by searching the defining module's source for the decorator of
        # the experts classes; the stock module carries it, this one only subclasses the stock model.
        return _BaseForCausalLM._can_set_experts_implementation()

    @classmethod
    def _can_set_attn_implementation(cls):
        return _BaseForCausalLM._can_set_attn_implementation()

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        kept = (getattr(config, "ompmoe", None) or {{}}).get("kept_experts") or {{}}
        for name, ids in kept.items():
            block = self.get_submodule(name)
            old = int(next(value for attr in ("num_experts", "num_routed_experts")
                           if isinstance(value := getattr(block.experts, attr, None), int)))
            if len(ids) > old:
                raise ValueError(
                    f"config.ompmoe keeps {{len(ids)}} experts in {{name}} but the config builds {{old}}; "
                    "the checkpoint is corrupt."
                )
            router = getattr(block, ROUTER_ATTR)
            extra = _extra_rows(router, old)
            for module in router.modules():
                _shrink(module, old, len(ids), extra=extra)
            _shrink(block.experts, old, len(ids), extra=_extra_rows(block.experts, old))
            if getattr(config, "quantization_config", None):  # FP8 experts are rebuilt from module.config
                _own_count(block.experts, len(ids), config)
            _shrink(block, old, len(ids), ())  # a routing bias the block keeps and passes into its router
'''


def write_remote_code(
    directory: str | Path, base_config: str, base_model: str, router_attr: str,
    auto_classes: list[str] | tuple[str, ...] = ("AutoModelForCausalLM",),
) -> None:
    """Add the remote code to a saved non-uniform checkpoint and make its ``config.json`` (which must hold the
    ``ompmoe`` record and, as :func:`~ompmoe.prune` sets it, the count that builds the largest layer) point to it for
    ``AutoConfig`` and each of ``auto_classes`` (a multimodal container's ``AutoModelForImageTextToText``)."""
    directory = Path(directory)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config_class = f"OmpmoePruned{base_model.removesuffix('ForCausalLM').removesuffix('ForConditionalGeneration')}Config"
    model_class = f"OmpmoePruned{base_model}"
    loading = how_to_load(auto_classes[0])
    values = dict(base_config=base_config, base_model=base_model, router_attr=router_attr, config_class=config_class,
                  model_class=model_class, how_to_load=loading)
    (directory / CONFIG_FILE).write_text(_CONFIG_TEMPLATE.format(**values))
    (directory / MODELING_FILE).write_text(_MODELING_TEMPLATE.format(**values))
    config["experts_implementation"] = loading
    config["auto_map"] = {
        "AutoConfig": f"{CONFIG_FILE.removesuffix('.py')}.{config_class}",
        **{name: f"{MODELING_FILE.removesuffix('.py')}.{model_class}" for name in auto_classes},
    }
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def is_non_uniform(config_dict: dict[str, Any]) -> bool:
    """Whether ``config_dict`` is a checkpoint written by :func:`write_remote_code`."""
    value = config_dict.get("experts_implementation")
    return isinstance(value, str) and any(value == how_to_load(name) for name in AUTO_CLASSES.values())


def stock_config_dict(config_dict: dict[str, Any]) -> dict[str, Any]:
    """``config_dict`` of a checkpoint written by :func:`write_remote_code`, as the stock config class takes it:
    without ``experts_implementation`` (so the stock class loads; ompmoe sizes the layers) and ``auto_map`` (so a
    later ``save_pretrained`` does not point to code files it does not copy)."""
    return {key: value for key, value in config_dict.items() if key not in ("experts_implementation", "auto_map")}
