"""The thousand-line ``ompmoe fit --help`` (and ``validate``/``test``/``predict --help``) from a cache.

Building it imports torch and Lightning (about ten seconds), yet it only changes with the installed packages,
ompmoe's source and the terminal width: the first call keeps it under ``$XDG_CACHE_HOME/ompmoe/help``
(default ``~/.cache``) and later calls print it at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import os
import shutil
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

CACHED_COMMANDS = ("fit", "validate", "test", "predict", "prune")
_PACKAGES = ("ompmoe", "lightning", "jsonargparse", "torch", "transformers", "lm_eval")


def is_plain_help(argv: list[str]) -> bool:
    """``ompmoe <command> --help`` with nothing else, whose text depends on no config file."""
    return len(argv) == 2 and argv[0] in CACHED_COMMANDS and argv[1] == "--help"


def cache_file(argv: list[str]) -> Path:
    """Where the help of ``argv`` is kept: named by the packages' versions, ompmoe's source and the width."""
    versions = []
    for package in _PACKAGES:
        try:
            versions.append(f"{package}={metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{package}=none")
    folders = {Path(__file__).parent}
    for name in ("ompmoe.callbacks", "ompmoe.eval"):  # installed as ompmoe's subpackages, kept apart in the repo
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            folders.add(Path(spec.origin).parent)
    newest = max((path.stat().st_mtime_ns for folder in folders for path in folder.rglob("*.py")), default=0)
    key = "\n".join([*argv, *versions, str(newest), str(shutil.get_terminal_size().columns)])
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ompmoe" / "help"
    return root / f"{argv[0]}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.txt"


def print_help(argv: list[str], produce: Callable[[list[str]], None]) -> None:
    """Print the help of ``argv`` from the cache, or run ``produce(argv)`` (which prints it and exits 0) and keep it."""
    path = cache_file(argv)
    if path.is_file():
        print(path.read_text(encoding="utf-8"), end="")
        raise SystemExit(0)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        try:
            produce(argv)
        except SystemExit as done:
            if done.code not in (0, None):
                raise
    print(text.getvalue(), end="")
    with contextlib.suppress(OSError):  # a read-only home only loses the speed-up
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(text.getvalue(), encoding="utf-8")
        partial.replace(path)
    raise SystemExit(0)


__all__ = ["CACHED_COMMANDS", "cache_file", "is_plain_help", "print_help"]
