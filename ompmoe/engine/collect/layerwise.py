"""Statistics of a model bigger than memory, one decoder layer at a time (layer-major order): every calibration
block's hidden states go through layer l, then layer l + 1, each layer's weights read from the checkpoint once and
freed after it; memory holds two layers (the one computing, the next being read) and the hidden states.

The sums are the resident pass's: the same collector hooks on the same expert modules see the same inputs (the
layers run as the model's own forward calls them, with the keyword arguments it passes them, recorded once, and
with the state a layer hands the next one beside its hidden states: :data:`CARRIED_STATE`)."""

from __future__ import annotations

import ctypes
import functools
import inspect
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..._quiet import quiet_calls
from ..adapters import MoELayer
from ..disk_space import require_free_space
from ..io import readable_size
from ..lazy_checkpoint import LazyCheckpoint, build_skeleton, checkpoint_config, checkpoint_dtype, decoder_layers
from ..progress import progress as progress_bar
from .collector import StatisticsCollector, as_model_inputs, batch_token_weight, check_calibration_inputs
from .statistics import MoEStats

CARRIED_STATE = ("prev_topk_indices", "prev_router_hidden_states")
"""Decoder-layer arguments that take the previous layer's second output, which such a layer returns beside its hidden
states: the top-k of the DSA indexers a layer may reuse (GLM-5, GLM-5-Next, Mistral Large 4, HY-V4) and Zaya's
router state. Layer by layer hands each layer's to the next, as the model's forward does."""


def _parameter_names(layer: nn.Module) -> list[str]:
    """The names of ``layer``'s forward arguments after ``self``, in order."""
    return list(inspect.signature(type(layer).forward).parameters)[1:]


def carried_state(layer: nn.Module) -> tuple[str, int] | None:
    """``(name, position)`` of ``layer``'s argument of :data:`CARRIED_STATE` (its position among the forward's
    arguments after ``self``), or ``None`` for a layer that returns its hidden states alone."""
    names = _parameter_names(layer)
    return next(((name, names.index(name)) for name in CARRIED_STATE if name in names), None)


class LayerwiseUnsupportedError(ValueError):
    """A model whose decoder layers cannot run one at a time from recorded inputs."""


class _Recorded(Exception):
    """Raised by the output head's stand-in (or the last layer's, without a head): every layer call is recorded."""


class _NotHandedOn(Exception):
    """Raised by a layer's recorder given other hidden states than the previous recorder returned."""


class _OutOfOrder(Exception):
    """Raised by a layer's recorder called before the previous layers, or again (a looped model)."""


RECORDINGS_APART = 1.0
"""What the second recording adds to each layer's stand-in output: an argument that differs between the two
recordings is computed from earlier layers' outputs."""


