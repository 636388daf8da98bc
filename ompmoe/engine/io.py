"""Atomic outputs that never lose a user's files (rules and guarantees: docs/outputs.md).

An output is written into a hidden temporary sibling under a run lock (``flock``) and renamed into place only on
success; only what ompmoe made is ever replaced, never the working directory or the run's inputs, and a killed run's
leftovers are cleaned by the next run once its lock is free.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import re
import resource
import secrets
import shutil
import socket
import weakref
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from itertools import takewhile
from pathlib import Path
from typing import Any

MARKER = ".ompmoe-output"
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


class OutputExistsError(FileExistsError):
    """The destination exists and overwriting was not requested."""


class OutputNotReplaceableError(FileExistsError):
    """The destination exists but is not something ompmoe may delete (not its output, or it holds inputs)."""


class OutputNotWritableError(OSError):
    """The destination cannot be written: read-only file system, permissions, not a directory (found before any
    work), or a write that failed midway (full disk, file-size limit, quota), whatever library raised it."""


class OutputInUseError(OutputNotWritableError):
    """Another live ompmoe run is writing the destination now (it holds the run lock there); ``errno`` is EBUSY.
    ``str()`` is the message alone (no ``[Errno 16]``)."""

    def __str__(self) -> str:
        return str(self.strerror)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def _owner() -> str:
    return f"{_host()}-{os.getpid()}"


def _identity() -> dict[str, str]:
    """Who this process is, beyond host and pid: pids repeat across PID namespaces (containers) and reboots."""
    boot_id = pid_namespace = ""
    with suppress(OSError):
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    with suppress(OSError):
        namespace = os.stat("/proc/self/ns/pid")
        pid_namespace = f"{namespace.st_dev}:{namespace.st_ino}"
    return {"host": _host(), "boot_id": boot_id, "pid_namespace": pid_namespace, "pid": str(os.getpid())}


def _read_identity(fd: int) -> dict[str, str]:
    """The identity JSON a lock file holds (``{}`` when unreadable or not yet written)."""
    with suppress(OSError, ValueError):
        identity = json.loads(os.pread(fd, 4096, 0) or b"{}")
        if isinstance(identity, dict):
            return {str(key): str(value) for key, value in identity.items()}
    return {}


def _pid_alive(identity: dict[str, str]) -> bool | None:
    """Whether the process a lock file names is alive; None when that cannot be told here: no pid, or another host,
    boot or PID namespace (where the same pid names another process)."""
    mine = _identity()
    if any(identity.get(key) != mine[key] for key in ("host", "boot_id", "pid_namespace")):
        return None
    try:
        os.kill(int(identity["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except (OSError, ValueError, KeyError):
        return None
    return True


def _claim(lock: Path, live: list[dict[str, str]]) -> int | None:
    """An open descriptor holding the lock of a dead run, or None while its run may be alive (or cannot be told).
    A run known to be alive (its ``flock`` held; without ``flock``, its identity) is appended to ``live``."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd  # the kernel released its owner's lock: that process is gone
    except BlockingIOError:  # held by a live process
        live.append(_read_identity(fd))
    except OSError:  # no flock here: the identity written in the file decides
        identity = _read_identity(fd)
        alive = _pid_alive(identity)
        if alive is False:
            return fd
        if alive:
            live.append(identity)
    os.close(fd)
    return None


class _RunLock:
    """The lock this run holds on ``.{name}.{owner}.{token}.lock`` while its temporaries exist."""

    def __init__(self, path: Path) -> None:
        identity = json.dumps(_identity()).encode()
        while True:
            self.token = secrets.token_hex(4)
            self.path = self.sibling(path, "lock")
            self.fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.write(self.fd, identity)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a cleaner is testing it this instant and will delete it: take another
                os.close(self.fd)
                continue
            except OSError:
                pass  # no flock on this file system: the identity in the file protects it
            with suppress(FileNotFoundError):  # a cleaner took it for a dead run's and deleted it before our flock
                if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                    return
            os.close(self.fd)

    def sibling(self, path: Path, kind: str) -> Path:
        """``.{name}.{owner}.{token}.{kind}`` next to ``path``: a name the cleaner ties to this lock."""
        return path.parent / f".{path.name}.{_owner()}.{self.token}.{kind}"

    def release(self, keep_file: bool = False) -> None:
        """Drop the lock; ``keep_file``: leave its file, so that the next run takes this one's leftovers for a dead
        run's and removes them."""
        if self.fd >= 0:
            if not keep_file:
                self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = -1


