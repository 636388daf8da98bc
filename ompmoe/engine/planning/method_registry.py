"""The one registry of expert-selection methods, read by ``plan_pruning``, strategies, the callback, the CLI and the
README's method table: dataclass subclasses of :class:`SelectionMethod` (fields: options; docstring's first line:
what it keeps), registered with :func:`register_method`."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, Union

import torch

from ..collect.extensions import extension, extension_providing
from ..collect.statistics import LayerStats
from ..names import did_you_mean
from ..registry import Registry
from .allocation import ALLOCATIONS


def require_layer_tensor(layers: Sequence[LayerStats], key: str, what: str, kind: str, how: str) -> None:
    """Refuse statistics whose layers lack the optional sum ``key``, naming the option that collects it."""
    if missing := [layer.name for layer in layers if getattr(layer, key) is None]:
        raise ValueError(f"{what} needs {kind} statistics ({key!r}), which these statistics lack (layers "
                         f"{missing[:3]}{'...' if len(missing) > 3 else ''}). Collect them with {how}.")


def require_statistic(layers: Sequence[LayerStats], key: str, what: str) -> None:
    """Refuse statistics lacking ``key``, naming the extension that collects it (or, for a core sum, re-collection)."""
    provider = extension_providing(key)
    if provider is not None:
        how = provider.how()
        require_layer_tensor(layers, key, what, provider.kind,
                             f"ompmoe.collect_stats(model, batches, {how}) or ExpertPruning(..., {how})")
    else:
        require_layer_tensor(layers, key, what, "current", "this ompmoe (they were written by an older one): "
                             "re-run collect_stats or the calibration fit")


@dataclass
class SubsetSelection:
    """Kept sets per count for one layer, not necessarily nested: ``kept[k]`` (bool, ``N``) when keeping ``k``;
    ``reference``, a full ordering: :meth:`order_at` lists the kept set first, each part in reference order."""

    kept: torch.Tensor
    reference: torch.Tensor

    def kept_ids(self, count: int) -> list[int]:
        return torch.nonzero(self.kept[count]).flatten().tolist()

    def order_at(self, count: int) -> torch.Tensor:
        inside = self.kept[count][self.reference]
        return torch.cat([self.reference[inside], self.reference[~inside]])

    def residual(self, gram: torch.Tensor) -> torch.Tensor:
        """``r(k)`` of the set kept at each count: energy of the atoms left out over ``||Y||^2``."""
        total = gram.to(torch.float64).sum().clamp(min=torch.finfo(torch.float64).tiny)
        return removed_energy(gram, self.kept) / total

    def coverage(self, routing_mass: torch.Tensor) -> torch.Tensor:
        """``C(k)``: share of the routing mass held by the set kept at each count."""
        mass = routing_mass.to(torch.float64)
        share = mass / mass.sum().clamp(min=torch.finfo(torch.float64).tiny)
        return self.kept.to(torch.float64) @ share


def removed_energy(gram: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``||Y - sum_{e kept} V_e||^2 = u^T G u`` with ``u`` the experts left out; ``kept`` ``(..., N)`` bool."""
    g = gram.to(torch.float64)
    u = (~kept).to(torch.float64)
    return ((u @ g) * u).sum(-1)


Selection = Union[torch.Tensor, SubsetSelection]
"""What a method returns for one layer: an ordering (best first) or a kept set per count."""


def kept_masks(selection: Selection, num_experts: int) -> torch.Tensor:
    """``(N + 1, N)`` bool: the experts kept at each count, from an ordering or a ``SubsetSelection``."""
    if isinstance(selection, torch.Tensor):
        ranks = selection.argsort()  # the inverse permutation: each expert's position in the ordering
        return ranks.unsqueeze(0) < torch.arange(num_experts + 1).unsqueeze(1)
    return selection.kept.bool()


