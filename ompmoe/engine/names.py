"""Names users type: telling a path from a hub id, the nearest existing path, the closest registered name (no torch)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path


def looks_local(spec: str) -> bool:
    """A hub id is ``name`` or ``owner/name``; anything else with a slash, or under an existing directory, is a path."""
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1 or "\\" in spec:
        return True
    return "/" in spec and Path(spec.split("/", 1)[0]).is_dir()


def nearest_path_hint(spec: str) -> str:
    """``; did you mean 'a/b'?`` (a close sibling name) or ``; 'a' exists`` (the deepest existing parent)."""
    path = Path(spec).expanduser()
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if parent == path.parent:
        siblings = [child.name for child in parent.iterdir()] if parent.is_dir() else []
        close = difflib.get_close_matches(path.name, siblings, n=1)
        if close:
            return f"; did you mean {str(parent / close[0])!r}?"
    return f"; {str(parent)!r} exists" if str(parent) not in ("", ".") else ""


def did_you_mean(name: object, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` to a mistyped ``name``, else ``""``."""
    close = difflib.get_close_matches(name, list(choices), n=1) if isinstance(name, str) else []
    return f" (did you mean {close[0]!r}?)" if close else ""
