"""A pruned checkpoint written from its source files one decoder layer at a time, never holding the model: each
layer is read (as ``from_pretrained`` converts it), cut to the plan's experts (as :func:`~ompmoe.prune` cuts them),
converted back to the file format (as ``save_pretrained`` writes it) and written into safetensors shards by
parallel writers while the next layer is read. The tensors are those ``save_pruned`` writes for the same plan."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..._quiet import quiet_calls
from ..adapters import architecture_of, find_moe_layers, router_extra_rows
from ..fbgemm_fp8 import check_uniform
from ..apply.compensation import (Compensation, _replacements, check_compensation_fits, check_regridable,
                                  compensate_layer, record_compensation)
from ..apply.pruning import _slice_layer, prune
from ..quantized_files import QuantizedCheckpointError
from ..stored_formats import COMPENSATION_STORED, format_name, requantizes, stored_settings
from ..io import atomic_path
from ..lazy_checkpoint import LazyCheckpoint, build_skeleton, checkpoint_dtype, decoder_layers, stacked_file_tensors
from ..planning.plan import PruningPlan
from .checkpoint import save_checkpoint
from .config import load_stock_config
from .load import check_checkpoint_files
from .safetensors_writer import write_safetensors

SHARD_BYTES = 512 * 1024**2
"""A shard is written once it holds this much (whole decoder layers: a big model's layers get a shard each, a small
model one file, as ``save_pretrained`` writes it); while it is written the next layer is read and cut."""
WRITERS = 1
"""Shards written at once beside the reading: one, so memory holds at most one shard being written (it does not grow
with depth)."""


def _file_tensors(model: nn.Module, prefix: str, outside: bool,
                  stacked: dict[str, list[tuple[list[str], int | None, int, int]]] | None = None
                  ) -> dict[str, torch.Tensor]:
    """The model tensors under ``prefix`` (with ``outside``: all the others), in the files' names and layout; the
    fused experts tensors in ``stacked`` (:attr:`~ompmoe.engine.lazy_checkpoint.LazyCheckpoint.stacked_files`) as
    views of their rows, the others as ``save_pretrained`` reverts them."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    stacked = stacked or {}
    state = {name: tensor for name, tensor in model.state_dict().items()
             if name.startswith(prefix) != outside and tensor.device.type != "meta"}
    views = {}
    for name in [name for name in state if name in stacked]:
        views.update(stacked_file_tensors(state.pop(name), stacked[name]))
    state = remove_tied_weights_from_state_dict(state, model)
    reverted = {name: tensor.contiguous() for name, tensor in revert_weight_conversion(model, state).items()}
    return {**reverted, **views}


