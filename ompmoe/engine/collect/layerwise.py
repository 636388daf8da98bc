"""Statistics of a model bigger than memory, one decoder layer at a time (layer-major order): every calibration
block's hidden states go through layer l, then layer l + 1, each layer's weights read from the checkpoint once and
freed after it; memory holds two layers (the one computing, the next being read) and the hidden states.

The sums are the resident pass's: the same collector hooks on the same expert modules see the same inputs (the
layers run as the model's own forward calls them, with the keyword arguments it passes them, recorded once)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from ..._quiet import quiet_calls
from ..lazy_checkpoint import LazyCheckpoint, build_skeleton, checkpoint_dtype, decoder_layers
from ..progress import progress as progress_bar
from .collector import StatisticsCollector, as_model_inputs, batch_token_weight
from .statistics import MoEStats

LAYERWISE_REFUSED_STATISTICS = {
    "loss_aware": "loss-aware statistics need a backward through the whole model; collect them resident (or "
                  "plan with the paper's setting, which needs none)",
}
"""Optional statistics layer-by-layer calibration cannot gather, with why and what runs instead."""


class LayerwiseUnsupportedError(ValueError):
    """A model whose decoder layers cannot run one at a time from recorded inputs."""


class _Recorded(Exception):
    """Raised by the last layer's recorder: the rest of the forward is not needed."""


