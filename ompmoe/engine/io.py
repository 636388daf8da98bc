"""Atomic outputs that never lose a user's files.

Rules (see README "Reliability"):

* An output is written into a hidden temporary sibling (``.{name}.{host}-{pid}.{random}.tmp``) and renamed into
  place only on success, so a reader sees the old output or the new one, never a mix.
* Only what ompmoe made is ever replaced: a directory output carries a marker file (:data:`MARKER`); an existing
  directory without it (unless empty), the current working directory or a directory holding the run's inputs is
  refused, and a single-file output replaces only a regular file.
* ``overwrite=False`` is checked again at commit, so an output that appeared while the job ran is kept.
* Replacing a directory swaps it atomically (``renameat2(RENAME_EXCHANGE)`` where the kernel offers it; otherwise
  old -> aside name, new -> target) and deletes the old one last. Temporaries and aside copies left by killed runs
  are cleaned (or the aside copy restored) by the next run for the same target, only when their process is dead.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import socket
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

MARKER = ".ompmoe-output"
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


class OutputExistsError(FileExistsError):
    """The destination exists and overwriting was not requested."""


class OutputNotReplaceableError(FileExistsError):
    """The destination exists but is not something ompmoe may delete (not its output, or it holds inputs)."""


class OutputNotWritableError(OSError):
    """The destination's directory cannot be written (read-only file system, permissions, not a directory, ...)."""


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def _owner() -> str:
    return f"{_host()}-{os.getpid()}"


def _leftover_pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"^\.{re.escape(name)}\.(?P<host>[A-Za-z0-9-]+)-(?P<pid>\d+)\.[A-Za-z0-9_]+\.(?P<kind>tmp|old)$")


def _alive(host: str, pid: int) -> bool:
    """A process on another host, or one we may not signal, counts as alive: never delete its files."""
    if host != _host():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _step(name: str) -> None:
    """No-op between the steps of a commit; tests replace it to kill the process at a chosen point."""


def clean_leftovers(path: str | os.PathLike) -> list[Path]:
    """Remove temporaries of dead ompmoe runs for ``path``; restore an aside copy if ``path`` itself is missing.

    Returns the removed or restored entries.
    """
    path = Path(path)
    if not path.parent.is_dir():
        return []
    pattern = _leftover_pattern(path.name)
    handled = []
    for entry in sorted(path.parent.iterdir()):
        match = pattern.match(entry.name)
        if match is None or _alive(match["host"], int(match["pid"])):
            continue
        try:  # other ranks of the same job may clean concurrently: losing that race is fine
            if match["kind"] == "old" and not os.path.lexists(path):
                os.rename(entry, path)  # killed between "old -> aside" and "new -> target": bring the old one back
            else:
                _remove(entry)
        except FileNotFoundError:
            continue
        handled.append(entry)
    return handled


def _exists_message(path: Path) -> str:
    return (
        f"{path} already exists; pass overwrite=True (CLI: --overwrite true) to replace it, "
        "or choose another output path."
    )


def _check_replaceable(path: Path, directory: bool | None, inputs: Iterable[str | os.PathLike]) -> None:
    """Refuse to delete anything ompmoe did not make or that the run still reads."""
    resolved = path.resolve()
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise OutputNotReplaceableError(
            f"{path} is (or contains) the current working directory {cwd}; ompmoe will not replace it. "
            "Choose a new output directory, e.g. ./ompmoe-out."
        )
    for item in inputs:
        source = Path(item).resolve()
        if source == resolved or resolved in source.parents:
            raise OutputNotReplaceableError(
                f"{path} contains the input {item}; replacing it would delete the input. Choose another output path."
            )
    if path.is_dir() and not path.is_symlink():
        if directory is False:
            raise OutputNotReplaceableError(f"{path} is a directory, not a file; choose another output path.")
        if (path / MARKER).is_file() or not any(path.iterdir()):
            return
        raise OutputNotReplaceableError(
            f"{path} is not an ompmoe output (no {MARKER} marker) and holds other files; ompmoe will not delete it. "
            "Choose a new output directory, or move or delete it yourself."
        )
    if directory is True or not path.is_file() or path.is_symlink():
        raise OutputNotReplaceableError(
            f"{path} is not a{' directory written by ompmoe' if directory else ' regular file'}; "
            "ompmoe will not replace it. Choose another output path."
        )