def _step(name: str) -> None:
    """No-op between the steps of a commit; tests replace it to kill the process at a chosen point."""


def clean_leftovers(path: str | os.PathLike, live: list[dict[str, str]] | None = None) -> list[Path]:
    """Remove temporaries of dead ompmoe runs for ``path``; restore an aside copy if ``path`` itself is missing.
    Returns the removed or restored entries (lock files not listed); appends to ``live`` the identity of each live
    run writing ``path`` now."""
    path, live = Path(path), [] if live is None else live
    if not path.parent.is_dir():
        return []
    pattern = re.compile(
        rf"^\.{re.escape(path.name)}\.(?P<owner>[A-Za-z0-9-]+-\d+)\.(?P<token>[a-f0-9]+)\."
        r"(?P<kind>tmp|old|scratch|lock)$")
    runs: dict[tuple[str, str], dict[str, Path]] = {}
    for entry in sorted(path.parent.iterdir()):
        if (match := pattern.match(entry.name)) is not None:
            runs.setdefault((match["owner"], match["token"]), {})[match["kind"]] = entry
    handled = []
    mine = {_file_id(held.lock.path) for held in _held_reservations()} - {None}  # the lock files this process holds
    for entries in runs.values():
        if "lock" in entries and _file_id(entries["lock"]) in mine:
            continue  # this process's own reservation: neither dead nor another run
        fd = _claim(entries["lock"], live) if "lock" in entries else None
        if fd is None:
            continue
        try:
            with suppress(FileNotFoundError):  # other ranks of the same job may clean concurrently: losing is fine
                for kind in ("old", "tmp", "scratch"):
                    entry = entries.get(kind)
                    if entry is None or not os.path.lexists(entry):
                        continue
                    if kind == "old" and not os.path.lexists(path):
                        os.rename(entry, path)  # killed between "old -> aside" and "new -> target": restore the old
                    else:
                        _remove(entry)
                        if os.path.lexists(entry):  # not removable (permissions): left for a later run
                            continue
                    handled.append(entry)
                if not any(os.path.lexists(entries[kind]) for kind in ("old", "tmp", "scratch") if kind in entries):
                    entries["lock"].unlink(missing_ok=True)  # else kept: the next run tries again
        finally:
            os.close(fd)
    return sorted(handled)


def _exists_message(path: Path) -> str:
    return (
        f"{path} already exists; pass --overwrite (overwrite=True in Python) to replace it, "
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
        item_path = Path(item).expanduser()
        # The file itself and, for an input that is a symlink, the link (deleting it breaks the argument too).
        sources = {item_path.resolve(), item_path.absolute().parent.resolve() / item_path.name}
        if any(source == resolved or resolved in source.parents for source in sources):
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


def existing_ancestor(path: Path) -> Path:
    """The nearest ancestor of ``path`` that exists (where an output not made yet will be written)."""
    ancestor = path.parent
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    return ancestor


def _probe(path: Path) -> None:
    """Create and delete a file in the nearest existing ancestor of ``path``; turn any OSError into a clear one."""
    ancestor = existing_ancestor(path)
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
    path: str | os.PathLike, overwrite: bool, *, directory: bool | None = None, inputs: Iterable[str | os.PathLike] = ()
) -> Path:
    """Fail before any expensive work if ``path`` cannot be written or must not be replaced, or if another live run is
    writing it now or has reserved it (:class:`OutputInUseError`, also with ``overwrite``; this process's own
    reservations do not count); clean what dead runs left.
    ``inputs``: files the run reads, never replaced. ``directory``: whether the output is a directory (None: either).
    """
    path = _normalised(Path(path))
    _check_name_lengths(path)
    _refuse_in_use(path)
    if os.path.lexists(path):
        if not overwrite:
            raise OutputExistsError(_exists_message(path))
        _check_replaceable(path, directory, inputs)
    _probe(path)
    return path