def _record_layer_calls(model: nn.Module, layers: nn.ModuleList, inputs: dict[str, torch.Tensor]
                        ) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The ``(args, kwargs)`` the model's forward calls each decoder layer with on ``inputs`` (masks, position
    embeddings, ...; the hidden states and the carried state only of the first layer are real), without running
    any layer. Replaying them is the model's forward only where each layer takes its hidden states from the one
    before and nothing else from the layers' outputs (but :data:`CARRIED_STATE`), each layer once and in order: the
    forward is recorded twice, the layers' stand-in outputs apart by :data:`RECORDINGS_APART`, and an argument that
    differs between the two (Inkling2's attention-residual block states), a layer called out of order or again (a
    looped model) or hidden states changed between layers are refused."""
    first = _record_once(model, layers, inputs, 0.0)
    second = _record_once(model, layers, inputs, RECORDINGS_APART)
    for index, (layer, ours, again) in enumerate(zip(layers, first, second)):
        differing = _differing(_other_arguments(ours, layer), _other_arguments(again, layer))
        if differing:
            raise LayerwiseUnsupportedError(
                f"{type(model).__name__}'s forward computes decoder layer {index}'s {', '.join(differing)} from the "
                "outputs of the layers before it; layer-by-layer calibration cannot run them one at a time. "
                "Calibrate it resident instead.")
    return first


def _record_once(model: nn.Module, layers: nn.ModuleList, inputs: dict[str, torch.Tensor], shift: float
                 ) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """One recording of the layer calls, each layer's stand-in output its input hidden states plus ``shift`` (the
    input itself for 0: the calls then share the first layer's; otherwise they keep none, only one layer's hidden
    states alive at a time); stopped where the output head is called."""
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    handed: list[torch.Tensor] = []  # what the last recorder returned as the hidden states
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None

    def recorder(*args: Any, index: int, carries: bool, **kwargs: Any) -> Any:
        if index != len(calls):
            raise _OutOfOrder(index)
        hidden = _hidden_of((args, kwargs))
        if handed and hidden is not handed[-1]:  # replaying would feed the layer what the model did not
            raise _NotHandedOn
        calls.append(_with_hidden((args, kwargs), None) if shift else (args, kwargs))  # type: ignore[arg-type]
        if head is None and len(calls) == len(layers):
            raise _Recorded
        handed[:] = [hidden + shift if shift else hidden]
        return (handed[-1], None) if carries else handed[-1]

    def stop(*args: Any, **kwargs: Any) -> Any:
        raise _Recorded

    for index, layer in enumerate(layers):
        layer.forward = functools.partial(recorder, index=index, carries=carried_state(layer) is not None)
    if head is not None:
        head.forward = stop
    name = type(model).__name__
    try:
        with torch.no_grad():
            model(**inputs, use_cache=False)
    except _Recorded:
        pass
    except _OutOfOrder as called:
        raise LayerwiseUnsupportedError(
            f"{name}'s forward calls decoder layer {called.args[0]} after layer {len(calls) - 1} (it runs layers "
            "again, in a loop, or out of order); layer-by-layer calibration runs each layer once, in order. "
            "Calibrate it resident instead.") from None
    except _NotHandedOn:
        raise LayerwiseUnsupportedError(
            f"{name}'s forward does not hand decoder layer {len(calls) - 1}'s hidden states to layer "
            f"{len(calls)} as they are (it changes them between layers, or its layers pass on more than ompmoe "
            f"carries: {', '.join(CARRIED_STATE)}); layer-by-layer calibration cannot run them one at a time. "
            "Calibrate it resident instead.") from None
    except Exception as error:  # noqa: BLE001 - a forward that needs more of its layers than their hidden states
        if len(calls) < len(layers):
            raise LayerwiseUnsupportedError(
                f"{name}'s decoder layers pass more than the hidden states on to the next layer (its forward failed "
                f"after {len(calls)} of {len(layers)} layers: {type(error).__name__}: {error}); layer-by-layer "
                "calibration cannot run them one at a time. Calibrate it resident instead.") from None
        # every layer was called: what the forward does after them is not recorded (replay runs it for real)
    finally:
        for layer in layers:
            del layer.forward
        if head is not None:
            del head.forward
    if len(calls) != len(layers):
        raise LayerwiseUnsupportedError(f"{name}'s forward called {len(calls)} of its {len(layers)} decoder layers; "
                                        "layer-by-layer calibration cannot run it. Calibrate it resident instead.")
    return calls


def _other_arguments(call: tuple[tuple[Any, ...], dict[str, Any]], layer: nn.Module) -> dict[str, Any]:
    """A recorded call of ``layer``'s arguments but its hidden states and carried state, by name."""
    args, kwargs = call
    names = _parameter_names(layer)
    positional = {names[position] if position < len(names) else f"argument {position}": value
                  for position, value in enumerate(args) if position > 0}
    skipped = {"hidden_states", *CARRIED_STATE}
    return {key: value for key, value in {**positional, **kwargs}.items() if key not in skipped}


