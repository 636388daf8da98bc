"""Load a checkpoint written by :func:`~ompmoe.engine.export.save.save_pruned` with each layer at its saved expert
count, refusing (by name and shape) whatever stock loading would fill silently."""

from __future__ import annotations

import contextlib
import copy

import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from ..._quiet import quiet_calls
from ..adapters import architecture_of, find_moe_layers
from ..block_fp8 import SCALE_SUFFIX, block_size
from ..compressed_tensors_format import GLOBAL_SCALE, stores_fp4
from ..compressed_tensors_format import stored_names as compressed_stored_names
from ..fbgemm_fp8 import GPU_ONLY, loadable_here
from ..hub import cache_only_where_unreachable, is_hub_id
from ..mxfp4 import stored_names as mxfp4_stored_names
from ..quantized_files import QuantizedCheckpointError
from ..stored_formats import stored_settings
from ..lazy_checkpoint import weight_files
from ..model_classes import default_model_class, model_classes
from ..apply.adaptive import restore_adaptive
from ..apply.pruning import _check_record, _slice_layer
from ..apply.quantized import quant_method
from ..planning.plan import PlanMismatchError
from ..record import pruning_info
from ..safetensors_header import read_header
from .config import load_stock_config, read_as_text_model
from .weights import FIX, CheckpointWeightsError, _names, check_loading_info, check_weight_files


def _model_class(config: Any) -> type:
    """The class ``config.json`` names when transformers registers it for the model type (a multimodal MoE's
    container keeps its towers), else the type's default (:func:`default_model_class`)."""
    classes = model_classes(config)
    names = getattr(config, "architectures", None) or []
    if not isinstance(names, (list, tuple)):
        names = [names]
    for name in names:
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        fits = isinstance(cls, type) and issubclass(cls, nn.Module) and hasattr(cls, "config_class")
        if fits and (not classes or issubclass(cls, tuple(classes))):
            return cls
        if classes:
            loads = " or ".join(cls.__name__ for cls in classes)
            raise PlanMismatchError(f"config.json names architectures={list(names)}, but {name} is not a causal-LM "
                                    f"or multimodal class for model_type={config.model_type!r}; ompmoe loads {loads}. "
                                    f'Set "architectures": ["{classes[0].__name__}"] in config.json.')
    if not classes:
        model_type = getattr(config, "model_type", None)
        raise PlanMismatchError(f"config.json (model_type={model_type!r}, architectures={list(names)}) has no "
                                "causal-LM or multimodal class in transformers; load_pruned loads those only.")
    return default_model_class(config)


def _refuse_partial_fp8_blocks(path: str | os.PathLike, config: Any) -> None:
    """Without a GPU transformers dequantizes a block-FP8 checkpoint itself, taking each block's size from the scale
    grid (``rows // scale_rows``): right for whole blocks only. A weight whose sides are not whole blocks (DeepSeek-V3's
    ``kv_a_proj_with_mqa``: 576 rows in 128-row blocks) would load wrong, or fail deep inside its loading; refused
    here by name, before any tensor is read. ``layer_by_layer`` reads such blocks as DeepSeek's reference does."""
    try:
        settings = stored_settings(config)
    except QuantizedCheckpointError:  # another format: transformers loads it as it loads it
        return
    gpu = torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
    if settings is None or settings["quant_method"] != "fp8" or gpu:
        return
    rows, cols = block_size(settings)
    partial = [f"{name} {entry['shape']}" for file in weight_files(path) for name, entry in read_header(file).items()
               if entry["dtype"].startswith("F8_") and len(entry["shape"]) >= 2 and not name.endswith(SCALE_SUFFIX)
               and (entry["shape"][-2] % rows or entry["shape"][-1] % cols)]
    if partial:
        raise QuantizedCheckpointError(
            f"{path} stores FP8 weights that are not whole {rows}x{cols} blocks ({_names(partial)}); without a GPU "
            "transformers dequantizes them as if they were and would load them wrong. Calibrate and prune it with "
            "layer_by_layer=True (ompmoe fit --layer_by_layer true), which reads partial blocks as DeepSeek's "
            "reference does, or load it on a GPU.")


def _refuse_rowwise_fp8(path: str | os.PathLike, config: Any) -> None:
    """Row-wise FP8 (``fbgemm_fp8``, Llama 4 Maverick's -FP8 release) loads only on a GPU with fbgemm_gpu: refused
    elsewhere by name, with the layer-by-layer route, before transformers' own import error."""
    try:
        settings = stored_settings(config)
    except QuantizedCheckpointError:  # another format: transformers loads it as it loads it
        return
    if settings is not None and settings["quant_method"] == "fbgemm_fp8" and not loadable_here():
        raise QuantizedCheckpointError(GPU_ONLY.format(path=path))