class Reservation(AbstractContextManager):
    """This process's claim on an output, from the check before any work (calibration) until the write that commits
    it: the run lock (``.{name}.{owner}.{token}.lock``) taken early, so that another run's :func:`check_writable`
    refuses the output (:class:`OutputInUseError`) while this run is still calibrating.

    :func:`atomic_path` for the same output takes the reservation over, writes under its lock and releases it when it
    ends (committed or failed). Otherwise call :meth:`release` (or use it as a context manager); a reservation that
    is garbage-collected, or still held at interpreter exit, is released then, and one of a process that died is
    cleaned by the next run like any dead run's lock. Reservations of this process never block it.
    """

    def __init__(self, path: Path, overwrite: bool, directory: bool | None, inputs: Iterable[str | os.PathLike]
                 ) -> None:
        self.path = check_writable(path, overwrite, directory=directory, inputs=inputs)
        self._created = _make_parents(self.path.parent)
        try:
            self.lock = _RunLock(self.path)
        except BaseException:
            _remove_made(self._created)
            raise
        self._scratch: list[Path] = []
        self._finalizer = weakref.finalize(self, _release_reservation, self.lock, self._created, os.getpid(),
                                           self._scratch)
        _RESERVATIONS.setdefault(_output_key(self.path), []).append(weakref.ref(self))
        try:  # two runs that checked at the same instant both hold a lock now: each sees the other's and backs off
            _refuse_in_use(self.path)
        except BaseException:
            self.release()
            raise

    @property
    def held(self) -> bool:
        """Whether the output is still reserved (neither written nor released)."""
        return self._finalizer.alive

    def scratch(self) -> Path:
        """A private directory beside the output for the run's temporary files (``.{name}.{owner}.{token}.scratch``),
        made on the first call: removed with the reservation, and a killed run's by the next run's check."""
        if not self._scratch:
            path = self.lock.sibling(self.path, "scratch")
            os.mkdir(path, 0o700)
            self._scratch.append(path)
        return self._scratch[0]

    def release(self, *, keep_directories: bool = False) -> None:
        """Give the output up: remove the lock file and, unless ``keep_directories`` (the output is in them now), the
        directories made for it if still empty. Idempotent; does nothing in a forked child (a DataLoader worker)."""
        if keep_directories:
            self._created.clear()  # the finalizer's list: it removes none of them
        self._finalizer()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Reservation({str(self.path)!r}, held={self.held})"


_RESERVATIONS: dict[tuple[int, int, str], list[weakref.ref[Reservation]]] = {}
"""This process's reservations, by output (its parent directory's device and inode, and its name)."""


def _output_key(path: Path) -> tuple[int, int, str]:
    parent = os.stat(path.parent)
    return parent.st_dev, parent.st_ino, path.name


def _file_id(path: Path) -> tuple[int, int] | None:
    with suppress(OSError):
        found = os.stat(path)
        return found.st_dev, found.st_ino
    return None


def _held_reservations(key: tuple[int, int, str] | None = None) -> list[Reservation]:
    """This process's reservations still held (of the output ``key`` only, if given), oldest first."""
    refs = [ref for each in (list(_RESERVATIONS) if key is None else [key]) for ref in _RESERVATIONS.get(each, [])]
    return [reservation for ref in refs if (reservation := ref()) is not None and reservation.held]


