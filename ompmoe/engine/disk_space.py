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
from .io import OutputNotWritableError, existing_ancestor, readable_size
from .lazy_checkpoint import LazyCheckpoint


class NotEnoughSpaceError(OutputNotWritableError):
    """The disk a run writes to has less free space than the run needs; ``errno`` is ENOSPC. ``str()`` is the message
    alone (no ``[Errno 28]``)."""

    def __str__(self) -> str:
        return str(self.strerror)


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes an unprivileged user may still write on the file system ``path`` (or its nearest existing ancestor) is
    on; ``None`` when that cannot be told."""
    path = Path(path).absolute()
    try:
        return shutil.disk_usage(path if path.exists() else existing_ancestor(path)).free
    except OSError:
        return None


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


def _named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t for name, t in module.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}


def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s tensors by state-dict name, each once: tied ones are one object, but a weightless skeleton's output
    embeddings are not yet tied to its input embeddings (one tensor in the files, and in what is written)."""
    seen: set[int] = set()
    tensors = {}
    for name, tensor in _named_tensors(model).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            tensors[name] = tensor
    config = getattr(model, "config", None)
    tied = getattr(config, "tie_word_embeddings", None)
    if tied is None and callable(getattr(config, "get_text_config", None)):
        tied = getattr(config.get_text_config(), "tie_word_embeddings", None)
    if tied and callable(getattr(model, "get_output_embeddings", None)):
        output, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
        if output is not None and embeddings is not None and output.weight is not embeddings.weight:
            tensors = {name: t for name, t in tensors.items() if t is not output.weight}
    return tensors


def _per_expert_names(layer: MoELayer, names: dict[int, str]) -> set[str]:
    """The state-dict names (``names``: the model's, by tensor) of what pruning cuts by expert in one sparse block: its
    experts, its router (all of it: a lower bound where some rows are kept whatever is pruned) and the block's own
    per-expert tensors."""
    cut = [*_named_tensors(layer.experts).values(), *_named_tensors(layer.router).values()]
    own = dict(layer.block.named_parameters(recurse=False)) | dict(layer.block.named_buffers(recurse=False))
    cut += [own[name] for name in block_expert_tensors(layer.block, layer.num_experts)]
    return {names[id(tensor)] for tensor in cut if id(tensor) in names}


def model_bytes(model: nn.Module, dtype: torch.dtype | None = None, sizes: dict[str, int] | None = None
                ) -> tuple[int, dict[str, int]]:
    """``model``'s tensors in bytes as written (floating point in ``dtype`` when given; tied tensors counted once;
    weightless (meta) models too; ``sizes``: each tensor's bytes by name instead, as a checkpoint's files store it),
    and per sparse block the bytes pruning cuts by expert."""
    tensors = _model_tensors(model)
    size = {name: sizes.get(name, 0) if sizes is not None else _written_bytes(t, dtype) for name, t in tensors.items()}
    names = {id(tensor): name for name, tensor in tensors.items()}
    blocks = {layer.name: sum(size[name] for name in _per_expert_names(layer, names))
              for layer in find_moe_layers(model)}
    return sum(size.values()), blocks


def kept_experts_lower_bound(layers: list[MoELayer], kept_fraction: float) -> int:
    """At least how many routed experts a plan keeping ``kept_fraction`` of them keeps: the budget less one router
    group for rounding, or fewer where every layer rounds its own share (the uniform allocation)."""
    budget = round(kept_fraction * sum(layer.num_experts for layer in layers))
    per_layer = sum(layer.num_groups * round(kept_fraction * layer.num_experts / layer.num_groups) for layer in layers)
    return max(0, min(budget - max(layer.num_groups for layer in layers), per_layer))


def pruned_bytes_lower_bound(model: nn.Module, kept_fraction: float | None, dtype: torch.dtype | None = None, *,
                             kept: dict[str, int] | None = None, sizes: dict[str, int] | None = None) -> int:
    """At least how many bytes ``model``'s tensors take (as :func:`model_bytes` counts them) once pruned: ``kept``
    experts per sparse block (a plan's), else ``kept_fraction`` of them over the model (each counted as the smallest
    expert of any layer; ``None``: none counted; so too where ``kept`` names other blocks)."""
    total, blocks = model_bytes(model, dtype, sizes)
    layers = find_moe_layers(model)
    removable = total - sum(blocks.values())
    if kept is not None and all(layer.name in kept for layer in layers):
        return int(removable + sum(kept[layer.name] * blocks[layer.name] / layer.num_experts for layer in layers))
    if not layers or kept_fraction is None:
        return removable
    smallest = min(blocks[layer.name] / layer.num_experts for layer in layers)
    return int(removable + kept_experts_lower_bound(layers, kept_fraction) * smallest)


def stored_pruned_bytes_lower_bound(path: str | os.PathLike, skeleton: nn.Module, kept_fraction: float | None, *,
                                    kept: dict[str, int] | None = None) -> int:
    """:func:`pruned_bytes_lower_bound` of the pruned checkpoint written from the checkpoint at ``path`` as stored
    (``skeleton`` its weightless model): each tensor's bytes in the files (a quantized weight's stored tensors), those
    the model has no place for left out."""
    with LazyCheckpoint(path, skeleton, dequantized=False) as checkpoint:
        sizes = checkpoint.stored_bytes()
    return pruned_bytes_lower_bound(skeleton, kept_fraction, kept=kept, sizes=sizes)


__all__ = ["NotEnoughSpaceError", "free_bytes", "kept_experts_lower_bound", "model_bytes", "pruned_bytes_lower_bound",
           "require_free_space", "stored_pruned_bytes_lower_bound"]
