"""Atomic writes: an output either appears whole or not at all, and is never overwritten by accident."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class OutputExistsError(FileExistsError):
    """The destination exists and overwriting was not requested."""


def check_writable(path: str | os.PathLike, overwrite: bool) -> Path:
    """Fail before any expensive work if ``path`` exists and ``overwrite`` is False."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise OutputExistsError(f"{path} already exists; pass overwrite=True (CLI: --overwrite) to replace it.")
    return path


@contextmanager
def atomic_path(path: str | os.PathLike, overwrite: bool = False, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write into; move it into place only on success."""
    path = check_writable(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
        _default_permissions(tmp, directory)
        if path.exists():
            _remove(path)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def _default_permissions(path: Path, directory: bool) -> None:
    """mkstemp/mkdtemp create private (0600/0700) entries; give the result the usual umask permissions."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if directory else 0o666) & ~umask)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()
