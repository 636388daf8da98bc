"""A forward-only LightningModule that holds the Hugging Face MoE model being calibrated."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from .data import resolve_shipped

TINY_PREFIX = "tiny:"
EVAL_MODE_WARNING = r"Found \d+ module\(s\) in eval mode at the start of training"


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"Unknown dtype {dtype!r}; use e.g. 'bfloat16', 'float16' or 'float32'.")
    return resolved


def shard_model(model: nn.Module, device_mesh: Any) -> None:
    """FSDP2 (``fully_shard``) each decoder layer, then the root, for ``ModelParallelStrategy``."""
    from torch.distributed.fsdp import fully_shard

    decoder = getattr(getattr(model, "model", model), "layers", None)
    for layer in decoder or []:
        fully_shard(layer, mesh=device_mesh)
    fully_shard(model, mesh=device_mesh)


class CalibrationModule(pl.LightningModule):
    """Runs the model forward on calibration batches; no loss, no optimizer, always in eval mode.

    Pair it with :class:`ompmoe.callbacks.OMPMoEPruning` (which gathers statistics and prunes)
    and :class:`ompmoe.CalibrationDataModule`.

    Args:
        model: A Hugging Face model id or local path, ``tiny:<model_type>`` for a tiny random
            model (offline tests and demos), ``shipped:tiny-moe`` for the small Qwen3-MoE trained
            on Python docs and source that ships with ompmoe (offline), or a model instance.
        dtype: Weights dtype when loading (``bfloat16`` for the paper's runs); ``None`` keeps the
            checkpoint's (float32 for ``shipped:tiny-moe``, whose weights are stored in bf16).
        tokenizer: Tokenizer id or path saved with the pruned model; defaults to ``model``
            (``bytes`` for tiny models; ``shipped:<model>`` resolves to the shipped directory).
        trust_remote_code: Passed to ``from_pretrained``.
    """

    def __init__(
        self,
        model: str | nn.Module = "tiny:qwen3_moe",
        dtype: str | None = None,
        tokenizer: str | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.torch_dtype = resolve_dtype(dtype)
        self.trust_remote_code = trust_remote_code
        if isinstance(model, nn.Module):
            self.model_name_or_path = getattr(getattr(model, "config", None), "_name_or_path", None) or None
            self.model: nn.Module | None = model
        else:
            self.model_name_or_path = model
            self.model = None
        is_tiny = isinstance(self.model_name_or_path, str) and self.model_name_or_path.startswith(TINY_PREFIX)
        self.tokenizer_name = resolve_shipped(tokenizer or ("bytes" if is_tiny else self.model_name_or_path))

    def configure_model(self) -> None:
        """Load the model lazily so strategies such as FSDP can shard it as it is created."""
        if self.model is None:
            self.model = self._load_model()
        self.model.eval()
        self.model.requires_grad_(False)  # forward-only: nothing here is trained
        if self.device_mesh is not None:
            shard_model(self.model, self.device_mesh)

    def _load_model(self) -> nn.Module:
        name = self.model_name_or_path
        if name is None:
            raise ValueError("CalibrationModule needs a model id, a path, 'tiny:<model_type>' or a model instance.")
        if name.startswith(TINY_PREFIX):
            from .tiny import tiny_model

            return tiny_model(name.removeprefix(TINY_PREFIX), dtype=self.torch_dtype or torch.float32)
        from transformers import AutoModelForCausalLM

        path = resolve_shipped(name)
        default = torch.float32 if path != name else "auto"  # shipped weights are bf16 for size only
        return AutoModelForCausalLM.from_pretrained(
            path, dtype=self.torch_dtype or default, trust_remote_code=self.trust_remote_code
        )

    def train(self, mode: bool = True) -> CalibrationModule:
        # Lightning switches modules to train mode during fit; routers (Mixtral) jitter there.
        super().train(mode)
        if self.model is not None:
            self.model.eval()
        return self

    def forward(self, **inputs: Any) -> Any:
        return self.model(**inputs, use_cache=False)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        with torch.no_grad():
            self(**batch)

    def configure_optimizers(self) -> list:
        # An empty list, not None: Lightning warns about None ("this fit will run with no optimizer"),
        # which is exactly what a forward-only calibration fit means to do.
        return []

    def on_fit_start(self) -> None:
        # Lightning warns at the start of training about modules in eval mode; here that is the
        # design (see ``train``), so this one message is ignored until training has started.
        warnings.filterwarnings("ignore", message=EVAL_MODE_WARNING)
        self._eval_mode_filter = warnings.filters[0]

    def on_train_start(self) -> None:
        with contextlib.suppress(AttributeError, ValueError):
            warnings.filters.remove(self._eval_mode_filter)
            warnings._filters_mutated()
