"""Optional statistics as plugins: one :class:`StatisticsExtension` per kind, held by the collector in a dict.

An extension adds sums to the core pass (:mod:`ompmoe.engine.collect`) in the same forward: its sum states,
hooks and checkpoint prefix; methods and allocations declare the ones they need (see docs/statistics.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from torch import nn
from torchmetrics import Metric

if TYPE_CHECKING:
    from .adapters import MoELayer
    from .statistics import LayerStats

PairCallback = Callable[..., None]
"""``(layer_index, top_k_index (T, k), top_k_weights (T, k), expert_outputs (T*k, d)[, atoms (T*k, d)])``;
``atoms`` is ``g * F`` exactly as the block output sums it, so no callback forms it again."""


class LayerSumsMetric(Metric):
    """Sum-reduced float64 states ``{key}_{layer}`` per MoE layer; ``keys`` maps each to ``"gram"`` or ``"vector"``."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(self, layers: Sequence[MoELayer], keys: dict[str, str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_experts = [layer.num_experts for layer in layers]
        self.keys = dict(keys)
        for i, n in enumerate(self.num_experts):
            for key, shape in self.keys.items():
                size = (n, n) if shape == "gram" else (n,)
                self.add_state(f"{key}_{i}", torch.zeros(size, dtype=torch.float64), dist_reduce_fx="sum")

    def state(self, key: str, index: int) -> torch.Tensor:
        return getattr(self, f"{key}_{index}")

    def update(self, index: int, key: str, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``values`` at the flat ``positions`` of layer ``index``'s ``key`` (``e * N + f`` in a Gram)."""
        state = self.state(key, index)
        values = values.reshape(-1).to(state.device, torch.float64)
        state.view(-1).index_add_(0, positions.reshape(-1).to(state.device), values)

    def compute(self) -> list[dict[str, torch.Tensor]]:
        """Per layer, the summed tensors (over ranks when distributed)."""
        return [{key: self.state(key, i).clone() for key in self.keys} for i in range(len(self.num_experts))]


class StatisticsExtension:
    """One kind of optional statistics: its sums (``metric``), the hooks it attaches, its checkpoint prefix.

    Subclasses set the class variables and build ``self.metric`` (a :class:`LayerSumsMetric`) and ``self.recorder``
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

    metric: LayerSumsMetric
    recorder: Any

    def __init__(
        self, model: nn.Module, layers: list[MoELayer], token_weight: Callable[[], torch.Tensor | None]
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
        """Called by :func:`~ompmoe.engine.collect.collect_stats`: no training step follows the forward."""

    def fill(self, layers: list[LayerStats]) -> list[LayerStats]:
        """``layers`` with this extension's tensors filled in."""
        return [layer.with_tensors(tensors) for layer, tensors in zip(layers, self.metric.compute())]


STATISTICS: dict[str, type[StatisticsExtension]] = {}
"""Registered statistics extensions by name."""

E = TypeVar("E", bound=type[StatisticsExtension])


def register_statistics(cls: E) -> E:
    """Class decorator: add a :class:`StatisticsExtension` subclass to :data:`STATISTICS` under ``cls.name``."""
    if not (isinstance(cls, type) and issubclass(cls, StatisticsExtension) and cls.name and cls.prefix and cls.tensors):
        raise TypeError(
            f"register_statistics needs a StatisticsExtension subclass with name, prefix and tensors; got {cls!r}.")
    STATISTICS[cls.name] = cls
    return cls


BUILTIN_MODULES = ("ompmoe.engine.loss_stats", "ompmoe.engine.reroute_stats")
"""Modules whose import registers the built-in extensions (named, not imported here: they import this module)."""


def statistics_extensions() -> dict[str, type[StatisticsExtension]]:
    """Every registered extension (importing the built-in ones registers them)."""
    for module in BUILTIN_MODULES:
        importlib.import_module(module)
    return STATISTICS


def extension(name: str) -> type[StatisticsExtension]:
    known = statistics_extensions()
    if name not in known:
        raise ValueError(f"Unknown statistics {name!r}; choose from {sorted(known)}.")
    return known[name]


def extension_providing(key: str) -> type[StatisticsExtension] | None:
    """The extension that fills the ``LayerStats`` field ``key`` (``None`` for the core sums)."""
    return next((cls for cls in statistics_extensions().values() if key in cls.tensors), None)


def required_statistics(method: Any = None, allocation: Any = None) -> dict[str, list[str]]:
    """``{extension name: ["method 'x'", "allocation 'y'"]}``: the optional statistics a method and an allocation need.

    ``method`` is a registered name or a ``SelectionMethod``; unknown names need nothing here (validated later).
    """
    from .allocation import allocation_statistics
    from .methods import METHODS

    needs: dict[str, list[str]] = {}
    method_class = METHODS.get(method) if isinstance(method, str) else method
    for name in getattr(method_class, "statistics", ()):
        needs.setdefault(name, []).append(f"method {getattr(method_class, 'name', method)!r}")
    for name in allocation_statistics(allocation) if isinstance(allocation, str) else ():
        needs.setdefault(name, []).append(f"allocation {allocation!r}")
    return needs


def check_statistics(strategy: object, collected: Collection[str], owner: str = "ExpertPruning") -> None:
    """Refuse, before calibration, a strategy whose method or allocation needs statistics not in ``collected``.

    ``owner`` is what the message tells the user to pass the option to (``ExpertPruning``, ``FabricCalibration``).
    """
    needs = required_statistics(getattr(strategy, "method", None), getattr(strategy, "allocation", None))
    for name, users in needs.items():
        if name not in collected:
            cls = extension(name)
            raise ValueError(
                f"The strategy's {' and '.join(users)} need{'s' * (len(users) == 1)} {cls.kind} statistics, "
                f"which this calibration would not collect: pass {owner}(..., {cls.how()})."
            )