def _record_layer_calls(model: nn.Module, layers: nn.ModuleList, inputs: dict[str, torch.Tensor]
                        ) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The ``(args, kwargs)`` the model's forward calls each decoder layer with on ``inputs`` (masks, position
    embeddings, ...; the hidden states only of the first layer are real), without running any layer."""
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def recorder(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        if len(calls) == len(layers):
            raise _Recorded
        return _hidden_of((args, kwargs))

    for layer in layers:
        layer.forward = recorder
    try:
        with torch.no_grad():
            model(**inputs, use_cache=False)
    except _Recorded:
        pass
    except Exception as error:  # noqa: BLE001 - a forward that needs more of its layers than their hidden states
        raise LayerwiseUnsupportedError(
            f"{type(model).__name__}'s decoder layers pass more than the hidden states on to the next layer (its "
            f"forward failed after {len(calls)} of {len(layers)} layers: {type(error).__name__}: {error}); "
            "layer-by-layer calibration cannot run them one at a time. Calibrate it resident instead.") from None
    finally:
        for layer in layers:
            del layer.forward
    if len(calls) != len(layers):
        raise LayerwiseUnsupportedError(f"{type(model).__name__}'s forward called {len(calls)} of its {len(layers)} decoder layers; "
                           "layer-by-layer calibration cannot run it. Calibrate it resident instead.")
    return calls


def _hidden_of(call: tuple[tuple[Any, ...], dict[str, Any]]) -> torch.Tensor:
    args, kwargs = call
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(call: tuple[tuple[Any, ...], dict[str, Any]], hidden: torch.Tensor) -> tuple[tuple[Any, ...],
                                                                                                dict[str, Any]]:
    args, kwargs = call
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def collect_layerwise(collector: StatisticsCollector, path: str | os.PathLike, batches: Iterable[Any], *,
                      device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                      progress: bool | None = None, hidden_device: torch.device | str | None = None,
                      timings: dict[str, float] | None = None) -> int:
    """Feed ``collector`` (built on a weightless skeleton of the checkpoint at ``path``) the calibration ``batches``
    one decoder layer at a time: the skeleton's modules outside the layers are filled first, then each layer on
    ``device`` (the next one read while it computes) and emptied after. ``hidden_device`` keeps the calibration
    hidden states (default ``device``; ``"cpu"`` when they do not fit). Returns the number of batches;
    ``timings`` receives seconds per step."""
    for name in collector.extensions:
        if name in LAYERWISE_REFUSED_STATISTICS:
            raise ValueError(f"layer-by-layer calibration cannot collect {name!r} statistics: "
                             f"{LAYERWISE_REFUSED_STATISTICS[name]}.")
    started = time.perf_counter()
    model = collector.model
    dtype = dtype or next(p.dtype for p in model.parameters() if p.is_floating_point())
    device, hidden_device = torch.device(device), torch.device(hidden_device or device)
    prefix, layers = decoder_layers(model)
    times = timings if timings is not None else {}
    # What runs before the first layer (embeddings, rotary): all but the layers and the output head, which the
    # recorded forward never reaches (it stops at the last layer).
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    skipped = (prefix, *(f"{name}." for name, module in model.named_modules() if head is not None and module is head))
    with LazyCheckpoint(path, model) as checkpoint, quiet_calls():  # no Loading-weights bar per layer
        checkpoint.fill(skipped, device, dtype, outside=True)
        collector.to(device)
        blocks, calls, weights = [], [], []
        for batch in batches:
            inputs = as_model_inputs(batch, device)
            blocks.append(inputs)
            weights.append(batch_token_weight(inputs, 0, None))
            calls.append(_record_layer_calls(model, layers, inputs))
        if not blocks:
            raise ValueError("No calibration batches were given; pass at least one non-empty batch.")
        # The first layer's input is the embeddings' output: the hidden states every later layer replaces.
        hidden = [_hidden_of(recorded[0]).to(hidden_device) for recorded in calls]
        times["embed"] = time.perf_counter() - started
        compute = 0.0
        with ThreadPoolExecutor(max_workers=1) as reader:
            pending: Future | None = reader.submit(checkpoint.fill, (f"{prefix}0.",), device, dtype)
            for index in progress_bar(range(len(layers)), "ompmoe statistics (layer by layer)", progress,
                                      unit="layer"):
                pending.result()  # type: ignore[union-attr]
                following = f"{prefix}{index + 1}."
                pending = reader.submit(checkpoint.fill, (following,), device, dtype) if index + 1 < len(layers) \
                    else None
                tick = time.perf_counter()
                with collector, torch.no_grad():
                    for block, (inputs, weight) in enumerate(zip(blocks, weights)):
                        _set_token_weight(collector, inputs, weight, first_layer=index == 0)
                        args, kwargs = _with_hidden(calls[block][index], hidden[block].to(device))
                        output = layers[index](*args, **kwargs)
                        hidden[block] = (output[0] if isinstance(output, tuple) else output).to(hidden_device)
                        collector.metric.token_weight = None
                compute += time.perf_counter() - tick
                checkpoint.empty(layers[index])
        checkpoint.empty_outside(prefix)
    times["layers"] = compute
    for inputs in blocks:
        if inputs.get("input_ids") is not None:
            collector.token_batches.append({key: inputs[key].detach().cpu()
                                            for key in ("input_ids", "attention_mask") if key in inputs})
    collector.batch_size = max((int(block["input_ids"].shape[0]) for block in blocks if "input_ids" in block),
                               default=collector.batch_size)
    times["total"] = time.perf_counter() - started
    return len(blocks)


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
                            timings: dict[str, float] | None = None) -> MoEStats:
    """:func:`~ompmoe.collect_stats` on the local safetensors checkpoint at ``path`` without ever holding its
    weights (:func:`collect_layerwise`): the same sums, one decoder layer in memory at a time. ``dtype``: the
    checkpoint's unless given."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    model = build_skeleton(config, dtype=dtype or checkpoint_dtype(config))
    collector = StatisticsCollector(model, model_id=model_id or str(path), sources=[source] if source else None,
                                    statistics=statistics)
    collect_layerwise(collector, path, batches, device=device, progress=progress, hidden_device=hidden_device,
                      timings=timings)
    return collector.result()


__all__ = ["LAYERWISE_REFUSED_STATISTICS", "LayerwiseUnsupportedError", "collect_layerwise", "collect_stats_layerwise"]
