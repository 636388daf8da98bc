"""Safetensors files written by several threads: the bytes ``safetensors.torch.save_file`` writes, faster.

``save_file`` (and so ``save_pretrained``) copies each GPU tensor into pageable host memory one at a time and writes
the file from one thread: on an H200 a pruned Qwen3-30B-A3B (30 GB) took 34.7 s to save, where the same machine
moved those bytes into pinned host memory in 0.6 s and onto its disk from 8 threads in 1.7 s. Here the file's data
is cut into pieces that a pool of threads writes at their offsets (``os.pwrite`` releases the GIL); the pieces of an
accelerator's tensors go through a host buffer per thread (pinned for CUDA, copied on the thread's own stream).
The header and the data layout are safetensors' own (tensors sorted by dtype, then name), so a file is byte for byte
the one ``save_file`` writes; a tensor of a dtype not in :data:`SAFETENSORS_DTYPES` leaves the file to ``save_file``.
"""

from __future__ import annotations

import json
import os
import queue
import struct
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

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
    """Writer threads: one per core up to 8 (8 saturated an H200 machine's disk; more only adds pinned memory)."""
    return max(1, min(8, os.cpu_count() or 1))


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
    :func:`default_threads`); tensors may live on any device and need not be contiguous."""
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError(f"safetensors metadata must map strings to strings; got {metadata!r}")
    for name, tensor in tensors.items():
        if tensor.device.type == "meta":
            raise ValueError(f"Tensor {name!r} is on the meta device: it has no data to write")
    if sys.byteorder != "little" or any(tensor.dtype not in _ORDER or tensor.layout != torch.strided
                                        for tensor in tensors.values()):
        from safetensors.torch import save_file

        save_file(tensors, filename, metadata=metadata)
        return
    tensors = {name: tensor if tensor.is_contiguous() else tensor.contiguous() for name, tensor in tensors.items()}
    prefix, pieces, total = _layout(tensors, metadata)
    for device in {tensor.device for tensor in tensors.values() if tensor.device.type == "cuda"}:
        torch.cuda.synchronize(device)  # the threads copy on their own streams: the producers' work must be done
    descriptor = os.open(filename, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        os.ftruncate(descriptor, total)
        _write_at(descriptor, memoryview(prefix), 0)
        _write_pieces(descriptor, pieces, threads or default_threads())
    except OSError as error:  # pwrite's errors name no file: a full disk must say which file it stopped
        if error.filename is not None:
            raise
        raise OSError(error.errno, error.strerror, os.fspath(filename)) from error
    finally:
        os.close(descriptor)


def _layout(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> tuple[bytes, list[_Piece], int]:
    """The file's first bytes (header length and header, padded with spaces to 8 bytes as safetensors pads it),
    the data as pieces at their offsets, and the file's size."""
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
    return prefix, pieces, len(prefix) + offset


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s memory as a flat ``uint8`` tensor on its device (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def _write_at(descriptor: int, data: memoryview, offset: int) -> None:
    while data:  # pwrite may write less than asked
        written = os.pwrite(descriptor, data, offset)
        data, offset = data[written:], offset + written


class _StagingSlot:
    """One thread's host buffer and, per CUDA device, the stream its copies from that device run on."""

    def __init__(self, size: int, pinned: bool) -> None:
        self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        self.streams: dict[torch.device, torch.cuda.Stream] = {}

    def fill(self, run: list[_Piece]) -> memoryview:
        """The run's bytes in the buffer: from CUDA, copied on this slot's stream (overlapping the other threads'
        copies and writes) and waited for; from other devices, copied as torch copies them."""
        device = run[0].tensor.device
        stream = None
        if device.type == "cuda":
            stream = self.streams.get(device) or self.streams.setdefault(device, torch.cuda.Stream(device))
        filled = 0
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for piece in run:
                size = piece.stop - piece.start
                self.buffer[filled:filled + size].copy_(_bytes_of(piece.tensor)[piece.start:piece.stop],
                                                        non_blocking=stream is not None)
                filled += size
        if stream is not None:
            stream.synchronize()
        return memoryview(self.buffer[:filled].numpy())


def _write_pieces(descriptor: int, pieces: list[_Piece], threads: int) -> None:
    direct = [piece for piece in pieces if not needs_staging(piece.tensor)]
    staged = list(_staging_runs([piece for piece in pieces if needs_staging(piece.tensor)]))
    slots: queue.SimpleQueue[_StagingSlot] = queue.SimpleQueue()
    if staged:
        size = max(sum(piece.stop - piece.start for piece in run) for run in staged)
        pinned = any(run[0].tensor.device.type == "cuda" for run in staged)
        for _ in range(min(threads, len(staged))):
            slots.put(_StagingSlot(size, pinned))

    def write_direct(piece: _Piece) -> None:
        _write_at(descriptor, memoryview(_bytes_of(piece.tensor)[piece.start:piece.stop].numpy()), piece.offset)

    def write_staged(run: list[_Piece]) -> None:
        slot = slots.get()  # as many slots as threads: a thread never waits here
        try:
            _write_at(descriptor, slot.fill(run), run[0].offset)
        finally:
            slots.put(slot)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        futures = [pool.submit(write_staged, run) for run in staged] + [pool.submit(write_direct, p) for p in direct]
        for future in futures:
            future.result()


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


@contextmanager
def parallel_pretrained_writes() -> Iterator[None]:
    """``save_pretrained`` writes its shards with :func:`write_safetensors` while inside: everything else it does
    (tied weights, the file format's names, shards, index) stays its own. It reads the writer from its module's
    ``safe_save_file``; a transformers without that name saves as it always does."""
    import transformers.modeling_utils as modeling_utils

    original = getattr(modeling_utils, "safe_save_file", None)
    if original is None:
        yield
        return
    modeling_utils.safe_save_file = write_safetensors
    try:
        yield
    finally:
        modeling_utils.safe_save_file = original


__all__ = ["PIECE_BYTES", "SAFETENSORS_DTYPES", "STAGING_BYTES", "default_threads", "parallel_pretrained_writes",
           "write_safetensors"]
