"""Module attributes imported on first access (PEP 562), so optional dependencies load only when used."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_attributes(package: str, namespace: dict[str, Any], attributes: dict[str, str],
                    first: str | None = None) -> tuple[Callable, Callable]:
    """``__getattr__`` and ``__dir__`` for ``package`` that import ``attributes`` (name -> submodule) lazily;
    ``first``, a submodule imported before any other (one whose import registers plugins)."""

    def __getattr__(name: str) -> Any:
        module = attributes.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if first is not None and module.startswith(".engine"):
            import_module(first, package)
        value = getattr(import_module(module, package), name)
        namespace[name] = value  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *attributes})

    return __getattr__, __dir__