def _release_reservation(lock: _RunLock, created: list[Path], pid: int, scratch: list[Path]) -> None:
    """A reservation's release (also its finalizer: it must not refer to the reservation)."""
    if os.getpid() != pid:  # a forked child inherited the object: the lock is its parent's to release
        return
    for path in scratch:  # before the lock: a scratch directory without it would never be cleaned
        _remove(path)
    # one left (not removable now, e.g. busy on NFS): its lock file stays, free, so the next run removes it
    lock.release(keep_file=any(os.path.lexists(path) for path in scratch))
    _remove_made(created)
    for key, refs in list(_RESERVATIONS.items()):
        refs[:] = [ref for ref in refs if (reservation := ref()) is not None and reservation.held]
        if not refs:
            del _RESERVATIONS[key]


def reserve(path: str | os.PathLike, overwrite: bool, *, directory: bool | None = None,
            inputs: Iterable[str | os.PathLike] = ()) -> Reservation:
    """:func:`check_writable`, then hold the output for this run until it is written (:class:`Reservation`): another
    run that checks it meanwhile is refused up front (:class:`OutputInUseError`) instead of calibrating in vain."""
    return Reservation(Path(path), overwrite, directory, inputs)


def _refuse_in_use(path: Path) -> None:
    """Clean what dead runs left; :class:`OutputInUseError` naming, per its lock file, a live run using ``path``."""
    live: list[dict[str, str]] = []
    clean_leftovers(path, live)
    if not live:
        return
    holder, mine = live[0], _identity()
    who = f"pid {holder['pid']}" if holder.get("pid") else "pid unknown"
    if holder.get("host") and holder["host"] != mine["host"]:
        who += f" on host {holder['host']}"
    elif holder.get("pid_namespace") and holder["pid_namespace"] != mine["pid_namespace"]:
        who += ", in another container or PID namespace"
    raise OutputInUseError(errno.EBUSY, f"another ompmoe run ({who}) is using {path} (calibrating or writing it); "
                           "wait for it to finish, or choose another output path")


def _normalised(path: Path) -> Path:
    """``path`` with ``..`` resolved as the file system would (``X/new/..`` is ``X``); a symlinked name is kept."""
    if ".." not in path.parts:
        return path
    if path.name in ("", ".", ".."):
        return Path(os.path.realpath(path))
    return Path(os.path.realpath(path.parent)) / path.name


