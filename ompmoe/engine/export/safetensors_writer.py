"""Safetensors files written by several threads: the bytes ``safetensors.torch.save_file`` writes, faster.

``save_file`` (and so ``save_pretrained``) copies each GPU tensor into pageable host memory one at a time and writes
the file from one thread: on an H200 a pruned Qwen3-30B-A3B (30 GB) took 34.7 s to save, where the same machine
moved those bytes into pinned host memory in 0.6 s and onto its disk from 8 threads in 1.7 s. Here the file's data
is cut into pieces that a pool of threads writes at their offsets (``os.pwrite`` releases the GIL); the pieces of an
accelerator's tensors go through a host buffer per thread (pinned for CUDA, copied on the thread's own stream).
The header and the data layout are safetensors' own (tensors sorted by dtype, then name), so a file is byte for byte
the one ``save_file`` writes, and it is made as ``save_file`` makes it (checked by its checks, written beside the
target and renamed over it); a tensor of a dtype not in :data:`SAFETENSORS_DTYPES`, or a system without ``pwrite``,
leaves the file to ``save_file``.
"""

from __future__ import annotations

import errno
import json
import os
import queue
import struct
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3", torch.int16: "I16", torch.uint16: "U16", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.int32: "I32", torch.uint32: "U32", torch.float32: "F32",
    torch.complex64: "C64", torch.float64: "F64", torch.int64: "I64", torch.uint64: "U64",
}
"""The dtypes written here, in safetensors' order (the data region holds the last first)."""
_ORDER = {dtype: position for position, dtype in enumerate(SAFETENSORS_DTYPES)}
PIECE_BYTES = 64 * 2**20
"""A thread writes at most this much of a tensor at once, so one large tensor is written by several threads."""
STAGING_BYTES = 256 * 2**20
"""Each thread's host buffer for an accelerator's tensors: pieces are copied in until it is full, then written."""


def default_threads() -> int:
    """Writer threads: one per core this process may use, up to 8 (8 saturated an H200 machine's disk; more only
    adds pinned memory)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores))


@dataclass(frozen=True)
class _Piece:
    """Bytes ``start:stop`` of ``tensor``'s flat bytes, to be written at file offset ``offset``."""

    offset: int
    tensor: torch.Tensor
    start: int
    stop: int