def _differing(ours: dict[str, Any], again: dict[str, Any]) -> list[str]:
    """The names whose values hold tensors that differ between two recordings (nested tuples, lists and dicts)."""
    def tensors(value: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
        if isinstance(value, torch.Tensor):
            yield path, value
        elif isinstance(value, (tuple, list)):
            for position, item in enumerate(value):
                yield from tensors(item, f"{path}[{position}]")
        elif isinstance(value, dict):
            for key, item in value.items():
                yield from tensors(item, f"{path}[{key!r}]")

    differing = []
    for name in ours:
        left, right = dict(tensors(ours[name], "")), dict(tensors(again.get(name), ""))
        if left.keys() != right.keys() or any(
                left[key].shape != right[key].shape or not torch.equal(left[key], right[key]) for key in left):
            differing.append(name)
    return differing


def _hidden_of(call: tuple[tuple[Any, ...], dict[str, Any]]) -> torch.Tensor:
    args, kwargs = call
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(call: tuple[tuple[Any, ...], dict[str, Any]], hidden: torch.Tensor) -> tuple[tuple[Any, ...],
                                                                                                dict[str, Any]]:
    args, kwargs = call
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _with_state(call: tuple[tuple[Any, ...], dict[str, Any]], argument: tuple[str, int], state: Any
                ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``call`` with its carried-state argument (``(name, position)``, :func:`carried_state`) set to ``state``."""
    (args, kwargs), (name, position) = call, argument
    if name in kwargs or position >= len(args):
        return args, {**kwargs, name: state}
    return (*args[:position], state, *args[position + 1:]), kwargs


class LayerMajor:
    """Named sets of token batches (streams) carried through a checkpoint's decoder layers one layer at a time, in
    layer-major order: :meth:`each_layer` reads each layer once (the next one while this one computes) and frees it
    after the caller ran the streams it wants through it (:meth:`run`); :meth:`next_token_loss` ends a stream with
    the model's own head. What runs before the first layer (embeddings, rotary) is filled at the start; the output
    head only when a loss needs it."""

    def __init__(self, checkpoint: LazyCheckpoint, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                 hidden_device: torch.device | str | None = None) -> None:
        model = checkpoint.model
        self.checkpoint, self.model = checkpoint, model
        self.dtype = dtype or next(p.dtype for p in model.parameters() if p.is_floating_point())
        self.device, self.hidden_device = torch.device(device), torch.device(hidden_device or device)
        self.prefix, self.layers = decoder_layers(model)
        self.carried = [carried_state(layer) for layer in self.layers]
        head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
        self.head = tuple(f"{name}." for name, module in model.named_modules() if head is not None and module is head)
        # all but the layers and the output head, which the recorded forward never reaches (it stops at the last layer)
        checkpoint.fill((self.prefix, *self.head), self.device, self.dtype, outside=True)
        self.inputs: dict[str, list[dict[str, torch.Tensor]]] = {}
        self.calls: dict[str, list[list[tuple[tuple[Any, ...], dict[str, Any]]]]] = {}
        self.hidden: dict[str, list[torch.Tensor]] = {}
        self.state: dict[str, list[Any]] = {}  # per stream and batch: what the last layer run hands the next
        self.kept: dict[str, dict[int, list[tuple[torch.Tensor, Any]] | Path]] = {}
        """Per stream (:meth:`keep_inputs`), per decoder layer, each batch's ``(hidden states, carried state)`` as
        that layer took them: what a backward through the layers recomputes each one from."""
        self.kept_bytes: dict[str, dict[str, int]] = {}
        """Per stream, the bytes kept so far: ``{"memory": ..., "disk": ...}`` (and ``"disk_layers"``)."""
        self._keep_from: dict[str, int] = {}
        self._keep_budget: dict[str, tuple[float, Callable[[], Path] | None]] = {}

    def add(self, name: str, batches: Iterable[Any]) -> list[dict[str, torch.Tensor]]:
        """A stream of ``batches`` (token ids or model inputs): their layer calls recorded, the first layer's input
        (the embeddings' output) kept as the hidden states each layer replaces. Returns the batches as model inputs."""
        inputs = [as_model_inputs(batch, self.device) for batch in batches]
        for each in inputs:  # as the resident pass refuses them (token ids past the vocabulary: another tokenizer)
            check_calibration_inputs(self.model, each)
        calls = [_record_layer_calls(self.model, self.layers, each) for each in inputs]
        self.inputs[name], self.calls[name] = inputs, calls
        self.hidden[name] = [_hidden_of(recorded[0]).to(self.hidden_device) for recorded in calls]
        self.state[name] = [None] * len(inputs)
        return inputs

    def keep_inputs(self, name: str, first_layer: int, budget: float = math.inf,
                    spill: Callable[[], Path] | None = None) -> None:
        """From decoder layer ``first_layer`` on, keep what :meth:`run` feeds each layer of stream ``name`` (hidden
        states and carried state), for a backward that goes through the layers again from the top (:meth:`take_kept`):
        in host memory up to ``budget`` bytes, the layers past it in one file each in the directory ``spill()``
        gives."""
        self._keep_from[name], self._keep_budget[name] = first_layer, (budget, spill)
        self.kept[name], self.kept_bytes[name] = {}, {"memory": 0, "disk": 0, "disk_layers": 0}

    def take_kept(self, name: str, index: int) -> list[tuple[torch.Tensor, Any]]:
        """What :meth:`run` fed decoder layer ``index`` of stream ``name`` (per batch: hidden states, carried state),
        handed over once (its file removed)."""
        kept = self.kept[name].pop(index)
        if isinstance(kept, Path):
            path, kept = kept, torch.load(kept, weights_only=True)
            path.unlink()
        return kept

    def each_layer(self, progress: bool | None = None, description: str = "ompmoe (layer by layer)",
                   order: Iterable[int] | None = None) -> Iterator[tuple[int, nn.Module]]:
        """``(index, layer)`` for every decoder layer (or those of ``order``, in its order), its weights on the device
        while the caller has it (the next layer read meanwhile), emptied after; closed early (an error), the layer
        the caller had and the one read ahead are emptied too."""
        fill, prefix, layers = self.checkpoint.fill, self.prefix, self.layers
        indices = list(range(len(layers)) if order is None else order)
        if not indices:
            return
        with ThreadPoolExecutor(max_workers=1) as reader:
            pending: Future | None = reader.submit(fill, (f"{prefix}{indices[0]}.",), self.device, self.dtype)
            ahead = indices[0]
            try:
                for step in progress_bar(range(len(indices)), description, progress, unit="layer"):
                    index = indices[step]
                    pending.result()  # type: ignore[union-attr]
                    pending = None
                    if step + 1 < len(indices):
                        ahead = indices[step + 1]
                        pending = reader.submit(fill, (f"{prefix}{ahead}.",), self.device, self.dtype)
                    try:
                        yield index, layers[index]
                    finally:
                        self.checkpoint.empty(layers[index])
                    release_freed_memory()
            finally:
                if pending is not None:  # a layer read ahead that nobody will take
                    wait([pending])
                    self.checkpoint.empty(layers[ahead])

    def call(self, name: str, index: int, position: int, hidden: torch.Tensor, state: Any = None
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` of decoder layer ``index``'s call on stream ``name``'s batch ``position`` as the model's
        forward makes it, with ``hidden`` as its hidden states and ``state`` as what the layer before handed it."""
        call, argument = self.calls[name][position][index], self.carried[index]
        if argument is not None and index > 0:  # the first layer's is the model's own, as recorded
            call = _with_state(call, argument, _to(state, self.device))
        return _with_hidden(call, hidden)

    @torch.no_grad()
    def run(self, name: str, index: int, before: Callable[[int, dict[str, torch.Tensor]], None] | None = None
            ) -> None:
        """Stream ``name``'s batches through decoder layer ``index`` as the model's forward calls it (``before``: called
        with each batch's position and inputs first); their outputs become the next layer's inputs."""
        layer, hidden, state, argument = self.layers[index], self.hidden[name], self.state[name], self.carried[index]
        keep = self.kept[name].setdefault(index, []) if index >= self._keep_from.get(name, len(self.layers)) else None
        versions: list[tuple[int, ...]] = []
        for position, inputs in enumerate(self.inputs[name]):
            if before is not None:
                before(position, inputs)
            if keep is not None:  # on the CPU the very tensor the layer takes: its version tells a change in place
                keep.append((hidden[position].to("cpu"), _to(state[position], torch.device("cpu"))))
                versions.append(_versions(keep[-1]))
            args, kwargs = self.call(name, index, position, hidden[position].to(self.device), state[position])
            output = layer(*args, **kwargs)
            hidden[position] = (output[0] if isinstance(output, tuple) else output).to(self.hidden_device)
            if argument is not None:
                state[position] = _to(output[1], self.hidden_device)
        if keep is not None:
            if [_versions(each) for each in keep] != versions:
                raise LayerwiseUnsupportedError(
                    f"{type(layer).__name__} (decoder layer {index}) changes its input in place, and the backward down "
                    "the layers recomputes each layer from its input as the forward sweep kept it. Calibrate it "
                    "resident instead.")
            self._settle_kept(name, index, keep)

    def _settle_kept(self, name: str, index: int, keep: list[tuple[torch.Tensor, Any]]) -> None:
        """Layer ``index``'s kept inputs stay in memory within the stream's budget, else go to a file."""
        size, (budget, spill), counts = _nbytes(keep), self._keep_budget[name], self.kept_bytes[name]
        if spill is None or counts["memory"] + size <= budget:
            counts["memory"] += size
            return
        path = spill() / f"{name.replace('/', '_')}-{index}.pt"
        torch.save(keep, path)
        self.kept[name][index] = path  # type: ignore[assignment]
        counts["disk"] += size
        counts["disk_layers"] += 1

    def head_logits(self, inputs: dict[str, torch.Tensor], final: torch.Tensor) -> torch.Tensor:
        """The model's logits for a batch whose last decoder layer gave ``final``: its own final norm and head, run
        by its own forward with every layer handing ``final`` on (under the caller's gradient mode)."""
        if self.head and any(p.device.type == "meta" for p in self.model.get_output_embeddings().parameters()):
            self.checkpoint.fill(self.head, self.device, self.dtype)
            if any(p.device.type == "meta" for p in self.model.get_output_embeddings().parameters()):
                self.model.tie_weights()  # a head tied to the embeddings: no tensor of its own in the files

        def first(*args: Any, carries: bool = False, **kwargs: Any) -> Any:
            return (final, None) if carries else final

        def passed(*args: Any, carries: bool = False, **kwargs: Any) -> Any:
            return (_hidden_of((args, kwargs)), None) if carries else _hidden_of((args, kwargs))

        for index, layer in enumerate(self.layers):
            layer.forward = functools.partial(first if index == 0 else passed, carries=self.carried[index] is not None)
        try:
            return self.model(**inputs, use_cache=False).logits
        finally:
            for layer in self.layers:
                del layer.forward

    def empty_head(self) -> None:
        """Free the output head's weights until a loss needs them again (:meth:`head_logits` reads them again); a
        head tied to the embeddings stays (it is theirs)."""
        head = self.model.get_output_embeddings() if self.head else None
        embeddings = self.model.get_input_embeddings()
        if head is not None and not any(p is q for p in head.parameters() for q in embeddings.parameters()):
            self.checkpoint.empty(head)

    @torch.no_grad()
    def next_token_loss(self, name: str) -> tuple[float, int]:
        """``(summed next-token loss in nats, predicted tokens)`` of stream ``name`` (token-id batches) after its last
        layer, through the model's own final norm and head (as :func:`~ompmoe.engine.perplexity.perplexity` counts)."""
        total, count = 0.0, 0
        for inputs, final in zip(self.inputs[name], self.hidden[name]):
            logits = self.head_logits(inputs, final.to(self.device))[:, :-1].float()
            targets = inputs["input_ids"][:, 1:]
            total += float(nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                       reduction="sum"))
            count += targets.numel()
        return total, count

    def close(self) -> None:
        """Free everything filled outside the decoder layers (embeddings, norm, head)."""
        self.checkpoint.empty_outside(self.prefix)


def _check_spill_space(hidden: list[torch.Tensor], layers: int, budget: float, scratch: str | os.PathLike | None
                       ) -> None:
    """Refuse, before any layer runs, kept inputs whose share past ``budget`` (at least: the hidden states of
    ``layers`` decoder layers) cannot fit the disk they go to."""
    spilled = sum(map(_nbytes, hidden)) * layers - budget
    if spilled > 0:
        where = scratch if scratch is not None else tempfile.gettempdir()
        require_free_space(where, spilled, "keeping the layer inputs for the loss-aware backward (past the "
                           f"{readable_size(budget)} of memory they may take) needs",
                           "free space there, or calibrate on fewer tokens")


def _nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (nested tuples and lists)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(map(_nbytes, value))
    return 0


def _versions(value: Any) -> tuple[int, ...]:
    """The version counters of the tensors in ``value`` (nested tuples and lists): each write in place bumps one."""
    if isinstance(value, torch.Tensor):
        return (value._version,)
    if isinstance(value, (tuple, list)):
        return tuple(version for each in value for version in _versions(each))
    return ()


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def collect_layerwise(collector: StatisticsCollector, path: str | os.PathLike, batches: Iterable[Any], *,
                      device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                      progress: bool | None = None, hidden_device: torch.device | str | None = None,
                      timings: dict[str, float] | None = None, scratch: str | os.PathLike | None = None,
                      inputs_on_disk: bool | None = None) -> int:
    """Feed ``collector`` (built on a weightless skeleton of the checkpoint at ``path``) the calibration ``batches``
    one decoder layer at a time: the skeleton's modules outside the layers are filled first, then each layer on
    ``device`` (the next one read while it computes) and emptied after. ``hidden_device`` keeps the calibration
    hidden states (default ``device``; ``"cpu"`` when they do not fit). Returns the number of batches;
    ``timings`` receives seconds per step.

    Statistics that need the loss's gradient (loss-aware) run a backward down the layers after the forward sweep
    (:meth:`~ompmoe.engine.collect.extensions.StatisticsExtension.collect_layer_by_layer`), which recomputes each
    layer from its input: those inputs are kept meanwhile, in host memory up to :data:`KEPT_INPUTS_MEMORY_SHARE` of
    the memory available at the start, the layers past it in a temporary directory in ``scratch`` (default: the
    system's); ``inputs_on_disk`` ``True`` or ``False`` puts them all on disk or all in memory."""
    for name, ext in collector.extensions.items():
        refusal = ext.layer_by_layer_refusal()
        if refusal is not None:
            raise ValueError(f"layer-by-layer calibration cannot collect {name!r} statistics: {refusal}; collect "
                             "them resident.")
    backward = [ext for ext in collector.extensions.values() if ext.needs_gradients]
    if len(backward) > 1:  # each consumes the kept inputs and the last layer's hidden states
        raise ValueError(f"layer-by-layer calibration runs one backward down the layers; "
                         f"{', '.join(repr(ext.name) for ext in backward)} each need one. Collect them resident, or "
                         "one of them at a time.")
    started = time.perf_counter()
    times = timings if timings is not None else {}
    with ExitStack() as stack:
        checkpoint = stack.enter_context(LazyCheckpoint(path, collector.model))
        stack.enter_context(quiet_calls())  # no Loading-weights bar per layer
        passes = LayerMajor(checkpoint, device, dtype, hidden_device)
        stack.callback(passes.close)  # the embeddings and head freed also after an error
        collector.to(passes.device)
        blocks = passes.add("calibration", batches)
        if not blocks:
            raise ValueError("No calibration batches were given; pass at least one non-empty batch.")
        for ext in backward:  # before any layer runs: what the backward will refuse
            ext.check_layer_by_layer_inputs(blocks)
        if backward:  # each layer's input from the lowest MoE block's layer up, for the backward down the layers
            budget = {None: KEPT_INPUTS_MEMORY_SHARE * available_memory(), True: 0.0, False: math.inf}[inputs_on_disk]
            spill = functools.cache(lambda: Path(stack.enter_context(tempfile.TemporaryDirectory(
                prefix=".ompmoe-layer-inputs-", dir=scratch))))
            first = min(moe_blocks_by_layer(passes.prefix, collector.layers))
            _check_spill_space(passes.hidden["calibration"], len(passes.layers) - first, budget, scratch)
            passes.keep_inputs("calibration", first, budget, spill)
        weights = [batch_token_weight(inputs, 0, None) for inputs in blocks]
        times["embed"] = time.perf_counter() - started
        compute = 0.0
        layers = stack.enter_context(closing(passes.each_layer(progress, "ompmoe statistics (layer by layer)")))
        for index, _ in layers:  # closed before the checkpoint, also on an error (its read-ahead waited for)
            tick = time.perf_counter()

            def weigh(position: int, inputs: dict[str, torch.Tensor], index: int = index) -> None:
                _set_token_weight(collector, inputs, weights[position], first_layer=index == 0)

            with collector.forward_only():
                passes.run("calibration", index, weigh)
            collector.metric.token_weight = None
            compute += time.perf_counter() - tick
        times["layers"] = compute
        if backward:
            kept = passes.kept_bytes["calibration"]
            times["kept_inputs_bytes"] = float(kept["memory"] + kept["disk"])
            times["kept_inputs_layers_on_disk"] = float(kept["disk_layers"])
            tick = time.perf_counter()
            with collector.paused():
                for ext in backward:
                    ext.collect_layer_by_layer(passes, "calibration", weights, progress)
            times["backward"] = time.perf_counter() - tick
    for inputs in blocks:
        if inputs.get("input_ids") is not None:
            collector.token_batches.append({key: inputs[key].detach().cpu()
                                            for key in ("input_ids", "attention_mask") if key in inputs})
    collector.batch_size = max((int(block["input_ids"].shape[0]) for block in blocks if "input_ids" in block),
                               default=collector.batch_size)
    times["total"] = time.perf_counter() - started
    return len(blocks)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's
    except (AttributeError, OSError, TypeError):  # another C library; Windows (no CDLL(None))
        return None


def release_freed_memory() -> None:
    """Hand the C allocator's free pages back to the system (glibc's ``malloc_trim``; elsewhere nothing). A pass over
    the layers frees each layer's tensors once it is done; glibc keeps freed chunks of the sizes it served last in its
    heaps (its mmap threshold grows with them), so resident memory would creep up with depth: from 4.2 to 6.3 GiB over
    the 24 layers of a loss-aware backward (docs/performance.md), flat with this after each layer."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


KEPT_INPUTS_MEMORY_SHARE = 0.5
"""Layer inputs a layer-by-layer backward keeps go to disk when they would take more than this share of the memory
available (:func:`available_memory`)."""


MEMINFO, CGROUP = Path("/proc/meminfo"), Path("/sys/fs/cgroup")
"""Where Linux says how much memory is available, and where a cgroup v2 (a container, a Slurm job) sets its limit."""


def available_memory() -> int:
    """Bytes of memory this process may still allocate: the system's available memory (Linux's ``MemAvailable``,
    else the free pages, else psutil's), no more than what is left of its cgroup's limit; 0 where none of them can be
    read (so that what could go to disk does)."""
    known: list[int] = []
    try:
        known += [int(line.split()[1]) * 1024 for line in MEMINFO.read_text().splitlines()
                  if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    if not known:
        try:
            known.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (AttributeError, ValueError, OSError):  # macOS has no SC_AVPHYS_PAGES, Windows no sysconf
            try:
                import psutil

                known.append(int(psutil.virtual_memory().available))
            except Exception:  # noqa: BLE001 - psutil missing or failing: nothing known
                pass
    try:
        limit = (CGROUP / "memory.max").read_text().strip()
        if limit != "max":
            known.append(max(0, int(limit) - int((CGROUP / "memory.current").read_text().strip())))
    except (OSError, ValueError):
        pass
    return min(known, default=0)


def moe_blocks_by_layer(prefix: str, layers: list[MoELayer]) -> dict[int, list[int]]:
    """Decoder layer index -> the positions in ``layers`` of the MoE blocks inside it, for the decoder layer list
    named ``prefix`` (``model.layers.``); layers without one are absent."""
    blocks: dict[int, list[int]] = {}
    for position, layer in enumerate(layers):
        if layer.name.startswith(prefix):
            blocks.setdefault(int(layer.name[len(prefix):].split(".", 1)[0]), []).append(position)
    return blocks


def _set_token_weight(collector: StatisticsCollector, inputs: dict[str, torch.Tensor], weight: torch.Tensor | None,
                      first_layer: bool) -> None:
    """The block's token weights for the layer about to run; its tokens are counted once (at the first layer)."""
    if first_layer:
        ids = inputs.get("input_ids", inputs.get("inputs_embeds"))
        collector.metric.set_token_weight(weight, num_tokens=int(ids.shape[0]) * int(ids.shape[1]))
    else:
        metric = collector.metric
        metric.token_weight = None if weight is None else weight.reshape(-1).to(metric.num_tokens.device,
                                                                                torch.float64)


def collect_stats_layerwise(path: str | os.PathLike, batches: Iterable[Any], *, device: torch.device | str = "cpu",
                            dtype: torch.dtype | None = None, model_id: str | None = None, source: str | None = None,
                            progress: bool | None = None, statistics: Iterable[str] = (),
                            hidden_device: torch.device | str | None = None,
                            timings: dict[str, float] | None = None,
                            scratch: str | os.PathLike | None = None) -> MoEStats:
    """:func:`~ompmoe.collect_stats` on the local safetensors checkpoint at ``path`` without ever holding its
    weights (:func:`collect_layerwise`): the same sums, one decoder layer in memory at a time (``statistics=
    ["loss_aware"]`` too, by a backward down the layers; ``scratch``: where their layer inputs go when they do not
    fit in memory). ``dtype``: the checkpoint's unless given."""
    config = checkpoint_config(path)
    model = build_skeleton(config, dtype=dtype or checkpoint_dtype(config))
    collector = StatisticsCollector(model, model_id=model_id or str(path), sources=[source] if source else None,
                                    statistics=statistics)
    collect_layerwise(collector, path, batches, device=device, progress=progress, hidden_device=hidden_device,
                      timings=timings, scratch=scratch)
    return collector.result()


__all__ = ["CARRIED_STATE", "LayerMajor", "LayerwiseUnsupportedError", "available_memory", "carried_state",
           "collect_layerwise", "collect_stats_layerwise", "moe_blocks_by_layer", "release_freed_memory"]