class _ShardWriter:
    """Groups tensors into shards of at most :data:`SHARD_BYTES` and writes each on a thread as it fills."""

    def __init__(self, directory: Path, shard_bytes: int, workers: int) -> None:
        self.directory, self.shard_bytes = directory, shard_bytes
        self.pool = ThreadPoolExecutor(max_workers=workers)
        self.pending: list[Future] = []
        self.current: dict[str, torch.Tensor] = {}
        self.size = 0
        self.shards: list[list[str]] = []
        self.bytes = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        """One part's tensors (a decoder layer's); the shard is written once it holds :data:`SHARD_BYTES`."""
        for name, tensor in tensors.items():
            self.current[name] = tensor
            self.size += tensor.numel() * tensor.element_size()
            self.bytes += tensor.numel() * tensor.element_size()
        if self.size >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        while len([future for future in self.pending if not future.done()]) >= self.pool._max_workers:
            next(future for future in self.pending if not future.done()).result()  # one shard in memory at a time
        index = len(self.shards)
        self.shards.append(list(self.current))
        path = self.directory / f"model-{index + 1:05d}.part.safetensors"
        self.pending.append(self.pool.submit(write_safetensors, self.current, str(path), metadata={"format": "pt"}))
        self.current, self.size = {}, 0

    def finish(self) -> int:
        """Write the last shard, wait for all, name the shards as ``save_pretrained`` does and write the index;
        returns the bytes written."""
        if self.current or not self.shards:
            self._flush()
        for future in self.pending:
            future.result()
        self.pool.shutdown()
        count = len(self.shards)
        names = (["model.safetensors"] if count == 1 else
                 [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
        for index, name in enumerate(names):
            (self.directory / f"model-{index + 1:05d}.part.safetensors").rename(self.directory / name)
        if count > 1:
            weight_map = {tensor: name for name, tensors in zip(names, self.shards) for tensor in tensors}
            index_file = {"metadata": {"total_size": self.bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.directory / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2) + "\n")
        return self.bytes


def write_pruned_weights(checkpoint: LazyCheckpoint, plan: PruningPlan, directory: Path, *,
                         device: torch.device | str = "cpu", shard_bytes: int = SHARD_BYTES, workers: int = WRITERS,
                         timings: dict[str, float] | None = None, compensation: Compensation | None = None) -> int:
    """The pruned weight files of ``checkpoint``'s model under ``plan`` into ``directory``, layer by layer (the next
    layer read while this one is cut and written); ``compensation`` (fitted for ``plan``) folded into each layer's
    kept rows as :meth:`~ompmoe.engine.apply.compensation.Compensation.apply` folds it (a quantized checkpoint's
    compensated down projections quantized again, the rest as stored). Returns the bytes written."""
    model = checkpoint.model
    if compensation is not None and checkpoint.stored and not requantizes(checkpoint.settings):
        raise QuantizedCheckpointError(COMPENSATION_STORED.format(source=checkpoint.path,
                                                                  format=format_name(checkpoint.settings)))
    prefix, layers = decoder_layers(model)
    spec = architecture_of(model)
    kept = plan.kept_by_layer()
    if checkpoint.settings is not None and checkpoint.settings["quant_method"] == "fbgemm_fp8":
        check_uniform([len(ids) for ids in kept.values()], checkpoint.path)
    moe_layers = find_moe_layers(model)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    names = {id(module): name for name, module in model.named_modules()}
    if compensation is not None and checkpoint.stored:  # the compensated down projections are quantized again
        for layer in moe_layers:
            check_regridable(layer, checkpoint.settings)
        checkpoint.requantize({f"{names[id(layer.experts)]}.down_proj" for layer in moe_layers})
    only_experts = {names[id(layer.experts)]: sorted(kept[layer.name]) for layer in moe_layers}
    # what each written experts row holds: a kept expert, then the rows past them (LongCat's identity experts')
    written_rows = {names[id(layer.experts)]: sorted(kept[layer.name]) + list(range(
        layer.num_experts, layer.num_experts + router_extra_rows(layer.experts, layer.num_experts)))
        for layer in moe_layers}
    # the kept experts are read into tensors of their rows (slicing them then only sets counts); removed: never read
    writer = _ShardWriter(directory, shard_bytes, workers)
    times = timings if timings is not None else {}
    started = time.perf_counter()
    parts = [(prefix, True)] + [(f"{prefix}{index}.", False) for index in range(len(layers))]
    with ThreadPoolExecutor(max_workers=1) as reader, ThreadPoolExecutor(max_workers=1) as hints:
        read = reader.submit(checkpoint.fill, (parts[0][0],), device, dtype, parts[0][1], only_experts)
        for position, (part, outside) in enumerate(parts):
            read.result()
            if position + 2 < len(parts):  # the kernel starts reading the part after the next meanwhile
                ahead, outside_ahead = parts[position + 2]
                hints.submit(checkpoint.read_ahead, (ahead,), outside_ahead, only_experts)
            if position + 1 < len(parts):
                following, outside_next = parts[position + 1]
                read = reader.submit(checkpoint.fill, (following,), device, dtype, outside_next, only_experts)
            for layer in moe_layers:
                if f"{layer.name}.".startswith(part) and not outside:
                    _slice_layer(layer, torch.tensor(sorted(kept[layer.name]), dtype=torch.long),
                                 spec.count_attributes)
                    if compensation is not None:
                        compensate_layer(layer, torch.as_tensor(compensation.scales[layer.name]),
                                         _replacements(compensation.weights, layer.name))
            stacked = {name: checkpoint.stacked_files.pop(name) for name in list(checkpoint.stacked_files)
                       if name.startswith(part) != outside}
            tensors = checkpoint.as_stored(_file_tensors(model, part, outside, stacked), written_rows)
            writer.add({name: tensor.cpu() for name, tensor in tensors.items()})
            if outside:
                checkpoint.empty_outside(part)
            else:
                checkpoint.empty(layers[position - 1])
    written = writer.finish()
    times["write"] = time.perf_counter() - started
    return written


def save_streamed(source: str | os.PathLike, plan: PruningPlan, pruned: nn.Module, directory: Path, *,
                  tokenizer: Any | None = None, calibration: str | None = None, device: torch.device | str = "cpu",
                  timings: dict[str, float] | None = None, compensation: Compensation | None = None
                  ) -> dict[str, Any]:
    """Write into the (empty, temporary) ``directory`` the checkpoint of ``source`` pruned by ``plan``: weights from
    the files layer by layer (``compensation`` folded in), config and the rest from ``pruned``, a weightless
    skeleton :func:`~ompmoe.prune` pruned by the same plan (its record, counts, adaptive settings; with
    ``compensation``, its record too)."""
    config = load_stock_config(source)
    check_checkpoint_files(source, config)  # as load_pruned refuses them, before anything is written
    dtype = checkpoint_dtype(config)
    generation = Path(source) / "generation_config.json"
    if generation.is_file() and getattr(pruned, "generation_config", None) is not None:
        import transformers

        pruned.generation_config = transformers.GenerationConfig.from_pretrained(source)
    pruned.config._name_or_path = str(source)
    quantization = stored_settings(config)
    if quantization is not None:  # the kept tensors are written as stored: the config says how to read them
        pruned.config.quantization_config = quantization
    try:
        with LazyCheckpoint(source, build_skeleton(config, dtype=dtype), dequantized=False) as checkpoint, \
                quiet_calls():
            return save_checkpoint(pruned, directory, tokenizer=tokenizer, calibration=calibration,
                                   write_weights=lambda target: write_pruned_weights(
                                       checkpoint, plan, target, device=device, timings=timings,
                                       compensation=compensation))
    finally:
        if quantization is not None:  # the skeleton computes on dequantized weights (it is the run's model)
            del pruned.config.quantization_config


def save_pruned_from_files(source: str | os.PathLike, plan: PruningPlan, path: str | os.PathLike, *,
                           tokenizer: Any | None = None, overwrite: bool = False, calibration: str | None = None,
                           inputs: Iterable[str | os.PathLike] = (), device: torch.device | str = "cpu",
                           timings: dict[str, float] | None = None, compensation: Compensation | None = None) -> Path:
    """:func:`~ompmoe.save_pruned` of ``source`` (a local safetensors checkpoint) pruned by ``plan``, written
    atomically from its files one decoder layer at a time: the model is never in memory, and the directory is the
    one ``save_pruned(prune(load(source), plan))`` writes (config, tokenizer, remote code, card; the same tensors);
    with ``compensation`` (fitted for ``plan``), the one ``save_pruned(compensation.apply(prune(...)))`` writes."""
    config = load_stock_config(source)
    if (stored := stored_settings(config)) is not None and stored["quant_method"] == "fbgemm_fp8":
        check_uniform([len(kept) for kept in plan.kept_by_layer().values()], source)
    pruned = prune(build_skeleton(config, dtype=checkpoint_dtype(config)), plan)  # config and record, no weights
    if compensation is not None and not requantizes(quantization := stored_settings(config)):
        assert quantization is not None
        raise QuantizedCheckpointError(COMPENSATION_STORED.format(source=source, format=format_name(quantization)))
    if compensation is not None:  # fitted for this plan, or refused before anything is written
        check_compensation_fits(pruned, compensation.scales, compensation.kept, "save_pruned_from_files")
        record_compensation(pruned, compensation.record)
    with atomic_path(path, overwrite=overwrite, directory=True, inputs=[source, *inputs]) as tmp:
        save_streamed(source, plan, pruned, tmp, tokenizer=tokenizer, calibration=calibration, device=device,
                      timings=timings, compensation=compensation)
    return Path(path)


__all__ = ["SHARD_BYTES", "save_pruned_from_files", "save_streamed", "write_pruned_weights"]