def needs_staging(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s bytes must be copied to host memory before they can be written."""
    return tensor.device.type != "cpu"


def write_safetensors(tensors: dict[str, torch.Tensor], filename: str | os.PathLike,
                      metadata: dict[str, str] | None = None, *, threads: int | None = None) -> None:
    """``safetensors.torch.save_file(tensors, filename, metadata)``, written by ``threads`` threads (default:
    :func:`default_threads`); tensors may live on any device and need not be contiguous. As ``save_file`` does,
    the file is written beside ``filename`` and renamed over it once complete (a failed or interrupted write leaves
    any file there as it was), and tensors sharing memory are refused with its error."""
    from safetensors import torch as safetensors_torch

    check = getattr(safetensors_torch, "_evaluate_tensors_for_save", None)  # its refusals, word for word
    for name, tensor in tensors.items() if isinstance(tensors, dict) else ():
        if not isinstance(name, str):
            raise TypeError(f"safetensors tensor names must be strings; got {name!r}")
        if name == "__metadata__":
            raise ValueError("No tensor can be named '__metadata__': safetensors keeps a file's metadata under it")
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
            raise ValueError(f"Tensor {name!r} is on the meta device: it has no data to write")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError(f"safetensors metadata must map strings to strings; got {metadata!r}")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive whole number (or None: one per core up to 8); got {threads!r}")
    target = Path(filename)
    if target.exists() and not target.is_file():  # renaming over it would put a file where a device or pipe was
        raise ValueError(f"{target} is not a regular file; safetensors files are written as new files that replace "
                         "the one at their path. Choose a file path.")
    if check is not None:
        check(tensors)
    if (check is None or sys.byteorder != "little" or not hasattr(os, "pwrite")
            or any(tensor.dtype not in _ORDER for tensor in tensors.values())):
        safetensors_torch.save_file({name: _plain(tensor) for name, tensor in tensors.items()}, filename,
                                    metadata=metadata)
        return
    descriptor, temporary = tempfile.mkstemp(prefix=".tmp", dir=target.parent)  # before any copy: it may fail
    try:
        try:
            tensors = {name: _plain(tensor) for name, tensor in tensors.items()}
            prefix, pieces = _layout(tensors, metadata)
            for device in {tensor.device for tensor in tensors.values() if tensor.device.type == "cuda"}:
                torch.cuda.synchronize(device)  # the threads copy on their own streams: the producers must be done
            _write_at(descriptor, memoryview(prefix), 0)
            _write_pieces(descriptor, pieces, threads or default_threads())
        finally:
            os.close(descriptor)  # the writer threads are done with it (see _write_pieces)
        os.replace(temporary, target)
    except BaseException as error:
        Path(temporary).unlink(missing_ok=True)
        if isinstance(error, OSError) and error.filename is None:  # pwrite names no file: say which one stopped
            raise OSError(error.errno, error.strerror, os.fspath(filename)) from error
        raise


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as memory holding its values in order: conjugate and negative views resolved, made contiguous."""
    tensor = tensor.resolve_conj().resolve_neg()
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _layout(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> tuple[bytes, list[_Piece]]:
    """The file's first bytes (header length and header, padded with spaces to 8 bytes as safetensors pads it) and
    the data as pieces at their offsets."""
    header: dict[str, object] = {} if metadata is None else {"__metadata__": metadata}
    order = sorted(tensors, key=lambda name: (-_ORDER[tensors[name].dtype], name))
    offset = 0
    for name in order:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    pieces = []
    for name in order:
        tensor, (begin, end) = tensors[name], header[name]["data_offsets"]  # type: ignore[index]
        pieces += [_Piece(len(prefix) + begin + start, tensor, start, min(start + PIECE_BYTES, end - begin))
                   for start in range(0, end - begin, PIECE_BYTES)]
    return prefix, pieces


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s memory as a flat ``uint8`` tensor on its device (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def _write_at(descriptor: int, data: memoryview, offset: int) -> None:
    while data:  # pwrite may write less than asked
        written = os.pwrite(descriptor, data, offset)
        if written == 0:
            raise OSError(errno.EIO, "the file system accepted no bytes")
        data, offset = data[written:], offset + written


class _StagingSlot:
    """One thread's host buffer and, per CUDA device, the stream its copies from that device run on."""

    def __init__(self, size: int, pinned: bool) -> None:
        try:
            self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        except RuntimeError:  # no page-locked memory to be had: copies wait for the device, the writes still overlap
            self.buffer = torch.empty(size, dtype=torch.uint8)
        self.streams: dict[torch.device, torch.cuda.Stream] = {}

    def fill(self, run: list[_Piece]) -> memoryview:
        """The run's bytes in the buffer. From CUDA, copied on this slot's stream (overlapping the other threads'
        copies and writes) and waited for, also when a copy fails (the buffer goes back to the pool); from other
        accelerators, one thread at a time (MPS crashes when two threads use it at once)."""
        device = run[0].tensor.device
        stream = None
        if device.type == "cuda":
            if device not in self.streams:
                self.streams[device] = torch.cuda.Stream(device)
            stream = self.streams[device]
        filled = 0
        with torch.cuda.stream(stream) if stream is not None else _ACCELERATOR_COPIES:
            try:
                for piece in run:
                    size = piece.stop - piece.start
                    self.buffer[filled:filled + size].copy_(_bytes_of(piece.tensor)[piece.start:piece.stop],
                                                            non_blocking=stream is not None)
                    filled += size
            finally:
                if stream is not None:
                    stream.synchronize()
        return memoryview(self.buffer[:filled].numpy())


def _write_pieces(descriptor: int, pieces: list[_Piece], threads: int) -> None:
    """Every piece written at its offset by ``threads`` threads. On the first failure (or an interrupt) the pieces
    not started are dropped, and this returns only once no thread can write to ``descriptor`` any more: the caller
    closes it, and a later ``open`` may reuse its number."""
    direct = [piece for piece in pieces if not needs_staging(piece.tensor)]
    staged = list(_staging_runs([piece for piece in pieces if needs_staging(piece.tensor)]))
    slots: queue.SimpleQueue[_StagingSlot] = queue.SimpleQueue()
    if staged:
        size = max(sum(piece.stop - piece.start for piece in run) for run in staged)
        pinned = any(run[0].tensor.device.type == "cuda" for run in staged)
        for _ in range(min(threads, len(staged))):
            slots.put(_StagingSlot(size, pinned))
    stop = threading.Event()

    def stopping_on_failure(write: Callable[[Any], None]) -> Callable[[Any], None]:
        def guarded(work: Any) -> None:
            if stop.is_set():
                return
            try:
                write(work)
            except BaseException:
                stop.set()  # the other threads start no further piece
                raise
        return guarded

    @stopping_on_failure
    def write_direct(piece: _Piece) -> None:
        _write_at(descriptor, memoryview(_bytes_of(piece.tensor)[piece.start:piece.stop].numpy()), piece.offset)

    @stopping_on_failure
    def write_staged(run: list[_Piece]) -> None:
        slot = slots.get()  # as many slots as threads: a thread never waits here
        try:
            _write_at(descriptor, slot.fill(run), run[0].offset)
        finally:
            slots.put(slot)

    pool = ThreadPoolExecutor(max_workers=threads)
    futures: list[Future] = []
    try:
        for write, work in [(write_staged, run) for run in staged] + [(write_direct, piece) for piece in direct]:
            futures.append(pool.submit(write, work))  # one by one: an interrupt here still waits for those sent
        for future in futures:
            future.result()
    except BaseException:
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        _wait_for(futures)  # each running thread ends its one piece
        pool.shutdown(wait=False)


def _wait_for(futures: list[Future]) -> None:
    """Wait until every one of ``futures`` not cancelled is done, also through further interrupts (each thread has at
    most one piece left)."""
    for future in futures:
        while True:
            try:
                future.exception()  # waits, raises nothing the piece raised
                break
            except CancelledError:
                break
            except KeyboardInterrupt:
                continue


def _staging_runs(pieces: list[_Piece]) -> Iterator[list[_Piece]]:
    """Pieces of one device that follow each other in the file, in runs of at most :data:`STAGING_BYTES`: a run
    fills a buffer and is written with one call."""
    run: list[_Piece] = []
    filled = 0
    for piece in pieces:
        size = piece.stop - piece.start
        last = run[-1] if run else None
        joins = (last is not None and last.offset + last.stop - last.start == piece.offset
                 and last.tensor.device == piece.tensor.device and filled + size <= STAGING_BYTES)
        if run and not joins:
            yield run
            run, filled = [], 0
        run.append(piece)
        filled += size
    if run:
        yield run


_ACCELERATOR_COPIES = threading.Lock()
"""Copies from accelerators other than CUDA, one at a time in the whole process (MPS crashes when two threads use
it at once, also from two saves)."""
_patch_lock = threading.RLock()
_patch_users = 0
_installed: Callable[..., None] | None = None
"""The writer put in transformers' module while any context is inside :func:`parallel_pretrained_writes`."""
_inside: ContextVar[int] = ContextVar("ompmoe_parallel_pretrained_writes", default=0)
"""How deep this thread or task is in :func:`parallel_pretrained_writes` (a task's, or a generator's, own count)."""


@contextmanager
def parallel_pretrained_writes() -> Iterator[None]:
    """``save_pretrained`` calls in this context write their shards with :func:`write_safetensors` while inside:
    everything else it does (tied weights, the file format's names, shards, index) stays its own. transformers
    reads its writer from its module's ``safe_save_file``; while any thread or task is inside, that name holds a
    writer that sends calls from inside here and every other caller's to safetensors, and the last to leave puts
    safetensors' back (unless someone else replaced it meanwhile). A transformers without the name saves as it
    always does."""
    global _patch_users, _installed
    import transformers.modeling_utils as modeling_utils

    with _patch_lock:
        if _patch_users == 0:
            stock = getattr(modeling_utils, "safe_save_file", None)
            _installed = None if stock is None else _dispatching_writer(stock)
            if _installed is not None:
                modeling_utils.safe_save_file = _installed
        _patch_users += 1
    try:
        _inside.set(_inside.get() + 1)
        try:
            yield
        finally:
            _inside.set(_inside.get() - 1)  # a count, not a saved value: contexts may end out of order
    finally:
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                if _installed is not None and getattr(modeling_utils, "safe_save_file", None) is _installed:
                    modeling_utils.safe_save_file = _installed.stock  # type: ignore[attr-defined]
                _installed = None


def _dispatching_writer(stock: Callable[..., None]) -> Callable[..., None]:
    """transformers' ``safe_save_file`` while :func:`parallel_pretrained_writes` is in use somewhere."""

    def safe_save_file(tensors, filename, metadata=None):
        if _inside.get() > 0:
            return write_safetensors(tensors, filename, metadata)
        return stock(tensors, filename, metadata=metadata)

    safe_save_file.stock = stock  # type: ignore[attr-defined]
    return safe_save_file


__all__ = ["PIECE_BYTES", "SAFETENSORS_DTYPES", "STAGING_BYTES", "default_threads", "parallel_pretrained_writes",
           "write_safetensors"]
