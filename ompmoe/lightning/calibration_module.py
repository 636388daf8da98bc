"""A forward-only LightningModule that holds the Hugging Face MoE model being calibrated."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from torch import nn

from .models import (TINY_PREFIX, default_dtype, default_tokenizer, is_tiny, load_model, model_and_name, resolve_dtype,
                     resolve_model)

__all__ = ["TINY_PREFIX", "CalibrationModule", "check_prunable", "resolve_dtype", "shard_model"]

EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
"""Config keys of a routed-expert count: an architecture with one of them above 1 is a Mixture-of-Experts."""


def _config_of(model: str | nn.Module) -> tuple[dict[str, Any] | None, str | None]:
    """``(config as a dict, model class name)`` of ``model`` without loading weights; ``(None, None)`` where they
    cannot be had cheaply (loading then reports what is wrong)."""
    import transformers

    if isinstance(model, nn.Module):
        config = getattr(model, "config", None)
        return (config.to_dict() if callable(getattr(config, "to_dict", None)) else None), type(model).__name__
    if not isinstance(model, str):
        return None, None
    if is_tiny(model):  # a tiny model of a type with no tiny config: the stock config of that type, if any
        from ..engine.adapters import ARCHITECTURES

        model_type = model.removeprefix(TINY_PREFIX)
        if model_type in ARCHITECTURES or model_type not in transformers.CONFIG_MAPPING:
            return None, None
        names = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        try:
            config = transformers.CONFIG_MAPPING[model_type]().to_dict()
        except (TypeError, ValueError):  # a config with required arguments: the tiny model's own error
            return None, None
        return config, names.get(model_type)
    from ..engine.hub import cache_only_where_unreachable
    from ..engine.names import resolve_shipped

    try:  # no remote code runs; a name that cannot load is left to the loader's own error
        source = resolve_shipped(model)
        with cache_only_where_unreachable(source):
            config, _ = transformers.PreTrainedConfig.get_config_dict(source)
    except (OSError, ValueError):
        return None, None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    return (config if isinstance(config, dict) else None), (architectures or [None])[0]


def _recognition_problem(config: dict[str, Any], model: str | nn.Module) -> str | None:
    """Why ompmoe does not recognize the model ``config`` describes by its modules (a skeleton on the meta device,
    no weights), or ``None`` when it does."""
    import transformers

    from ..engine.adapters import UnsupportedModelError, architecture_for_config
    from ..engine.adapters import with_stock_type
    from ..engine.model_classes import runnable_config
    from ..engine.tiny import tiny_config

    config = with_stock_type(config)
    model_type = config.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        return f"the installed transformers has no model_type {model_type!r}"
    try:
        if isinstance(model, str) and is_tiny(model):
            built = tiny_config(model_type)
        else:  # a checkpoint whose container class cannot run is read as its text model (warned when it loads)
            built = transformers.CONFIG_MAPPING[model_type].from_dict(config)
            if isinstance(model, str):
                built = runnable_config(built, warn=False)
        architecture_for_config(built)
    except UnsupportedModelError as error:
        return str(error).split("): ", 1)[-1]
    except Exception as error:  # noqa: BLE001 - a config its own class cannot build: say so
        return f"its config does not build a causal LM ({type(error).__name__}: {error})"
    return None


def check_prunable(model: str | nn.Module, option: str = "--model.model", action: str = "calibrate",
                   statistics_model: str | None = None, refuse_pruned: bool = True) -> None:
    """Refuse, in one line and before any weights load, a model ompmoe cannot calibrate or prune: a dense one, a
    Mixture-of-Experts of an architecture not registered, or (given by name) one ompmoe pruned already, with the
    model it was pruned from (its config's ``ompmoe`` record) to pass as ``option`` instead. ``statistics_model``:
    the model statistics were collected on; a pruned model that is that model is accepted (pruning it again), and so
    is any pruned model without ``refuse_pruned`` (a calibration of it prunes it again)."""
    from ..engine.adapters import ARCHITECTURES, supported_model_types
    from ..engine.names import same_model

    config, class_name = _config_of(model)
    if config is None:
        return
    name = model if isinstance(model, str) else config.get("_name_or_path") or None
    kind = class_name or config.get("model_type")
    kind = f"{name} ({kind})" if name else kind
    record = config.get("ompmoe")
    if refuse_pruned and isinstance(model, str) and isinstance(record, dict) and not (
            statistics_model and same_model(statistics_model, model)):
        plan = record.get("plan") if isinstance(record.get("plan"), dict) else {}
        base = plan.get("model_id") or statistics_model
        ratio = plan.get("ratio")
        of = " ".join(part for part in (f"ratio {ratio:g}" if isinstance(ratio, (int, float)) else "",
                                        f"of {base}" if base else "") if part)
        fix = f": {option} {base}" if base else " (its config.json does not name it)"
        raise ValueError(f"model {name} was pruned by ompmoe{f' ({of})' if of else ''}; {action} the model it was "
                         f"pruned from{fix}")
    model_type = config.get("model_type")
    if model_type in ARCHITECTURES:
        return
    problem = _recognition_problem(config, model)
    if problem is None:
        return
    sections = [config, *(value for value in config.values() if isinstance(value, dict))]  # text_config, ...
    counts = [section.get(key) for section in sections for key in EXPERT_COUNT_KEYS]
    supported = ", ".join(supported_model_types())
    if any(isinstance(count, int) and not isinstance(count, bool) and count > 1 for count in counts):
        raise ValueError(f"model {kind} is a Mixture-of-Experts model of model_type {model_type!r}, which ompmoe "
                         f"cannot prune: {problem}")
    raise ValueError(f"model {kind} has no MoE layers: ompmoe prunes the routed experts of Mixture-of-Experts "
                     f"models; pass a model whose model_type is one of {supported} (e.g. shipped:tiny-moe or "
                     "tiny:qwen3_moe)")


def shard_model(model: nn.Module, device_mesh: Any) -> None:
    """FSDP2 (``fully_shard``) each decoder layer, then the root, for ``ModelParallelStrategy``."""
    from torch.distributed.fsdp import fully_shard

    for layer in getattr(getattr(model, "model", model), "layers", None) or []:
        fully_shard(layer, mesh=device_mesh)
    fully_shard(model, mesh=device_mesh)


class CalibrationModule(pl.LightningModule):
    """Runs the model forward on calibration batches; no loss, no optimizer, always in eval mode.

    Pair it with :class:`ompmoe.callbacks.ExpertPruning` (which gathers statistics and prunes)
    and :class:`ompmoe.CalibrationDataModule`.

    Args:
        model: A Hugging Face model id or local path, ``tiny:<model_type>`` (a tiny random model), a model
            shipped with ompmoe (offline): ``shipped:tiny-moe`` (small Qwen3-MoE), ``shipped:tiny-moe-64``
            (GLM-4.5-style, 64 experts, grouped sigmoid routing) or ``shipped:tiny-moe-a3b`` (Qwen3-30B-A3B-style,
            64 experts, top-8), or a model instance.
        dtype: Weights dtype when loading (``bfloat16`` for the paper's runs); ``None`` keeps the
            checkpoint's (float32 for shipped models, whose weights are stored in bf16).
        tokenizer: Tokenizer id or path saved with the pruned model; defaults to ``model``
            (``bytes`` for tiny models; ``shipped:<model>`` resolves to the shipped directory).
        trust_remote_code: Passed to ``from_pretrained``.
    """

    calibrates: ClassVar[bool] = True
    """Whether the model is calibrated for pruning (refused up front when dense or pruned already); a subclass that
    only evaluates (``ompmoe.eval.EvalModule``: any model, pruned ones included) sets ``False``."""

    def __init__(self, model: str | nn.Module = "tiny:qwen3_moe", dtype: str | None = None,
                 tokenizer: str | None = None, trust_remote_code: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.needs_gradients = False
        """Set by ``ExpertPruning(loss_aware=True)``: run the forward with gradients enabled (no optimizer step)."""
        self.torch_dtype = resolve_dtype(dtype)
        self.trust_remote_code = trust_remote_code
        self.model, self.model_name_or_path = model_and_name(model)
        if isinstance(model, str) and not is_tiny(model):
            resolve_model(model)  # a name that cannot load fails here, before the Trainer starts
        if self.calibrates:
            check_prunable(model, refuse_pruned=False)  # a dense model; a pruned one is calibrated to prune again
        self.tokenizer_name = default_tokenizer(self.model_name_or_path, tokenizer)
        self.skeleton_source: Path | None = None
        """The checkpoint a layer-by-layer fit reads (``ExpertPruning(layer_by_layer=True)`` sets it): the model is
        then built without weights (:mod:`ompmoe.lightning.layer_by_layer`)."""

    def configure_model(self) -> None:
        """Load the model lazily so strategies such as FSDP can shard it as it is created."""
        if self.model is None and self.skeleton_source is not None:
            from ..engine.export.config import load_stock_config
            from ..engine.lazy_checkpoint import build_skeleton, checkpoint_dtype
            from .layer_by_layer import hold

            config = load_stock_config(self.skeleton_source)
            default = default_dtype(self.model_name_or_path) or checkpoint_dtype(config)  # as load_model loads it
            hold(self, build_skeleton(config, dtype=self.torch_dtype or default))
            self.model.config._name_or_path = self.model_name_or_path
        if self.model is None:
            if self.model_name_or_path is None:
                raise ValueError("CalibrationModule needs a model id, a path, 'tiny:<model_type>' or a model instance.")
            self.model = load_model(self.model_name_or_path, self.torch_dtype, self.trust_remote_code)
        self.model.eval()
        if self.device_mesh is not None:
            shard_model(self.model, self.device_mesh)

    def train(self, mode: bool = True) -> CalibrationModule:
        # Lightning switches modules to train mode during fit; routers (Mixtral) jitter there.
        super().train(mode)
        if self.model is not None:
            self.model.eval()
        return self

    def forward(self, **inputs: Any) -> Any:
        return self.model(**inputs, use_cache=False)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        # Once: blocks longer than the model's positions calibrate on positions it never trained on.
        seq_len = batch["input_ids"].shape[-1]
        limit = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        if isinstance(limit, int) and seq_len > limit and not getattr(self, "_warned_positions", False):
            self._warned_positions = True
            warnings.warn(f"Calibration blocks of {seq_len} tokens exceed the model's max_position_embeddings "
                          f"({limit}); statistics past position {limit} describe inputs the model was not trained on. "
                          f"Set the data module's seq_len to {limit} or less.", UserWarning)
        with torch.set_grad_enabled(self.needs_gradients):
            self(**batch)

    def configure_optimizers(self) -> list:
        # An empty list, not None: Lightning warns about None, yet no optimizer is the point of this fit.
        return []

    def on_fit_start(self) -> None:
        # Lightning warns about modules in eval mode at the start of training; here that is the design.
        warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")
        self._eval_mode_filter = warnings.filters[0]

    def on_train_start(self) -> None:
        with contextlib.suppress(AttributeError, ValueError):
            warnings.filters.remove(self._eval_mode_filter)
            warnings._filters_mutated()
