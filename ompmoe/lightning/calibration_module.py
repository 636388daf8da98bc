"""A forward-only LightningModule that holds the Hugging Face MoE model being calibrated."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from .models import TINY_PREFIX, default_tokenizer, is_tiny, load_model, model_and_name, resolve_dtype, resolve_model

__all__ = ["TINY_PREFIX", "CalibrationModule", "resolve_dtype", "shard_model"]


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
        self.tokenizer_name = default_tokenizer(self.model_name_or_path, tokenizer)

    def configure_model(self) -> None:
        """Load the model lazily so strategies such as FSDP can shard it as it is created."""
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
