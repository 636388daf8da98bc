"""Name -> plugin registries that fill themselves with the built-in plugins on first read.

``collect/`` owns the statistics registry and ``planning/`` the method and allocation registries; the built-in
methods in ``methods/`` build on both and register into them when :data:`BUILT_INS` is imported. So that neither
stage imports ``methods/`` (which imports them), a registry imports :data:`BUILT_INS` itself the first time it is
read. Registering never reads, so a plugin registers while the built-ins are still being imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping
from typing import TypeVar

BUILT_INS = "ompmoe.engine.methods"
"""The package whose import registers the built-in methods, allocations and statistics."""

_loaded = False

V = TypeVar("V")


def load_built_ins() -> None:
    """Import :data:`BUILT_INS` once (reads made while it imports see what has registered so far)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    try:
        importlib.import_module(BUILT_INS)
    except BaseException:
        _loaded = False
        raise


class Registry(MutableMapping[str, V]):
    """A dict of plugins by name, in registration order; every read first loads the built-ins."""

    def __init__(self) -> None:
        self._entries: dict[str, V] = {}

    def registered(self, name: str) -> V | None:
        """The entry ``name`` without loading the built-ins: for registration's own duplicate check."""
        return self._entries.get(name)

    def __setitem__(self, name: str, value: V) -> None:
        self._entries[name] = value

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __getitem__(self, name: str) -> V:
        load_built_ins()
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        load_built_ins()
        return iter(list(self._entries))

    def __len__(self) -> int:
        load_built_ins()
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({list(self)})"