def _check_name_lengths(path: Path) -> None:
    """Refuse names the file system cannot hold, counting the temporary sibling ``.{name}.{owner}.{random}.lock``."""
    ancestor = path.parent
    while not os.path.isdir(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    try:
        limit = os.pathconf(ancestor, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    for part in path.parent.parts:
        if len(os.fsencode(part)) > limit:
            raise OutputNotWritableError(
                errno.ENAMETOOLONG,
                f"cannot write {path}: the directory name {part!r} is longer than the {limit} bytes this file "
                "system allows; choose a shorter output path",
            )
    extra = len(os.fsencode(f"..{_owner()}.{'0' * 8}.scratch"))  # the longest sibling
    if len(os.fsencode(path.name)) + extra > limit:
        raise OutputNotWritableError(
            errno.ENAMETOOLONG,
            f"cannot write {path}: its name is {len(os.fsencode(path.name))} bytes long, and its temporary sibling "
            f"(.<name>.{_owner()}.<random>.scratch) needs {extra} more than that, over the {limit} bytes this file "
            f"system allows; choose an output name of at most {limit - extra} bytes",
        )


def local_inputs(*values: Any) -> list[str]:
    """The local files and directories among ``values`` (paths, lists of them, ``None``): what a run reads from disk.
    Strings naming nothing on disk (hub ids, ``tiny:`` names) are left out; pass the result as ``inputs=``."""
    found: list[str] = []
    for value in values:
        if isinstance(value, (list, tuple)):
            found.extend(local_inputs(*value))
        elif isinstance(value, (str, os.PathLike)) and os.fspath(value) and os.path.lexists(os.path.expanduser(value)):
            found.append(os.fspath(value))
    return found


def inputs_of(*owners: Any) -> list[str]:
    """Local paths a LightningModule / data module reads (model, tokenizer, data files, validation sources): the
    attributes of ``CalibrationModule``, ``FinetuneModule`` and their data modules."""
    names = ("model_name_or_path", "tokenizer_name", "tokenizer", "source", "data_files", "val_sources")
    return local_inputs(*(getattr(owner, name, None) for owner in owners if owner is not None for name in names))


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


def _commit(
    tmp: Path, path: Path, overwrite: bool, directory: bool, inputs: Iterable[str | os.PathLike], lock: _RunLock
) -> None:
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
    aside = lock.sibling(path, "old")
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
    path: str | os.PathLike, overwrite: bool = False, directory: bool = False, inputs: Iterable[str | os.PathLike] = ()
) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write into; move it into place only on success. Directory outputs
    get the :data:`MARKER` file, so a later run may replace them. A write that fails for want of space, quota, file
    size or a writable file system, whichever library raised it, leaves as one :class:`OutputNotWritableError`
    naming ``path`` and the cause (the original error is its ``__cause__``); every other error passes unchanged.
    A :class:`Reservation` this process holds on ``path`` is taken over: written under its lock, released at the end."""
    inputs = list(inputs)
    try:  # the latest reservation this process holds on path, if any
        held = _held_reservations(_output_key(_normalised(Path(path))))
    except OSError:  # no parent directory: nothing reserved there
        held = []
    reservation = held[-1] if held else None
    try:
        path = check_writable(path, overwrite, directory=directory, inputs=inputs)
    except BaseException:
        if reservation is not None:
            reservation.release()
        raise
    existed = os.path.lexists(path)
    created = _make_parents(path.parent)
    tmp: Path | None = None
    lock: _RunLock | None = None
    try:
        lock = reservation.lock if reservation is not None else _RunLock(path)
        tmp = lock.sibling(path, "tmp")
        if directory:
            os.mkdir(tmp, 0o700)
        else:
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        yield tmp
        if directory:
            from .version import __version__

            (tmp / MARKER).write_text(json.dumps({"tool": "ompmoe", "version": __version__}))
        _default_permissions(tmp, directory)
        _step("written")
        _commit(tmp, path, overwrite, directory, inputs, lock)
    except BaseException as error:
        try:  # before the temporary, the evidence, is removed; never in the way of the original error
            failure = _write_failure(error, path, tmp, existed)
        except Exception:  # pragma: no cover - a defect here must not hide what went wrong
            failure = None
        if tmp is not None:
            _remove(tmp)
        if reservation is not None:  # its lock, and the directories made for it, if empty
            reservation.release()
        elif lock is not None:
            lock.release()  # before the directories it lives in are removed (the release in finally is then a no-op)
        _remove_made(created)
        if failure is not None:
            raise failure from error
        raise
    finally:
        if reservation is not None:  # committed (the output is in the directories it made), or the clean-up failed
            reservation.release(keep_directories=True)
        elif lock is not None:
            lock.release()


def _remove_made(created: list[Path]) -> None:
    with suppress(OSError):
        for made in reversed(created):
            made.rmdir()


_WRITE_ERRNOS = {
    errno.ENOSPC: "Free space on that file system or choose another output path.",
    errno.EDQUOT: "Free space within your quota or choose another output path.",
    errno.EFBIG: "Raise the limit (ulimit -f) or choose another output path.",
    errno.EROFS: "Choose another output path, on a writable file system.",
}
"""What a write that fails midway can tell: full disk, quota, file-size limit, read-only file system; and the fix."""

_BUGS = (TypeError, AttributeError, NameError, LookupError, AssertionError, ArithmeticError, NotImplementedError,
         RecursionError, ImportError, SyntaxError)
"""Exceptions that show a bug, never converted: their traceback must stay visible."""

_ERRNO_TEXT = re.compile(r"(?:\(os error |\[Errno )(\d+)[)\]]")
"""How other libraries quote the operating system's error: Rust's io::Error (safetensors, tokenizers) and Python's."""


def _errno_of(error: BaseException) -> int | None:
    """The full-disk / size-limit / quota / read-only errno behind ``error`` (an ``OSError`` or any library's error
    quoting one, directly or as its cause), or None: anything else, and every bug, is left as it is."""
    seen: set[int] = set()
    current: BaseException | None = error
    while isinstance(current, Exception) and not isinstance(current, _BUGS) and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError):
            codes = [current.errno]
        else:  # a user error's (ValueError's) text may quote anything; its cause still counts
            codes = [] if isinstance(current, ValueError) else [int(c) for c in _ERRNO_TEXT.findall(str(current))]
        for code in codes:
            if code in _WRITE_ERRNOS:
                return code
        current = current.__cause__ or current.__context__
    return None


