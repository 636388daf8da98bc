"""A checkpoint read one part at a time: a model skeleton without weights, whose modules are filled from the
safetensors files (through transformers' own key renaming and tensor conversions) and emptied again, so that a model
bigger than memory is handled one decoder layer at a time."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .adapters import experts_count
from .quantized_files import ComputedSlice, QuantizedCheckpointError, UnreadSlice
from .stored_formats import (STORED_ATTR, checkpoint_stored_settings, compute_config, dequantized_slice, format_name,
                             pair_stored, regrid, stored_again, stored_settings)
from .model_classes import default_model_class, runnable_config


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter created inside is put on the meta device (buffers stay real: rotary frequencies and other
    non-persistent buffers are computed once, as the model's own ``__init__`` computes them); no weight is
    initialized. As accelerate's ``init_empty_weights(include_buffers=False)``."""
    from transformers.initialization import no_init_weights

    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            kwargs = dict(requires_grad=param.requires_grad)
            module._parameters[name] = type(param)(module._parameters[name].to("meta"), **kwargs)  # type: ignore[call-arg]

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        with no_init_weights():
            yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def checkpoint_config(path: str | os.PathLike) -> Any:
    """The transformers config of the checkpoint at ``path``, without running remote code; a type transformers knows
    under another name (:data:`~ompmoe.engine.adapters.MODEL_TYPE_ALIASES`: Kimi K2) as that name's; a container
    whose class cannot run as its text model's (:func:`~ompmoe.engine.model_classes.runnable_config`)."""
    import transformers

    from .adapters import with_stock_type

    config_dict, _ = transformers.PreTrainedConfig.get_config_dict(path)
    stock = with_stock_type(config_dict)
    if stock is config_dict:
        return runnable_config(transformers.AutoConfig.from_pretrained(path))
    return transformers.CONFIG_MAPPING[stock["model_type"]].from_dict(stock, name_or_path=str(path))


