"""Free disk space checked before the work that fills it: a run whose pruned model (or whose layer inputs kept for a
backward) cannot fit the disk it writes to is refused before calibration, not after hours of it.

The sizes are lower bounds (the experts a ratio keeps at least, each tensor in the dtype written), so a refusal is
never wrong; a write that still runs out of space fails cleanly (:func:`~ompmoe.engine.io.atomic_path`).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from .adapters import MoELayer, block_expert_tensors, find_moe_layers
from .io import OutputNotWritableError
from .safetensors_header import read_header


class NotEnoughSpaceError(OutputNotWritableError):
    """The disk a run writes to has less free space than the run needs; ``errno`` is ENOSPC. ``str()`` is the message
    alone (no ``[Errno 28]``)."""

    def __str__(self) -> str:
        return str(self.strerror)


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes an unprivileged user may still write on the file system ``path`` (or its nearest existing ancestor) is
    on; ``None`` when that cannot be told."""
    ancestor = Path(path).absolute()
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    try:
        return shutil.disk_usage(ancestor).free
    except OSError:
        return None


def readable_size(count: float) -> str:
    """``512 bytes``, ``3.5 MiB``, ``12.3 GiB``, ``1.02 TiB``: three significant digits."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(count) < 1024:
            return f"{int(count)} {unit}" if unit == "bytes" else f"{count:.3g} {unit}"
        count /= 1024
    return f"{count:.3g} TiB"


def require_free_space(path: str | os.PathLike, needed: float, what: str, fix: str) -> None:
    """:class:`NotEnoughSpaceError` when the file system of ``path`` has less than ``needed`` bytes free (nothing when
    its free space cannot be told): ``what`` says who needs them (``the pruned model needs``), ``fix`` what to do."""
    free = free_bytes(path)
    if free is not None and free < needed:
        raise NotEnoughSpaceError(errno.ENOSPC, f"not enough disk space at {path}: {what} at least "
                                                f"{readable_size(needed)} and its file system has "
                                                f"{readable_size(free)} free; {fix}")


def _written_bytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> int:
    size = dtype.itemsize if dtype is not None and tensor.is_floating_point() else tensor.element_size()
    return tensor.numel() * size


def _tensors(module: nn.Module) -> dict[int, torch.Tensor]:
    return {id(t): t for t in module.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)}


def _model_tensors(model: nn.Module) -> dict[int, torch.Tensor]:
    """``model``'s tensors, each once: tied ones are one object, but a weightless skeleton's output embeddings are not
    yet tied to its input embeddings (one tensor in the files)."""
    tensors = _tensors(model)
    config = getattr(model, "config", None)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    if getattr(text, "tie_word_embeddings", False) and callable(getattr(model, "get_output_embeddings", None)):
        output, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
        if output is not None and embeddings is not None and output.weight is not embeddings.weight:
            tensors.pop(id(output.weight), None)
    return tensors


def _per_expert_tensors(layer: MoELayer) -> dict[int, torch.Tensor]:
    """What pruning cuts by expert in one sparse block: its experts, its router (all of it: a lower bound where some
    rows are kept whatever is pruned) and the block's own per-expert tensors."""
    tensors = {**_tensors(layer.experts), **_tensors(layer.router)}
    own = dict(layer.block.named_parameters(recurse=False)) | dict(layer.block.named_buffers(recurse=False))
    tensors.update({id(own[name]): own[name] for name in block_expert_tensors(layer.block, layer.num_experts)})
    return tensors


def model_bytes(model: nn.Module, dtype: torch.dtype | None = None) -> tuple[int, dict[str, int]]:
    """``model``'s tensors in bytes as written (floating point in ``dtype`` when given; tied tensors counted once;
    weightless (meta) models too), and per sparse block the bytes pruning cuts by expert."""
    tensors = _model_tensors(model)
    blocks = {layer.name: sum(_written_bytes(t, dtype) for key, t in _per_expert_tensors(layer).items()
                              if key in tensors) for layer in find_moe_layers(model)}
    return sum(_written_bytes(t, dtype) for t in tensors.values()), blocks


def pruned_bytes_lower_bound(model: nn.Module, kept_fraction: float | None, dtype: torch.dtype | None = None) -> int:
    """At least how many bytes ``model``'s tensors take once ``kept_fraction`` of its routed experts is kept (the
    smallest expert of any layer counted for each kept one, a whole router group less for rounding); ``None``: no
    expert counted."""
    total, blocks = model_bytes(model, dtype)
    layers = find_moe_layers(model)
    if not layers or kept_fraction is None:
        return total - sum(blocks.values())
    experts = sum(layer.num_experts for layer in layers)
    kept = max(0, round(kept_fraction * experts) - max(layer.num_groups for layer in layers))
    smallest = min(blocks[layer.name] / layer.num_experts for layer in layers)
    return int(total - sum(blocks.values()) + kept * smallest)


def stored_pruned_bytes_lower_bound(files: list[Path], skeleton: nn.Module, kept_fraction: float | None) -> int:
    """At least how many bytes the pruned weight files of a checkpoint (its safetensors ``files``, ``skeleton`` its
    weightless model) take, written as stored: the files' tensor bytes cut as the skeleton's are
    (:func:`pruned_bytes_lower_bound`). A lower bound wherever the experts take no more bytes per weight in the files
    than the rest does: exactly so in one dtype, and where the experts are quantized and the rest not."""
    stored = sum(end - begin for file in files for begin, end in
                 (entry["data_offsets"] for entry in read_header(file).values()))
    total, _ = model_bytes(skeleton)
    return int(stored * pruned_bytes_lower_bound(skeleton, kept_fraction) / total) if total else stored


__all__ = ["NotEnoughSpaceError", "free_bytes", "model_bytes", "pruned_bytes_lower_bound", "readable_size",
           "require_free_space", "stored_pruned_bytes_lower_bound"]