def _probe(path: Path) -> None:
    """Create and delete a file in the nearest existing ancestor of ``path``; turn any OSError into a clear one."""
    ancestor = path.parent
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    probe = ancestor / f".ompmoe-probe.{_owner()}.{secrets.token_hex(4)}"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.unlink(probe)
    except OSError as error:
        code = error.errno or errno.EIO
        raise OutputNotWritableError(
            code,
            f"cannot write {path}: {os.strerror(code)} (in {ancestor}); choose another output_dir "
            "on a writable file system",
        ) from error


def check_writable(
    path: str | os.PathLike,
    overwrite: bool,
    *,
    directory: bool | None = None,
    inputs: Iterable[str | os.PathLike] = (),
) -> Path:
    """Fail before any expensive work if ``path`` cannot be written or must not be replaced.

    Also cleans what killed runs left for ``path``. ``inputs`` are files the run reads: an output containing them is
    never replaced. ``directory`` says whether the output will be a directory (None: either).
    """
    path = Path(path)
    clean_leftovers(path)
    if os.path.lexists(path):
        if not overwrite:
            raise OutputExistsError(_exists_message(path))
        _check_replaceable(path, directory, inputs)
    _probe(path)
    return path


def _renameat2(source: Path, target: Path, flags: int) -> bool:
    """Linux renameat2; False where the C library or file system lacks it (the caller falls back)."""
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if function(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(target))


def _place_new(tmp: Path, path: Path, directory: bool) -> None:
    """Move ``tmp`` to ``path`` only if ``path`` does not exist (EEXIST/ENOTEMPTY otherwise)."""
    if directory:
        if not _renameat2(tmp, path, _RENAME_NOREPLACE):
            os.rename(tmp, path)  # fails on a non-empty directory that appeared meanwhile
        return
    try:
        os.link(tmp, path)  # fails with EEXIST if the target appeared meanwhile
    except FileExistsError:
        raise
    except OSError:  # no hard links on this file system
        os.replace(tmp, path)
    else:
        os.unlink(tmp)


def _commit(tmp: Path, path: Path, overwrite: bool, directory: bool, inputs: Iterable[str | os.PathLike]) -> None:
    if not os.path.lexists(path):
        try:
            _place_new(tmp, path, directory)
            return
        except OSError as error:
            if error.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR):
                raise
    if not overwrite:
        raise OutputExistsError(_exists_message(path) + " It appeared while this run was writing; it was kept.")
    _check_replaceable(path, directory, inputs)
    if not directory:
        os.replace(tmp, path)  # atomic; the old regular file is gone only once the new one is in place
        return
    if _renameat2(tmp, path, _RENAME_EXCHANGE):
        _step("exchanged")
        _remove(tmp)  # tmp now holds the old output
        return
    aside = path.parent / f".{path.name}.{_owner()}.{secrets.token_hex(4)}.old"
    os.rename(path, aside)
    _step("aside")
    try:
        os.rename(tmp, path)
    except BaseException:
        os.rename(aside, path)
        raise
    _step("renamed")
    _remove(aside)


@contextmanager
def atomic_path(
    path: str | os.PathLike,
    overwrite: bool = False,
    directory: bool = False,
    inputs: Iterable[str | os.PathLike] = (),
) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write into; move it into place only on success.

    Directory outputs get the :data:`MARKER` file, so a later run may replace them.
    """
    inputs = list(inputs)
    path = check_writable(path, overwrite, directory=directory, inputs=inputs)
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix, suffix = f".{path.name}.{_owner()}.", ".tmp"
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=path.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=path.parent)
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
        if directory:
            from .. import __version__

            (tmp / MARKER).write_text(json.dumps({"tool": "ompmoe", "version": __version__}))
        _default_permissions(tmp, directory)
        _step("written")
        _commit(tmp, path, overwrite, directory, inputs)
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
    elif os.path.lexists(path):
        path.unlink(missing_ok=True)
