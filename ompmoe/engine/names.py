"""Names users type, resolved in one place (no torch): ``shipped:<name>`` models, telling a path from a hub id, the
nearest existing path, the closest registered name."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

SHIPPED_PREFIX = "shipped:"
SHIPPED_MODELS = ("tiny-moe", "tiny-moe-64", "tiny-moe-a3b")
"""Models shipped in ``ompmoe/data/``, named ``shipped:<name>`` as a model or tokenizer spec."""
CORPUS_DOMAINS = ("prose", "code")
"""Domains of the shipped corpus: ``prose`` (Python/IDLE documentation), ``code`` (stdlib source)."""
SHIPPED_TEXT_RECORD = "shipped:ompmoe/data/calibration.txt"
"""How statistics record the ``shipped`` source (``TextSource.describe``)."""


def corpus_record(domains: tuple[str, ...], split: str) -> str:
    """How statistics record a source of the shipped corpus (``TextSource.describe``): its parts inside the package,
    e.g. ``shipped:ompmoe/data/corpus/prose-calibration,shipped:ompmoe/data/corpus/code-calibration``."""
    return ",".join(f"shipped:ompmoe/data/corpus/{domain}-{split}" for domain in domains)
_SHIPPED_NAMES = ", ".join(SHIPPED_PREFIX + model for model in SHIPPED_MODELS)


def shipped_model_path(name: str = "tiny-moe") -> Path:
    """Directory of a model shipped with ompmoe (config, safetensors weights, tokenizer, card)."""
    name = name.removeprefix(SHIPPED_PREFIX)
    if name not in SHIPPED_MODELS:
        raise ValueError(f"Unknown shipped model {name!r}; available: {_SHIPPED_NAMES}.")
    return Path(str(resources.files("ompmoe").joinpath("data", name)))


def resolve_shipped(spec: str, what: str = "path") -> str:
    """``shipped:<model>`` -> its local directory; a hub id or an existing path is returned as is. A misspelt
    shipped name or a missing local path (``what``: the role it was given in, e.g. ``model path``) fails here, with a
    hint, not later as a confusing hub error."""
    if not isinstance(spec, str):
        return spec
    if spec.startswith(SHIPPED_PREFIX):
        name = spec.removeprefix(SHIPPED_PREFIX)
        if name not in SHIPPED_MODELS:
            close = difflib.get_close_matches(name, SHIPPED_MODELS, n=1)
            hint = f"did you mean {SHIPPED_PREFIX + close[0]!r}? " if close else ""
            raise ValueError(f"unknown shipped model {spec!r}: {hint}the shipped models are {_SHIPPED_NAMES}")
        return str(shipped_model_path(spec))
    if looks_local(spec) and not Path(spec).expanduser().exists():
        raise FileNotFoundError(f"{what} {spec!r} does not exist{nearest_path_hint(spec)}")
    return spec


def loaded_name(name_or_path: str | None) -> str | None:
    """The name a model was loaded as (transformers' ``_name_or_path``): its hub id or path, ``shipped:<name>`` for
    a shipped model's directory, ``None`` for a model built from a config."""
    if not name_or_path:
        return None
    path = Path(str(name_or_path)).expanduser()
    if path.is_dir():
        for name in SHIPPED_MODELS:
            if path.resolve() == shipped_model_path(name).resolve():
                return SHIPPED_PREFIX + name
    return str(name_or_path)


def same_model(a: str, b: str) -> bool:
    """Whether two model names name the same model (a path however spelt, a ``shipped:`` name or its directory)."""
    a, b = loaded_name(a) or a, loaded_name(b) or b
    path = Path(a).expanduser()
    return a == b or (path.exists() and path.resolve() == Path(b).expanduser().resolve())


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