def _refuse_nvfp4_experts(path: str | os.PathLike, config: Any) -> None:
    """transformers (5.24 included) dequantizes compressed-tensors NVFP4 routed experts stored per expert without
    their ``weight_global_scale`` (huggingface/transformers#48371): no error, every expert off by that constant.
    Refused here by name, before any tensor is read; ``layer_by_layer`` reads them as compressed-tensors does."""
    try:
        settings = stored_settings(config)
    except QuantizedCheckpointError:  # another format: transformers loads it as it loads it
        return
    if settings is None or settings["quant_method"] != "compressed-tensors" or not stores_fp4(settings):
        return
    experts = [name for file in weight_files(path) for name in read_header(file)
               if ".experts." in name and name.endswith(".weight" + GLOBAL_SCALE)]
    if experts:
        raise QuantizedCheckpointError(
            f"{path} stores its routed experts in NVFP4 (compressed-tensors: {_names(experts)}), which transformers "
            f"{transformers.__version__} loads without their weight_global_scale (huggingface/transformers#48371): "
            "every expert would be read wrong, silently. ompmoe prunes such a checkpoint layer by layer (ompmoe fit "
            "--layer_by_layer true, ompmoe prune --model), which reads them as compressed-tensors does; run what it "
            "writes with an engine that reads NVFP4 (vLLM, which takes a uniform plan only: allocation uniform).")


def own_expert_count(experts: nn.Module, count: int, config: Any, attributes: tuple[str, ...]) -> None:
    """Give a cut experts module a config of its own with its count: transformers' FP8 loading (on a GPU) rebuilds
    each experts module from ``module.config`` (else the model's), which would size every layer at the largest
    (the remote code of a non-uniform checkpoint does the same, :mod:`.hub_code`). Only for a quantized checkpoint:
    a module config of its own no longer follows ``set_experts_implementation``."""
    own = copy.copy(getattr(experts, "config", None) or config.get_text_config())
    for attr in attributes:
        if hasattr(own, attr):
            setattr(own, attr, count)
    experts.config = own


def _check_weight_shapes(path: str | os.PathLike, cls: type, config: Any) -> None:
    """Every tensor of the weight files has the shape the model built from ``config`` saves it with, by the headers
    alone (nothing is read): transformers' conversion of expert tensors (stacking per-expert weights) would crash
    on a transposed one inside its loading report instead of naming it. Names the model does not save are left to
    the loading report (missing / unexpected)."""
    from transformers.core_model_loading import revert_weight_conversion

    files = weight_files(path)
    if not files:
        return
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the model is built again by from_pretrained, which warns if need be
        model = cls(config)
    saved = revert_weight_conversion(model, model.state_dict())  # the names and shapes save_pretrained writes
    expected = {name: list(tensor.shape) for name, tensor in saved.items()}
    for file in files:
        wrong = [f"{name} {entry['shape']} (model: {expected[name]})" for name, entry in read_header(file).items()
                 if name in expected and list(entry["shape"]) != expected[name]]
        if wrong:
            raise CheckpointWeightsError(f"{file} does not match the model: tensors of the wrong shape: "
                                         f"{_names(wrong)}. {FIX}")


def require_model_directory(path: str | os.PathLike, how: Callable[[str], str]) -> None:
    """Refuse a local folder that holds no model (a run's output, a data folder) with the folder inside that does,
    if any, as ``how(inner)`` (e.g. ``--model.model run/model``), before anything tries to read it."""
    directory = Path(path)
    if not directory.expanduser().exists() and not is_hub_id(path):
        raise FileNotFoundError(f"{directory} does not exist (and is no hub id, org/name): pass a checkpoint "
                                "directory or a hub id")
    if directory.is_dir() and not (directory / "config.json").is_file():  # e.g. a run's output (model in model/)
        inner = [child for child in sorted(directory.iterdir()) if (child / "config.json").is_file()]
        hint = f"; {inner[0].name}/ does: {how(str(inner[0]))}" if inner else ""
        raise FileNotFoundError(f"{directory} holds no model (no config.json){hint}")


def check_checkpoint_files(path: str | os.PathLike, config: Any) -> None:
    """What :func:`load_pruned` checks in a checkpoint's weight files before reading a tensor (headers, dtypes,
    shapes against the model ``config`` builds), for a reader that never builds the model with weights."""
    base = _model_class(config)
    check_weight_files(path, lambda: _integer_tensors(base, config))
    _check_weight_shapes(path, base, config)