def checkpoint_dtype(config: Any) -> torch.dtype:
    """The dtype a checkpoint's ``config.json`` records (what ``from_pretrained(dtype="auto")`` loads), float32 when
    it records none."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else torch.float32


def build_skeleton(config: Any, model_class: type | None = None, dtype: torch.dtype | None = None) -> nn.Module:
    """The model ``config`` describes, its parameters on the meta device (no memory, no initialization) and its
    buffers real, in eval mode. A quantized checkpoint's model is built plain, to compute on its weights dequantized
    (:mod:`~ompmoe.engine.stored_formats`); a quantization ompmoe does not read is refused."""
    quantization = stored_settings(config)
    config = compute_config(config)
    model_class = model_class or default_model_class(config)
    with _parameters_on_meta(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_class._from_config(config, dtype=dtype)
    if quantization is not None:
        setattr(model, STORED_ATTR, quantization)
    return model.eval()


def weight_files(path: str | os.PathLike) -> list[Path]:
    """The local ``.safetensors`` files of a checkpoint directory (shards of an index too); [] for anything else."""
    directory = Path(path)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = json.loads(index.read_text()).get("weight_map", {}).values()
        return [directory / name for name in sorted(set(shards))]
    single = directory / "model.safetensors"
    return [single] if single.is_file() else []


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """:func:`weight_files`, or a clear error when a checkpoint has none (layer-by-layer reads only those)."""
    files = weight_files(path)
    if not files:
        raise FileNotFoundError(f"{path} has no safetensors weights (model.safetensors or "
                                "model.safetensors.index.json); layer-by-layer calibration reads only those. Convert "
                                "the checkpoint with save_pretrained(..., safe_serialization=True).")
    return files


class LazyCheckpoint:
    """The tensors of a checkpoint opened lazily (memory-mapped, nothing read until a module is filled) and the
    model skeleton they fill: :meth:`fill` materializes the modules under a prefix, :meth:`empty` frees them."""

    def __init__(self, path: str | os.PathLike, model: nn.Module, dequantized: bool = True) -> None:
        """``dequantized=False`` (the pruned writer): a quantized checkpoint's quantized weights are not read into the
        model (its tensors there are placeholders of their shape); :meth:`as_stored` reads what is written."""
        from safetensors import safe_open
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        self.path, self.model = Path(path), model
        files = checkpoint_files(path)
        self._files = [safe_open(str(file), framework="pt", device="cpu") for file in files]
        self.slices = {key: handle.get_slice(key) for handle in self._files for key in handle.keys()}
        settings = checkpoint_stored_settings(path)
        self.settings = settings
        """The files' ``quantization_config`` (:func:`~ompmoe.engine.stored_formats.stored_settings`), else None."""
        self.stored = pair_stored({key: part.get_dtype() for key, part in self.slices.items()},
                                  {key: part.get_shape() for key, part in self.slices.items()}, settings, path)
        """``{quantized weight: {suffix: its file tensors}}`` of a quantized checkpoint
        (:mod:`~ompmoe.engine.stored_formats`): the model is filled with their dequantized values; :meth:`as_stored`
        gives back the stored ones to write."""
        self.stored_parts = {key: self.slices.pop(key) for parts in self.stored.values() for key in parts.values()}
        """The quantized weights' stored tensors' own slices (the bytes :meth:`as_stored` writes)."""
        self.stored_shapes: dict[str, list[int]] = {}
        """Each quantized weight's shape in the model (dequantized)."""
        for weight, parts in self.stored.items():
            stored = {suffix: self.stored_parts[key] for suffix, key in parts.items()}
            values = dequantized_slice(weight, stored, settings)
            self.stored_shapes[weight] = values.get_shape()
            self.slices[weight] = values if dequantized else UnreadSlice(values.get_shape())
        self.unread = bool(self.stored) and not dequantized
        self.requantized: set[str] = set()
        """Quantized weights the model holds dequantized and :meth:`as_stored` quantizes again (:meth:`requantize`)."""
        self.written_from: dict[str, str] = {}
        """Per-expert file name written -> the file tensor it was read from (a kept expert renumbered)."""
        self._ranges = _byte_ranges(files)
        # Direct reads (preadv) and read-ahead hints where the platform has both and stores little-endian like the
        # files; elsewhere the fill copies from the memory map, which safetensors byte-swaps where needed.
        direct = hasattr(os, "posix_fadvise") and hasattr(os, "preadv") and sys.byteorder == "little"
        self._descriptors = {file: os.open(file, os.O_RDONLY) for file in files} if direct else {}
        self.mapping = get_model_conversion_mapping(model)
        renamings = [entry for entry in self.mapping if isinstance(entry, WeightRenaming)]
        converters = [entry for entry in self.mapping if isinstance(entry, WeightConverter)]
        expected = model.state_dict()
        self.target, self.pattern = {}, {}
        for key in self.slices:  # the model tensor each file tensor loads into, as from_pretrained renames it
            renamed, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, expected)
            if renamed not in expected and key in expected:
                renamed, pattern = key, None
            self.target[key], self.pattern[key] = renamed, pattern
        self.converters = {pattern: converter for converter in converters for pattern in converter.source_patterns}
        sources: dict[str, list[str]] = {}
        for key, target in self.target.items():
            if key != target:
                sources.setdefault(target, []).append(key)
        self.renamed_from = {target: keys[0] for target, keys in sources.items() if len(keys) == 1}
        """Model tensor -> the one file tensor renamed into it (a container read as its text model)."""
        self._refuse_quantized_routers()
        self.used: list[Any] = []
        self.stacked_files: dict[str, list[tuple[list[str], int | None, int, int]]] = {}
        """Per fused experts tensor filled from per-expert file tensors: for each of its source patterns, the file
        names of experts ``0..rows-1`` and where that pattern's part lies in a row (axis, offset, size): what
        ``save_pretrained`` writes back for each row, as views (:func:`stacked_file_tensors`)."""

    def requantize(self, targets: set[str]) -> None:
        """Fill the quantized weights that load into the model tensors ``targets`` with their dequantized values, and
        write them quantized again from what the model then holds (a compensation's down projections; the writer's
        other quantized weights stay as stored; a format ompmoe does not quantize again is refused by
        :func:`~ompmoe.engine.stored_formats.stored_again`)."""
        weights = {key for key in self.stored if self.target[key] in targets}
        for weight in weights:
            self.slices[weight] = dequantized_slice(weight, self._parts(weight), self.settings)
        self.requantized |= weights

    def grid(self, target: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What values computed for the model tensor ``target`` (per expert, ``[..., rows, cols]`` as the files store
        each) read back as once :meth:`requantize` has written them quantized again; ``None`` where the files store
        ``target`` in full precision (written as computed)."""
        weights = sorted(key for key in self.stored if self.target[key] == target)
        if not weights:
            return None
        shape, read_back = self.stored_shapes[weights[0]][-2:], regrid(weights[0], self._parts(weights[0]),
                                                                        self.settings)

        def grid(values: torch.Tensor) -> torch.Tensor:
            if list(values.shape[-2:]) != list(shape):  # not the files' layout: the blocks would fall elsewhere
                raise QuantizedCheckpointError(f"{self.path}: {target} rows {list(values.shape[-2:])} are not "
                                               f"{weights[0]} {list(shape)}; they cannot be quantized again as "
                                               "stored.")
            rounded = torch.empty_like(values)  # one matrix at a time: float32 copies of one expert's, not all
            for matrix, out in zip(values.reshape(-1, *shape), rounded.view(-1, *shape)):
                out.copy_(read_back(matrix))
            return rounded

        return grid

    def _parts(self, weight: str) -> dict[str, Any]:
        """A quantized weight's stored tensors' slices, by suffix."""
        return {suffix: self.stored_parts[key] for suffix, key in self.stored[weight].items()}

    def keys_under(self, prefixes: tuple[str, ...], outside: bool = False) -> list[str]:
        """The file tensors that load into model tensors under any of ``prefixes`` (with ``outside``: under none)."""
        return [key for key, target in self.target.items() if target.startswith(prefixes) != outside]

    def fill(self, prefixes: tuple[str, ...], device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
             outside: bool = False, only_experts: dict[str, list[int]] | None = None) -> None:
        """Materialize the model tensors under ``prefixes`` (with ``outside``: all the others) from the files on
        ``device``, converted exactly as ``from_pretrained`` converts them (fused experts, renamed keys); ``dtype``
        as ``from_pretrained``'s. ``only_experts`` maps an experts module's name to the (ascending) experts to read:
        its tensors stored per expert are filled with those experts' rows only, the others never read (the pruned
        writer reads only what it writes; its tensors stored otherwise are filled whole, for the caller to slice)."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        keys = self.keys_under(prefixes, outside)
        stacked, rest = self._stacked(keys)
        self._read_ahead(keys, only_experts or {})
        for target, (converter, groups) in stacked.items():
            module_name = target.rpartition(".")[0]
            self._fill_stacked(target, converter, groups, device, (only_experts or {}).get(module_name))
        part = {key: self.slices[key] for key in rest}
        config = LoadStateDictConfig(weight_mapping=self.mapping, dtype=dtype, device_map={"": device},
                                     dtype_plan=self.model._get_dtype_plan(dtype) if dtype is not None else {})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            info, _ = convert_and_load_state_dict_in_model(self.model, part, config)
        for conversion in getattr(self.model, "_weight_conversions", []) or []:
            if not any(conversion is seen for seen in self.used):
                self.used.append(conversion)
        self.model._weight_conversions = [entry for entry in self.mapping if any(entry is seen for seen in self.used)]
        if info.mismatched_keys or info.conversion_errors:
            problems = sorted(info.mismatched_keys) or sorted(info.conversion_errors)
            raise ValueError(f"{self.path} does not match the model under {', '.join(prefixes)}: {problems[:5]}.")
        self._refuse_unfilled(prefixes, outside)

    def _refuse_unfilled(self, prefixes: tuple[str, ...], outside: bool) -> None:
        """A parameter the fill left on the meta device has no tensor in the files: the part would compute on
        nothing (NaN statistics, a checkpoint written without it). Refused by name; a head tied to the embeddings
        (no tensor of its own, tied after the fill) aside."""
        tied = dict(getattr(self.model, "all_tied_weights_keys", None) or {})  # head -> embeddings
        unfilled = [name for name, parameter in self.model.named_parameters(remove_duplicate=False)
                    if name.startswith(prefixes) != outside and parameter.device.type == "meta" and name not in tied]
        stored_heads = [head for head, source in tied.items() if source in unfilled and head in self.target.values()]
        if stored_heads:  # transformers ties either way; a skeleton reads each side from its own tensor
            raise ValueError(f"{self.path} stores the tied {stored_heads[0]} but not {tied[stored_heads[0]]}, which "
                             "layer-by-layer reads the embeddings from. Save the checkpoint again with "
                             "save_pretrained (it stores the embeddings), or calibrate it resident.")
        if unfilled:
            raise ValueError(f"{self.path} holds no tensor for {len(unfilled)} parameters of the model "
                             f"({', '.join(unfilled[:3])}{', ...' if len(unfilled) > 3 else ''}): the checkpoint's "
                             "files are incomplete. Copy or download the checkpoint again.")

    def read_ahead(self, prefixes: tuple[str, ...], outside: bool = False,
                   only_experts: dict[str, list[int]] | None = None) -> None:
        """:meth:`fill`'s reads of the same part, started in the kernel without waiting (call it a part ahead)."""
        self._read_ahead(self.keys_under(prefixes, outside), only_experts or {})

    def _read_ahead(self, keys: list[str], only_experts: dict[str, list[int]]) -> None:
        """Ask the kernel to start reading every byte range the fill will copy (only the kept experts' of a tensor
        stored per expert) at once: the reads are queued together instead of one page fault at a time, which on a
        disk with latency (network block storage) is what bounds the fill."""
        if not self._descriptors:
            return
        skipped = set()
        for module_name, experts in only_experts.items():
            kept = {str(expert) for expert in experts}
            for key in keys:
                target_module = self.target[key].rpartition(".")[0]
                if target_module == module_name and (expert := _expert_of(key)) is not None and expert not in kept:
                    skipped.add(key)
        for key in keys:
            if key not in skipped and key in self._ranges:
                file, start, length = self._ranges[key]
                if length > 0:  # a length of 0 would ask for the rest of the file
                    with contextlib.suppress(OSError):  # only a hint: the fill reads the bytes either way
                        os.posix_fadvise(self._descriptors[file], start, length, os.POSIX_FADV_WILLNEED)

    def _stacked(self, keys: list[str]) -> tuple[dict[str, tuple[Any, dict[str, list[str]]]], list[str]]:
        """The file tensors that merely stack into a fused experts tensor (transformers' ``MergeModulelist``, then at
        most a ``Concatenate`` of the stacks: Qwen3-MoE's gate and up projections), grouped by model tensor and
        pattern; and the other keys, left to transformers' conversion."""
        stacked: dict[str, tuple[Any, dict[str, list[str]]]] = {}
        rest = []
        for key in keys:
            converter = self.converters.get(self.pattern[key]) if self.pattern[key] is not None else None
            if converter is None or _stack_then_concat(converter) is False:
                rest.append(key)
                continue
            stacked.setdefault(self.target[key], (converter, {}))[1].setdefault(self.pattern[key], []).append(key)
        return stacked, rest

    def _fill_stacked(self, target: str, converter: Any, groups: dict[str, list[str]], device: Any,
                      experts: list[int] | None = None) -> None:
        """Read each expert's tensor straight into its place in the fused tensor: the values transformers' stack and
        concatenation give, without holding the per-expert copies and the stacks (about 2.5x the layer) at once.
        With ``experts``, only those experts' tensors are read, into a tensor of their rows."""
        from transformers.core_model_loading import dot_natural_key

        module_name, _, name = target.rpartition(".")
        module = self.model.get_submodule(module_name)
        empty = module._parameters[name]
        whole = experts is not None and empty.shape[0] != experts_count(module)
        if whole:  # rows past the routed experts (LongCat's identity experts'): read whole, for the caller to slice
            experts = None  # (a cut one could pass for the uncut size); its rows are the caller's to renumber
        rows = list(range(empty.shape[0])) if experts is None else list(experts)
        fused = torch.empty((len(rows), *empty.shape[1:]), dtype=empty.dtype, device=device)
        axis, offset = _stack_then_concat(converter), 0  # the concatenation's axis within one expert's tensor
        layout = []
        for pattern in converter.source_patterns:
            keys = sorted(groups.get(pattern, []), key=dot_natural_key)
            if len(keys) != empty.shape[0]:
                raise ValueError(f"{self.path} holds {len(keys)} tensors {pattern} for {target}, which has "
                                 f"{empty.shape[0]} experts.")
            size = 0
            for row, expert in enumerate(rows):
                key = keys[expert]
                shape = list(self.slices[key].get_shape())
                size = shape[axis] if axis is not None else 0
                where = fused[row] if axis is None else fused[row].narrow(axis, offset, size)
                if tuple(where.shape) != tuple(shape):
                    raise ValueError(f"{self.path} does not match the model: {key} {shape} does not fit "
                                     f"{target} {list(empty.shape)}.")
                if not self._read_into(where, key):
                    where.copy_(self.slices[key][:])
                if not whole:
                    self.written_from[keys[row]] = key
            layout.append((keys[:len(rows)], axis, offset, size))
            offset += size
        self.stacked_files[target] = layout
        module._parameters[name] = nn.Parameter(fused, requires_grad=empty.requires_grad)
        if not any(converter is seen for seen in self.used):
            self.used.append(converter)

    def _read_into(self, where: torch.Tensor, key: str, stored: bool = False, rows: list[int] | None = None) -> bool:
        """Read ``key``'s bytes from its file straight into ``where`` (host memory, contiguous, the file's dtype):
        one copy from the page cache, no page faults on a memory map and no intermediate tensor; with ``rows``, only
        those rows of its first axis (a fused experts tensor's kept experts). ``False`` where that does not apply
        (the caller copies the tensor instead)."""
        part = self.stored_parts[key] if stored else self.slices[key]  # stored: a quantized tensor's own bytes
        computed = isinstance(part, ComputedSlice)  # values that are not the file's bytes
        if (not self._descriptors or where.device.type != "cpu" or not where.is_contiguous() or computed
                or _FILE_DTYPES.get(part.get_dtype()) != where.dtype):
            return False
        file, start, length = self._ranges[key]
        row_bytes = length // part.get_shape()[0] if rows is not None else length
        spans = [(start + row * row_bytes, row_bytes) for row in rows] if rows is not None else [(start, length)]
        if sum(size for _, size in spans) != where.numel() * where.element_size():
            return False
        buffer = memoryview(where.view(-1).view(torch.uint8).numpy())
        at = 0
        for offset, size in spans:
            done = 0
            while done < size:
                count = os.preadv(self._descriptors[file], [buffer[at + done:at + size]], offset + done)
                if count <= 0:
                    raise OSError(f"{file} ended inside tensor {key}: the file is truncated.")
                done += count
            at += size
        return True

    def as_stored(self, tensors: dict[str, torch.Tensor], kept: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """A part's file tensors (named as the files name them, values as the model holds them) with every quantized
        weight as the files store it (block FP8: the weight beside its scales; MXFP4: its blocks and scales): a kept
        expert's read from its source tensors, a fused experts tensor cut to ``kept`` (experts module name -> kept
        experts) as the model's was. Unchanged for a full-precision checkpoint."""
        if not self.stored:
            return tensors
        stored = {}
        for name, value in tensors.items():
            source = self._source_of(name, kept)
            if source not in self.stored:
                if self.unread and value.is_floating_point() and bool(value.isnan().any()):
                    raise RuntimeError(f"{self.path}: {name} would be written from a placeholder of quantized "
                                       "weights it does not name; this layout cannot be written as stored. Please "
                                       "report it.")
                stored[name] = value
                continue
            shape, rows = self.stored_shapes[source], None
            if list(value.shape) != shape:  # a fused experts tensor of the files, cut to the kept experts
                rows = kept.get(self.target[source].rpartition(".")[0])
                if rows is not None and len(rows) > value.shape[0]:  # the rows past the experts (identity
                    rows = rows[:value.shape[0]]  # experts') are on tensors that have them only
                if rows is None or len(rows) != value.shape[0] or shape[1:] != list(value.shape[1:]):
                    raise ValueError(f"{self.path}: {name} {list(value.shape)} is not {source} {shape} cut to kept "
                                     "experts; it cannot be written as stored.")
            if source in self.requantized:  # changed by a compensation: quantized from what the model holds
                stored.update(stored_again(name, source, value, self._parts(source), self.settings))
                continue
            parts = {suffix: self._read_stored(key, rows) for suffix, key in self.stored[source].items()}
            stored.update({name + suffix: tensor for suffix, tensor in parts.items()})
        return stored

    def _source_of(self, name: str, kept: dict[str, list[int]]) -> str:
        """The file tensor a written tensor was read from: for a per-expert name under an experts module cut to
        ``kept``, the kept expert it renumbers (the plan's, checked against what the fill read); for a model tensor
        the files name otherwise (a container read as its text model: ``language_model.model.*`` -> ``model.*``),
        the file tensor renamed into it; else itself."""
        if name not in self.target and name in self.renamed_from:
            return self.renamed_from[name]
        expert, target = _expert_of(name), self.target.get(name)
        module = next((module for module in kept if target is not None and target.startswith(f"{module}.")), None)
        if expert is None or module is None:
            return name
        rows = kept[module]
        parts = name.split(".")
        at = next(i for i in range(len(parts) - 1) if parts[i] == "experts" and parts[i + 1] == expert)
        source = (".".join([*parts[:at + 1], str(rows[int(expert)]), *parts[at + 2:]]) if int(expert) < len(rows)
                  else None)
        if source is None or self.written_from.get(name, source) != source:
            raise RuntimeError(f"{self.path}: {name} is expert {expert} of {len(rows)} kept in {module}, but the fill "
                               f"read it from {self.written_from.get(name)}; it cannot be written as stored.")
        return source

    def _refuse_quantized_routers(self) -> None:
        """A router stored quantized cannot be cut to the kept experts' rows as stored (FP8 blocks span experts):
        refused when the checkpoint is opened. The releases keep their routers in full precision."""
        from .adapters import find_moe_layers

        names = {id(module): name for name, module in self.model.named_modules()}
        routers = tuple(f"{names[id(layer.router)]}." for layer in find_moe_layers(self.model)
                        if id(layer.router) in names)
        stored = sorted(key for key in self.stored if routers and self.target[key].startswith(routers))
        if stored:
            name = format_name(self.settings)
            raise QuantizedCheckpointError(
                f"{self.path} stores {name} routers ({stored[0]}{', ...' if len(stored) > 1 else ''}): "
                f"cutting a router to the kept experts' rows would split its blocks. ompmoe reads {name} checkpoints "
                "whose routers are full precision, as the releases store them.")

    def _read_stored(self, key: str, rows: list[int] | None = None) -> torch.Tensor:
        """A quantized weight's stored tensor as the files store it, or only ``rows`` of its first axis (read directly
        where :meth:`_read_into` can: the removed experts' bytes are never read)."""
        part = self.stored_parts[key]
        shape = part.get_shape()
        tensor = torch.empty([len(rows), *shape[1:]] if rows is not None else shape,
                             dtype=_FILE_DTYPES[part.get_dtype()])
        if self._read_into(tensor, key, stored=True, rows=rows):
            return tensor
        return part[:] if rows is None else part[:][torch.tensor(rows, dtype=torch.long)]

    def empty(self, module: nn.Module) -> None:
        """Put ``module``'s parameters and persistent buffers back on the meta device (its memory is freed)."""
        for child in module.modules():
            _empty_own(child)

    def empty_outside(self, prefix: str) -> None:
        """:meth:`empty` every module of the model not under ``prefix`` (the decoder layers)."""
        for name, module in self.model.named_modules():
            if not f"{name}.".startswith(prefix):
                _empty_own(module)

    def stored_bytes(self) -> dict[str, int]:
        """The bytes each model tensor takes in the files (a quantized weight: its stored tensors), by the name it
        loads into; file tensors the model has no place for (multi-token-prediction layers) are left out."""
        lengths = {key: length for key, (_, _, length) in self._ranges.items()}
        expected = set(self.model.state_dict())
        sizes: dict[str, int] = {}
        for key in self.slices:
            target = self.target[key]
            if target in expected:
                parts = self.stored.get(key)
                size = sum(lengths[part] for part in parts.values()) if parts else lengths[key]
                sizes[target] = sizes.get(target, 0) + size
        return sizes

    def close(self) -> None:
        self._files.clear()
        self.slices.clear()
        self.stored_parts.clear()
        for descriptor in self._descriptors.values():
            os.close(descriptor)
        self._descriptors.clear()

    def __enter__(self) -> LazyCheckpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_FILE_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                "F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8, "I8": torch.int8, "I32": torch.int32,
                "I64": torch.int64}
