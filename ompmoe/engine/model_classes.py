"""Which transformers class builds or loads a model ompmoe prunes: the causal LM, or for a multimodal MoE the
container class its checkpoint names (vision and audio towers kept, only the text decoder's experts pruned)."""

from __future__ import annotations

from typing import Any

AUTO_CLASSES = {
    "MODEL_FOR_CAUSAL_LM_MAPPING": "AutoModelForCausalLM",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING": "AutoModelForImageTextToText",
    "MODEL_FOR_MULTIMODAL_LM_MAPPING": "AutoModelForMultimodalLM",
}
"""transformers' model mappings ompmoe loads from, each with the Auto class that reads it (causal LM first)."""


def text_config(config: Any) -> Any:
    """The config of the model's text decoder, where the expert count and hidden size live: ``config`` itself, or a
    multimodal container's text sub-config (Qwen3-VL-MoE's ``text_config``)."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def text_config_attribute(config: Any) -> str | None:
    """The attribute of a multimodal container's config that holds its text config (``"text_config"``); ``None``
    when ``config`` is the text config."""
    inner = text_config(config)
    return next((name for name in getattr(config, "sub_configs", None) or {} if getattr(config, name, None) is inner),
                None) if inner is not config else None


TEXT_MODEL_INSTEAD = {
    "Llama4ForConditionalGeneration": ("language_model", "fails on every forward in transformers {version} (it reads "
                                       "image_outputs, which its language model's output does not have)"),
}
"""Multimodal container classes that cannot run in the installed transformers: ``(the attribute holding the text
model, why)``. A checkpoint that is one is read as its text model (its causal LM, as ``AutoModelForCausalLM`` reads
it), without its other towers; a model object of one is refused. A test checks that each still fails: when it passes,
its entry goes."""


class TextModelInsteadWarning(UserWarning):
    """A multimodal checkpoint is read as its text model, since its container class cannot run."""


def broken_container(config: Any) -> tuple[type, str, str] | None:
    """``(container class, attribute holding its text model, why it cannot run)`` for a container config whose class
    is in :data:`TEXT_MODEL_INSTEAD` and whose type has a causal LM to read instead; ``None`` otherwise."""
    import transformers

    if text_config_attribute(config) is None:
        return None
    registered = _registered(type(config))
    containers = [cls for name, cls in registered.items() if name != "AutoModelForCausalLM"]
    entry = TEXT_MODEL_INSTEAD.get(containers[0].__name__) if containers else None
    if entry is None or "AutoModelForCausalLM" not in registered:
        return None
    return containers[0], entry[0], entry[1].format(version=transformers.__version__)


def left_out_towers(config: Any) -> tuple[str, ...]:
    """The container's parts beside its text model (Llama 4's ``vision_model``, ``multi_modal_projector``): their
    tensors are in the files and not in the text model read instead; ``()`` for any other config."""
    import warnings

    import torch

    broken = broken_container(config)
    if broken is None:
        return ()
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        container = broken[0]._from_config(config)
    return tuple(name for name, _ in container.named_children() if name != broken[1])


_TOLD: set[str] = set()
"""Checkpoints :func:`runnable_config` warned about in this process."""


def runnable_config(config: Any, warn: bool = True) -> Any:
    """``config``, or for a checkpoint whose container class cannot run (:func:`broken_container`) its text config,
    which builds the causal LM that reads the same files, with the checkpoint's name, dtype and quantization (its
    modules named as in the text model), and a :class:`TextModelInsteadWarning` saying so (with ``warn``, once per
    checkpoint and process: a run reads its config several times)."""
    import copy
    import warnings

    broken = broken_container(config)
    if broken is None:
        return config
    container, attribute, reason = broken
    text = copy.deepcopy(text_config(config))
    text._name_or_path = getattr(config, "_name_or_path", "")
    if getattr(text, "dtype", None) is None:
        text.dtype = getattr(config, "dtype", None)
    if getattr(config, "quantization_config", None) is not None:
        text.quantization_config = _in_text_model(copy.deepcopy(config.quantization_config), attribute)
    if warn and text._name_or_path not in _TOLD:
        if text._name_or_path:
            _TOLD.add(text._name_or_path)
        causal = _registered(type(config))["AutoModelForCausalLM"].__name__
        warnings.warn(f"{text._name_or_path or 'this checkpoint'} is a {container.__name__}, which {reason}: ompmoe "
                      f"reads its text model, {causal}, from the same files (as AutoModelForCausalLM does) and writes "
                      "that, without the vision tower.", TextModelInsteadWarning, stacklevel=2)
    return text


def _in_text_model(quantization: Any, attribute: str) -> Any:
    """A container's quantization config with the modules it leaves unquantized named as in its text model (without
    the ``attribute.`` prefix)."""
    prefix = attribute + "."
    get = quantization.get if isinstance(quantization, dict) else lambda key: getattr(quantization, key, None)
    names = get("modules_to_not_convert")
    if isinstance(names, list):
        renamed = [name.removeprefix(prefix) if isinstance(name, str) else name for name in names]
        if isinstance(quantization, dict):
            quantization["modules_to_not_convert"] = renamed
        else:
            quantization.modules_to_not_convert = renamed
    return quantization


def _registered(config_type: type) -> dict[str, type]:
    """``{auto class name: model class}`` for every mapping of :data:`AUTO_CLASSES` that knows ``config_type``."""
    import transformers.models.auto.modeling_auto as auto

    found = {}
    for mapping, auto_class in AUTO_CLASSES.items():
        registered = getattr(auto, mapping, None)
        if registered is not None and config_type in registered:
            found[auto_class] = registered[config_type]
    return found


def model_classes(config: Any) -> list[type]:
    """The model classes ompmoe may load ``config`` with: its causal LM and its multimodal container classes."""
    return list(dict.fromkeys(_registered(type(config)).values()))


def default_model_class(config: Any) -> type:
    """The class a model of ``config`` is built with when nothing names one: for a multimodal container config
    (one with a text sub-config) its container class, so a pruned checkpoint keeps its towers; else the causal LM."""
    registered = _registered(type(config))
    if not registered:
        raise ValueError(f"transformers has no causal-LM or multimodal model class for "
                         f"model_type={getattr(config, 'model_type', None)!r} ({type(config).__name__}).")
    multimodal = [cls for name, cls in registered.items() if name != "AutoModelForCausalLM"]
    if multimodal and text_config_attribute(config) is not None:
        return multimodal[0]
    return registered.get("AutoModelForCausalLM", next(iter(registered.values())))


def auto_class_names(config: Any, model_class: type) -> list[str]:
    """The Auto classes that load ``model_class`` for ``config`` (the ``auto_map`` keys remote code registers)."""
    return [name for name, cls in _registered(type(config)).items() if issubclass(model_class, cls)]


def auto_class_of(config_dict: dict[str, Any]) -> str:
    """The Auto class that loads a saved ``config.json`` (as a dict) as the class it names: the causal LM, else the
    multimodal Auto class that maps its type to that class (``AutoModelForImageTextToText`` for Qwen3-VL-MoE)."""
    import transformers

    model_type = config_dict.get("model_type")
    config_class = transformers.CONFIG_MAPPING[model_type] if model_type in transformers.CONFIG_MAPPING else None
    names = set(config_dict.get("architectures") or [])
    registered = _registered(config_class) if config_class is not None else {}
    return next((auto for auto, cls in registered.items() if cls.__name__ in names),
                next(iter(registered), "AutoModelForCausalLM"))