def _integer_tensors(model_class: type, config: Any) -> set[str]:
    """Names (as ``save_pretrained`` writes them) of the tensors a model of ``model_class`` holds as integers (a
    token-to-expert table), read off a skeleton without weights; for an MXFP4 checkpoint, its experts' blocks and
    scales too, for a compressed-tensors one its packed weights and their shapes (the quantizers load them)."""
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        skeleton = model_class._from_config(config)
    saved = revert_weight_conversion(skeleton, skeleton.state_dict())
    integral = {name for name, tensor in saved.items() if not tensor.is_floating_point()}
    stored = {"mxfp4": mxfp4_stored_names, "compressed-tensors": compressed_stored_names}.get(quant_method(config))
    return integral | (stored(list(saved)) if stored is not None else set())


@quiet_calls()  # no transformers bars or torchao import lines from ompmoe's own load; nothing changed after it
def load_pruned(path: str | os.PathLike, **from_pretrained_kwargs: Any) -> nn.Module:
    """Load a model saved after :func:`prune`, whatever number of experts each layer kept (a never-pruned one as usual),
    with its saved adaptive inference switched back on. Keyword arguments go to ``from_pretrained``; remote code is
    off unless ``trust_remote_code=True``. A cached hub model is read from the cache alone where the hub does not
    answer (the hub libraries would retry each file for about 23 s)."""
    require_model_directory(path, lambda inner: f"ompmoe.load_pruned({inner!r})")
    with cache_only_where_unreachable(path):
        return _load_pruned(path, **from_pretrained_kwargs)


def _load_pruned(path: str | os.PathLike, **from_pretrained_kwargs: Any) -> nn.Module:
    from_pretrained_kwargs.setdefault("trust_remote_code", False)
    config = load_stock_config(path, trust_remote_code=from_pretrained_kwargs["trust_remote_code"])
    base = _model_class(config)
    check_weight_files(path, lambda: _integer_tensors(base, config))
    _refuse_partial_fp8_blocks(path, config)
    _refuse_nvfp4_experts(path, config)
    _refuse_rowwise_fp8(path, config)
    record = pruning_info(config)
    cls = base
    if record is not None:
        if not isinstance(record, dict):
            raise PlanMismatchError(f"config.json's ompmoe record is a {type(record).__name__}, not a mapping. The "
                                    "saved pruning record is corrupt: prune and save the original model again.")

        def __init__(self: nn.Module, config: Any, *args: Any, **kwargs: Any) -> None:
            """Build each layer at its own size before transformers loads (and converts) the weights."""
            base.__init__(self, config, *args, **kwargs)
            layers = find_moe_layers(self)
            _check_record(record, layers, saved=True)
            for layer in layers:
                count = len(record["kept_experts"][layer.name])
                if layer.num_experts != count:
                    attributes = architecture_of(self).count_attributes
                    _slice_layer(layer, torch.arange(count), attributes)
                    if quant_method(config) in ("fp8", "mxfp4"):  # their experts are rebuilt from their config
                        own_expert_count(layer.experts, count, config, attributes)

        cls = type(base.__name__, (base,), {"__init__": __init__, "__module__": base.__module__})
    _check_weight_shapes(path, cls, config)
    # Missing, unexpected or mis-shaped tensors raise (by name and shape) instead of being logged.
    kwargs = {**from_pretrained_kwargs, "ignore_mismatched_sizes": True}
    towers = read_as_text_model(path)  # a container read as its text model: its other towers are in the files
    with _towers_unreported(towers is not None):
        model, info = cls.from_pretrained(path, config=config, output_loading_info=True, **kwargs)
    if towers:  # only their tensors are expected to be left over
        info = {**info, "unexpected_keys": [key for key in info.get("unexpected_keys") or ()
                                            if key.split(".")[0] not in towers]}
    check_loading_info(path, info)
    model.__class__ = base
    decompress_now(model)
    restore_adaptive(model)
    return model


@contextlib.contextmanager
def _towers_unreported(text_model: bool) -> Iterator[None]:
    """transformers' loading report off while a container's text model is read (it would list every tensor of the
    towers left out as unexpected; the warning that the text model is read says so once)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    if text_model:
        hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def decompress_now(model: nn.Module) -> None:
    """A model transformers loaded from a compressed-tensors checkpoint is decompressed by compressed-tensors on its
    first forward, which then wraps every module's ``forward`` and fails on those ompmoe replaces (the statistics'
    hooks, adaptive inference): done here instead, as it loads, with the same function (so each weight reads with its
    own config group, and FP8-dynamic's activation quantization stays, as stock ``from_pretrained`` runs it). Nothing
    for other models, nor for one on the meta device (shapes only: it never runs)."""
    on_meta = any(parameter.is_meta for parameter in model.parameters())
    if getattr(model, "ct_decompress_hook", None) is not None and not on_meta:
        model.hf_quantizer.compressor.decompress_model(model)