"""Safetensors dtypes read straight into a tensor's memory (:meth:`LazyCheckpoint._read_into`)."""


def stacked_file_tensors(tensor: torch.Tensor, layout: list[tuple[list[str], int | None, int, int]]
                         ) -> dict[str, torch.Tensor]:
    """The per-expert file tensors of a fused experts ``tensor`` filled by :meth:`LazyCheckpoint.fill`, named as the
    files name experts ``0..rows-1`` (``layout``: :attr:`LazyCheckpoint.stacked_files`): views of its rows, no copy
    (``revert_weight_conversion`` gives the same values, copying a concatenation's halves)."""
    tensors = {}
    for names, axis, offset, size in layout:
        for row, name in enumerate(names[:tensor.shape[0]]):
            tensors[name] = tensor[row] if axis is None else tensor[row].narrow(axis, offset, size)
    return tensors


def _byte_ranges(files: list[Path]) -> dict[str, tuple[Path, int, int]]:
    """Each tensor's ``(file, offset, length)`` in bytes, from the files' headers."""
    ranges = {}
    for file in files:
        with open(file, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(length))
        for key, entry in header.items():
            if key != "__metadata__":
                begin, end = entry["data_offsets"]
                ranges[key] = (file, 8 + length + begin, end - begin)
    return ranges