def _being_written(error: BaseException, tmp: Path | None) -> str:
    """The file the failed write was at, relative to the output (``model/config.json``), or ``""`` when not known
    (libraries may delete their partial file): a nested output's, else the ``OSError``'s file name."""
    nested = getattr(error, "output", None) if isinstance(error, OutputNotWritableError) else None
    named = nested or (error.filename if isinstance(error, OSError) else None)
    if not isinstance(named, (str, bytes, os.PathLike)) or not named:
        return ""
    candidate, inner = Path(os.fsdecode(named)), error.file if nested else ""  # type: ignore[attr-defined]
    if tmp is not None and candidate.is_relative_to(tmp):
        relative = Path(candidate.relative_to(tmp), inner)
        return "" if relative == Path(".") else str(relative)
    return inner if nested else str(candidate)


def _write_failure(error: BaseException, path: Path, tmp: Path | None, existed: bool
                   ) -> OutputNotWritableError | None:
    """``error`` as one :class:`OutputNotWritableError` naming ``path`` and the cause, or None (:func:`_errno_of`)."""
    code = _errno_of(error)
    if code is None:
        return None
    reason, fix = os.strerror(code), _WRITE_ERRNOS[code]
    if code == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            reason += f" (this process may write files of at most {readable_size(limit)}: ulimit -f)"
        else:
            reason += " (larger than this file system allows)"
            fix = "Choose another output path, on a file system that allows larger files."
    file = _being_written(error, tmp)
    if file:
        reason += f" while writing {file}"
    detail = getattr(error, "detail", "") if isinstance(error, OutputNotWritableError) else ""  # a nested output's
    if not isinstance(error, OSError):  # the library that was writing: safetensors (the weights), tokenizers, ...
        package = type(error).__module__.split(".")[0]
        detail = f" (reported by {'' if package == 'builtins' else package + '.'}{type(error).__name__})"
    kept = "the previous output is unchanged" if existed else "nothing was written there"
    failure = OutputNotWritableError(code, f"cannot write {path}: {reason}{detail}; {kept}. {fix}")
    failure.output, failure.file, failure.detail = str(path), file, detail  # type: ignore[attr-defined]
    return failure


def readable_size(count: float) -> str:
    """``512 bytes``, ``3.5 MiB``, ``12.3 GiB``, ``1.02 TiB``: three significant digits."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(count) < 1024:
            return f"{int(count)} {unit}" if unit == "bytes" else f"{count:.3g} {unit}"
        count /= 1024
    return f"{count:.3g} TiB"


def _make_parents(directory: Path) -> list[Path]:
    """Create ``directory`` and its missing ancestors; return those this call created, outermost first."""
    missing = takewhile(lambda ancestor: not os.path.isdir(ancestor), [directory, *directory.parents])
    created = []
    for made in reversed(list(missing)):
        with suppress(FileExistsError):  # made meanwhile by another rank: not ours to remove
            made.mkdir()
            created.append(made)
    return created


def _default_permissions(path: Path, directory: bool) -> None:
    """Temporaries are private (0600/0700), and so are some files in them (transformers writes ``model.safetensors``
    0600): give the result and all in it the umask's permissions, so a shared output is readable as umask allows."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if directory else 0o666) & ~umask)
    for root, folders, files in os.walk(path) if directory else ():
        for entry in (os.path.join(root, name) for name in folders + files):
            if not os.path.islink(entry):  # directories and executables get x
                executable = os.path.isdir(entry) or os.stat(entry).st_mode & 0o111
                os.chmod(entry, (0o777 if executable else 0o666) & ~umask)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
