"""``layer_by_layer`` in a Lightning fit (``ompmoe fit --layer_by_layer true``): the module holds a weightless
skeleton, and the whole calibration runs at the start of training, one decoder layer at a time from the checkpoint's
files (:meth:`~ompmoe.engine.run.PruningRun.collect_layer_by_layer`); the fit loop then stops before its first
batch, and the run finishes as any other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch import nn

from ..engine.collect.collector import batch_inputs
from ..engine.lazy_checkpoint import checkpoint_files
from ..engine.run import PruningRun
from .models import is_tiny, resolve_model

CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.py", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
"""What a hub model's layer-by-layer run downloads (to disk, never into memory): config, weights, code, tokenizer."""


def local_checkpoint(name: str) -> Path:
    """The local directory of the model ``name`` (a path, a shipped model, or a hub id downloaded to the cache the
    way ``from_pretrained`` caches it), with safetensors weights; a clear error for anything else."""
    if is_tiny(name):
        raise ValueError(f"layer_by_layer reads the model's safetensors files, and {name} has none (it is built in "
                         "memory); save it with save_pretrained and pass that directory, or calibrate resident.")
    path = resolve_model(name)
    if not Path(path).expanduser().is_dir():
        from huggingface_hub import snapshot_download

        path = snapshot_download(path, allow_patterns=CHECKPOINT_FILES)
    checkpoint_files(path)  # safetensors weights, or the error that says so
    return Path(path).expanduser()


def layer_by_layer_checkpoint(name: str, option: str = "layer_by_layer",
                              fix: str = "calibrate it resident (layer_by_layer false)") -> Path:
    """:func:`local_checkpoint`, refused where a skeleton cannot read its files one decoder layer at a time: a
    non-uniform pruned checkpoint (its layers keep different expert counts; ``option`` and ``fix`` word the error
    as the front door names them)."""
    from ..engine.export.config import non_uniform_config

    source = local_checkpoint(name)
    if non_uniform_config(source) is not None:
        raise ValueError(f"{option} reads {name} one decoder layer at a time, but its MoE layers keep different "
                         f"numbers of experts (a non-uniform pruned checkpoint); {fix}.")
    return source


def prepare(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """Before the model is built: refuse what a layer-by-layer fit cannot be, and have the module build a skeleton."""
    if trainer.world_size > 1:
        raise ValueError(f"layer_by_layer runs in one process (it reads each layer once); this fit has "
                         f"{trainer.world_size}. Run it with devices=1, or calibrate resident with FSDP2.")
    name = getattr(pl_module, "model_name_or_path", None)
    if not hasattr(pl_module, "skeleton_source") or name is None:
        raise ValueError(f"layer_by_layer needs ompmoe.CalibrationModule with a model named by path or hub id (it "
                         f"builds the model without weights); {type(pl_module).__name__} holds its own model.")
    pl_module.skeleton_source = layer_by_layer_checkpoint(name)


def calibrate(run: PruningRun, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_to_inputs: Any) -> int:
    """Every batch of the fit's loader through the checkpoint one layer at a time; then the fit loop stops."""
    batches = [batch_inputs(batch, batch_to_inputs, run.owner) for batch in trainer.train_dataloader]
    count = run.collect_layer_by_layer(pl_module.skeleton_source, batches, device=pl_module.device,
                                       show_progress=None if trainer.progress_bar_callback is not None else False)
    trainer.should_stop = True  # every batch has been used: no training step runs on the weightless model
    return count


def hold(pl_module: nn.Module, model: nn.Module) -> None:
    """Keep the weightless ``model`` on ``pl_module`` out of its children: Lightning moves children to the device,
    which a meta tensor cannot be (each layer is put on the device as it is read)."""
    pl_module.__dict__["model"] = model


__all__ = ["calibrate", "hold", "layer_by_layer_checkpoint", "local_checkpoint", "prepare"]
