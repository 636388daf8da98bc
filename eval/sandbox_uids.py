"""The uids HumanEval programs run as (as root): one per worker slot, unique on this machine.

A slot's uid is swept after every program, so it must belong to nothing else: no account, no process
running before, no other slot. Slots come from a range far above account ranges (``OMPMOE_SANDBOX_UID``
moves it), each held by an exclusive ``flock`` that the kernel drops when its holder dies.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import os
import pwd
import tempfile
from pathlib import Path
from typing import NamedTuple

from ._sandbox_server import proc_statuses

UID_ENV = "OMPMOE_SANDBOX_UID"
DEFAULT_FIRST_UID = 2_000_000_000
"""First candidate uid: above the account ranges of Linux distributions and the sub-uid ranges of containers."""
SEARCHED = 4096
"""Candidates tried (from the first) before giving up."""
LARGEST_UID = 2**32 - 2  # (uid_t) -1 means "unchanged" to setuid and chown


class SandboxUid(NamedTuple):
    uid: int
    lock_fd: int
    """Open file descriptor holding the slot's ``flock``; pass it to the worker so the lock lives as long as it."""


def first_uid() -> int:
    value = os.environ.get(UID_ENV, str(DEFAULT_FIRST_UID))
    try:
        first = int(value)
    except ValueError:
        first = -1
    if not 1000 <= first <= LARGEST_UID - SEARCHED:
        raise ValueError(f"{UID_ENV}={value} is not a usable first sandbox uid; set it to an integer between 1000 and "
                         f"{LARGEST_UID - SEARCHED} that no account uses, e.g. {DEFAULT_FIRST_UID}.")
    return first


def lock_directory() -> Path:
    """Where slot locks live: root-owned and private (``/run`` where it exists, else the temp directory)."""
    base = Path("/run") if os.access("/run", os.W_OK) else Path(tempfile.gettempdir())
    directory = base / "ompmoe-sandbox-uids"
    directory.mkdir(mode=0o700, exist_ok=True)
    info = directory.stat()
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise PermissionError(f"{directory} must be owned by uid {os.geteuid()} and private (mode 0700); remove it.")
    return directory


def process_uids() -> set[int]:
    """Every uid (real, effective, saved, file system) of every running process."""
    return {int(value) for _, fields in proc_statuses() for value in fields.get("Uid", "").split()}


def is_account(uid: int) -> bool:
    for lookup in (pwd.getpwuid, grp.getgrgid):
        with contextlib.suppress(KeyError):
            lookup(uid)
            return True
    return False


def acquire_uids(count: int) -> list[SandboxUid]:
    """``count`` free slots, locked for this process (release with :func:`release_uids`)."""
    first, directory, taken = first_uid(), lock_directory(), []
    try:
        for uid in range(first, first + SEARCHED):
            if len(taken) == count:
                break
            if is_account(uid) or uid in process_uids():
                continue
            fd = os.open(directory / f"uid-{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(fd)
                if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):  # another evaluation's slot
                    continue
                raise
            if uid in process_uids():  # started between the check and the lock: never ours to sweep
                os.close(fd)
                continue
            taken.append(SandboxUid(uid, fd))
        if len(taken) < count:
            raise RuntimeError(f"Only {len(taken)} of {count} sandbox uids are free in {first}..{first + SEARCHED - 1} "
                               f"(accounts, running processes or other evaluations use the rest); set {UID_ENV} to "
                               "the first uid of another unused range.")
    except BaseException:
        release_uids(taken)
        raise
    return taken


def release_uids(slots: list[SandboxUid]) -> None:
    for slot in slots:
        os.close(slot.lock_fd)