def _expert_of(key: str) -> str | None:
    """The expert number in a per-expert file key (``...experts.17.down_proj.weight`` -> ``"17"``), if any."""
    parts = key.split(".")
    for index, part in enumerate(parts[:-1]):
        if part == "experts" and parts[index + 1].isdigit():
            return parts[index + 1]
    return None


def _stack_then_concat(converter: Any) -> int | None | bool:
    """For a converter that stacks per-expert tensors and maybe concatenates the stacks: the concatenation's axis
    within one expert's tensor, ``None`` when it only stacks; ``False`` for any other conversion."""
    operations = list(getattr(converter, "operations", []))
    names = [type(operation).__name__ for operation in operations]
    if names == ["MergeModulelist"] and operations[0].dim == 0 and len(converter.source_patterns) == 1:
        return None
    if names == ["MergeModulelist", "Concatenate"] and operations[0].dim == 0 and operations[1].dim >= 1:
        return operations[1].dim - 1
    return False


def _empty_own(module: nn.Module) -> None:
    for name, parameter in list(module._parameters.items()):
        if parameter is not None and parameter.device.type != "meta":
            module._parameters[name] = nn.Parameter(torch.empty_like(parameter, device="meta"),
                                                    requires_grad=parameter.requires_grad)
    for name, buffer in list(module._buffers.items()):
        if buffer is not None and name not in module._non_persistent_buffers_set and buffer.device.type != "meta":
            module._buffers[name] = torch.empty_like(buffer, device="meta")


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(prefix, layers)`` of the text decoder's layer list (``model.layers`` of a causal LM, the language model's
    in a multimodal container): what layer-by-layer calibration runs one at a time."""
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else model
    if decoder is model and isinstance(getattr(model, "model", None), nn.Module):  # Llama4ForCausalLM's answers
        decoder = model.model  # itself (its base_model_prefix names a language_model it does not have)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no decoder layer list (`.layers` of {type(decoder).__name__}); "
                         "layer-by-layer calibration needs one. Calibrate it resident instead.")
    name = next(name for name, module in model.named_modules() if module is layers)
    return name + ".", layers
