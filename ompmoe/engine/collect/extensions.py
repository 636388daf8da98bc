"""Optional statistics as plugins: one :class:`StatisticsExtension` per kind, held by the collector in a dict.

An extension adds sums to the core pass (:mod:`ompmoe.engine.collect.collector`) in the same forward: its sum states,
hooks and checkpoint prefix; methods and allocations declare the ones they need (see docs/statistics.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import torch
from torch import nn
from ..adapters import MoELayer
from ..registry import Registry

if TYPE_CHECKING:
    from torchmetrics import Metric


class FilledLayer(Protocol):
    """What an extension fills: a layer's statistics (``LayerStats``, which imports this module) that return a copy
    with tensors added."""

    def with_tensors(self: Layer, tensors: dict[str, torch.Tensor]) -> Layer: ...


Layer = TypeVar("Layer", bound=FilledLayer)

PairCallback = Callable[..., None]
"""``(layer_index, top_k_index (T, k), top_k_weights (T, k), expert_outputs (T*k, d)[, atoms (T*k, d)])``;
``atoms`` is ``g * F`` exactly as the block output sums it, so no callback forms it again."""


class StatisticsExtension:
    """One kind of optional statistics: its sums (``metric``), the hooks it attaches, its checkpoint prefix.

    Subclasses set the class variables and build ``self.metric`` (a :class:`~ompmoe.engine.collect.sums.LayerSumsMetric`) and ``self.recorder``
    (``attach()``/``detach()`` of the hooks feeding it) in ``__init__``; :meth:`wrap` may chain into the callback.
    """

    name: ClassVar[str] = ""
    """Registry key, as in ``collect_stats(..., statistics=[name])`` and ``ExpertPruning(statistics=[name])``."""
    kind: ClassVar[str] = ""
    """What to call these statistics in messages ("loss-aware")."""
    option: ClassVar[str] = ""
    """How to ask for them, for messages (default ``statistics=['name']``)."""
    prefix: ClassVar[str] = ""
    """Prefix of the metric's states in Lightning checkpoints (``prefix.state``)."""
    tensors: ClassVar[tuple[str, ...]] = ()
    """The ``LayerStats`` tensors it fills (``gram*`` are ``(N, N)``, others ``(N,)``; non-fields go to ``extra``)."""
    signed: ClassVar[tuple[str, ...]] = ()
    """Those of ``tensors`` that may be negative (the others are sums of squares or counts)."""
    needs_gradients: ClassVar[bool] = False
    """Whether the forward must build an autograd graph (the module switches gradients on)."""

    metric: Metric
    recorder: Any

    def __init__(self, model: nn.Module, layers: list[MoELayer], token_weight: Callable[[], torch.Tensor | None]
                 ) -> None:
        self.model, self.layers, self.token_weight = model, layers, token_weight

    @classmethod
    def how(cls) -> str:
        return cls.option or f"statistics=[{cls.name!r}]"

    def wrap(self, update: PairCallback) -> PairCallback:
        """The per-pair callback of the statistics pass, with this extension's work chained in."""
        return update

    def attach(self) -> None:
        """Register the hooks (the collector's context is entered)."""
        self.recorder.attach()

    def detach(self) -> None:
        """Remove the hooks (the collector's context is left)."""
        self.recorder.detach()

    def standalone(self) -> None:
        """Called by :func:`~ompmoe.engine.collect.collector.collect_stats`: no training step follows the forward."""

    def layer_by_layer_refusal(self) -> str | None:
        """Why these sums cannot be gathered one decoder layer at a time (``None``: they can, in the forward sweep's
        hooks or, for an extension that runs a backward, in its own :meth:`collect_layer_by_layer`)."""
        own = type(self).collect_layer_by_layer is not StatisticsExtension.collect_layer_by_layer
        if self.needs_gradients and not own:
            return f"{self.kind} statistics need a backward through the whole model"
        return None

    def check_layer_by_layer_inputs(self, batches: list[dict[str, torch.Tensor]]) -> None:
        """Refuse, before layer by layer's forward sweep, batches :meth:`collect_layer_by_layer` could not use (the
        resident pass refuses them at their forward)."""

    def collect_layer_by_layer(self, passes: Any, stream: str, token_weights: list[torch.Tensor | None],
                               progress: bool | None = None) -> None:
        """Gather the sums of an extension that runs a backward after layer by layer's forward sweep over
        ``stream``, whose layer inputs ``passes`` (a :class:`~ompmoe.engine.collect.layerwise.LayerMajor`, which
        imports this module) kept; ``token_weights`` per batch as the forward sweep used them."""
        raise NotImplementedError(f"{type(self).__name__} gathers its sums in the forward sweep's hooks.")

    def fill(self, layers: list[Layer]) -> list[Layer]:
        """``layers`` with this extension's tensors filled in."""
        return [layer.with_tensors(tensors) for layer, tensors in zip(layers, self.metric.compute())]


STATISTICS: Registry[type[StatisticsExtension]] = Registry()
"""Registered statistics extensions by name (the built-ins of :mod:`ompmoe.engine.methods` load on the first read)."""

E = TypeVar("E", bound=type[StatisticsExtension])


def register_statistics(cls: E) -> E:
    """Class decorator: add a :class:`StatisticsExtension` subclass to :data:`STATISTICS` under ``cls.name``."""
    if not (isinstance(cls, type) and issubclass(cls, StatisticsExtension) and cls.name and cls.prefix and cls.tensors):
        raise TypeError(
            f"register_statistics needs a StatisticsExtension subclass with name, prefix and tensors; got {cls!r}.")
    STATISTICS[cls.name] = cls
    return cls


def extension(name: str) -> type[StatisticsExtension]:
    """The registered extension ``name``."""
    if name not in STATISTICS:
        raise ValueError(f"Unknown statistics {name!r}; choose from {sorted(STATISTICS)}.")
    return STATISTICS[name]


def extension_providing(key: str) -> type[StatisticsExtension] | None:
    """The extension that fills the ``LayerStats`` tensor ``key`` (``None`` for the core sums)."""
    return next((cls for cls in STATISTICS.values() if key in cls.tensors), None)


def selected_statistics(statistics: Iterable[str] = (), **flags: bool) -> list[str]:
    """The optional statistics to collect, in order: ``statistics`` plus every extension named by a true flag
    (``loss_aware=True`` is ``statistics=["loss_aware"]``)."""
    for name in flags:
        extension(name)
    return list(dict.fromkeys([*statistics, *(name for name, wanted in flags.items() if wanted)]))