@dataclass
class SelectionMethod:
    """Base of every selection method: options are dataclass fields, ``name`` a class variable."""

    name: ClassVar[str] = ""
    """The method's name in ``plan_pruning(method=...)``, plans, configs and the CLI."""
    statistics: ClassVar[tuple[str, ...]] = ()
    """Optional statistics it needs (:data:`ompmoe.engine.collect.extensions.STATISTICS` names), checked before calibration."""
    default_allocation: ClassVar[str] = "waterfill"
    """The allocation it runs with when ``allocation="auto"`` beside it: the one its authors publish it with (REAP's
    per-layer ``uniform``), the paper's ``waterfill`` for the rest; so a method named anywhere runs as published."""

    def select(self, layers: Sequence[LayerStats]) -> list[Selection]:
        """One :data:`Selection` per layer, from the layers' statistics."""
        raise NotImplementedError

    def validate(self, routings: Sequence[tuple[str, dict[str, int]]]) -> None:
        """Raise before calibration if the method cannot run on layers with these routings."""

    def options(self) -> dict[str, Any]:
        """The method's options (its dataclass fields) as recorded in ``plan.extra``."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    @classmethod
    def summary(cls) -> str:
        """First line of the docstring: what the method keeps (the README table's last column)."""
        return inspect.cleandoc(cls.__doc__ or "").split("\n", 1)[0].rstrip(".")


METHODS: Registry[type[SelectionMethod]] = Registry()
"""Registered methods by name (the built-ins of :mod:`ompmoe.engine.methods` load on the first read)."""

M = TypeVar("M", bound=type[SelectionMethod])


def register_method(cls: M) -> M:
    """Class decorator: add a :class:`SelectionMethod` dataclass to :data:`METHODS` under ``cls.name``."""
    if not (isinstance(cls, type) and issubclass(cls, SelectionMethod) and "__dataclass_fields__" in vars(cls)):
        raise TypeError(f"register_method needs a @dataclass subclass of SelectionMethod; got {cls!r}.")
    if not cls.name or not cls.name.isidentifier():
        raise ValueError(f"{cls.__name__}.name must be an identifier-like method name; got {cls.name!r}.")
    existing = METHODS.registered(cls.name)
    if existing is not None and existing is not cls and existing.__qualname__ != cls.__qualname__:
        raise ValueError(f"A method named {cls.name!r} is already registered "
                         f"({existing.__module__}.{existing.__qualname__}).")
    METHODS[cls.name] = cls
    return cls


def default_allocation(method: str) -> str:
    """The allocation ``method`` (a registered name or import path) runs with under ``allocation="auto"``."""
    return method_class(method).default_allocation


def option_defaults(name: str) -> dict[str, Any]:
    """Options of method ``name`` with their defaults."""
    return method_class(name)().options()


def method_class(name: str) -> type[SelectionMethod]:
    """The registered class of ``name`` (or of an import path ``package.module.ClassName``, which importing registers),
    else an error listing the registered names."""
    if isinstance(name, str) and name not in METHODS and "." in name:
        module_name, _, class_name = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"Method {name!r} is not registered and cannot be imported ({error}).") from None
        if not (isinstance(cls, type) and issubclass(cls, SelectionMethod)) or METHODS.get(cls.name) is not cls:
            raise ValueError(f"{name} is not a method registered with @ompmoe.register_method.")
        return cls
    if not isinstance(name, str) or name not in METHODS:
        raise ValueError(f"Unknown method {name!r}{did_you_mean(name, METHODS)}; choose one of {sorted(METHODS)} or "
                         "register one with ompmoe.register_method.")
    return METHODS[name]


def get_method(name: str | SelectionMethod, options: dict[str, Any] | None = None) -> SelectionMethod:
    """An instance of method ``name`` with ``options``; unknown options are refused with the valid ones."""
    if isinstance(name, SelectionMethod):
        if options:
            raise ValueError("Pass method options either in the method instance or in method_options, not both.")
        return name
    cls = method_class(name)
    options = dict(options or {})
    valid = [field.name for field in dataclasses.fields(cls)]
    if unknown := sorted(set(options) - set(valid)):
        raise ValueError(f"Method {name!r} has no option {', '.join(map(repr, unknown))}; its options are "
                         f"{valid or 'none'}.")
    return cls(**options)


def method_table() -> str:
    """The README's Markdown table of registered methods, their options and what they keep."""
    rows = ["| `method` | options (defaults) | keeps the experts with |", "|---|---|---|"]
    for name, cls in METHODS.items():
        options = ", ".join(f"`{key}={value!r}`" for key, value in option_defaults(name).items()) or "-"
        summary = cls.summary().replace("|", "\\|")  # a pipe inside a cell would split it
        rows.append(f"| `{name}` | {options} | {summary} |")
    return "\n".join(rows)


def required_statistics(method: Any = None, allocation: Any = None) -> dict[str, list[str]]:
    """``{extension name: ["method 'x'", "allocation 'y'"]}``: the optional statistics a method (a registered name or
    a ``SelectionMethod``) and an allocation need; unknown names need nothing here (validated later)."""
    needs: dict[str, list[str]] = {}
    cls = METHODS.get(method) if isinstance(method, str) else method
    for name in getattr(cls, "statistics", ()):
        needs.setdefault(name, []).append(f"method {getattr(cls, 'name', method)!r}")
    spec = ALLOCATIONS.get(allocation) if isinstance(allocation, str) else None
    for name in getattr(spec, "statistics", ()):
        needs.setdefault(name, []).append(f"allocation {allocation!r}")
    return needs


def check_statistics(strategy: object, collected: Collection[str], owner: str = "ExpertPruning") -> None:
    """Refuse, before calibration, a strategy whose method or allocation needs statistics not in ``collected``;
    ``owner`` is what the message tells the user to pass the option to (``ExpertPruning``, ``FabricCalibration``)."""
    needs = required_statistics(getattr(strategy, "method", None), getattr(strategy, "allocation", None))
    for name, users in needs.items():
        if name not in collected:
            cls = extension(name)
            raise ValueError(f"The strategy's {' and '.join(users)} need{'s' * (len(users) == 1)} {cls.kind} "
                             f"statistics, which this calibration would not collect: pass {owner}(..., {cls.how()}).")
