"""Checkpoint bytes into parameters: read by several threads into staging buffers, copied to
the device asynchronously on a stream of their own.

A parameter's share of a checkpoint tensor (`StoredTensor`, rows and columns) is queued with
`copy`; queued pieces fill a staging buffer, and a full buffer is read from the files by a
pool of threads (`os.preadv` into the buffer's memory: no memory map, no page faults, and the
GIL released for the whole read), several buffers ahead. Once a buffer is read its pieces are
copied to their parameters: on a GPU from page-locked memory, without waiting, on a side
stream, converting dtypes and selecting columns on the device; the buffer is refilled once
its copies are done (an event). Pieces larger than a buffer go in runs of rows.

The buffers are plain host memory page-locked by registering it with CUDA, not torch's
pinned-memory cache, which would keep them resident after the load; `close` unregisters and
frees them (issue 21: no host copies of the weights outlive loading).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from pegainfer.core.errors import WeightLoadError
from pegainfer.core.loading.safetensors_index import StoredTensor

logger = logging.getLogger(__name__)

BUFFER_BYTES = 64 << 20
NUM_BUFFERS = 4
# Reads at most this large each, so that one tensor's bytes are read by several threads.
_READ_BYTES = 8 << 20
# Each piece starts at this alignment in its buffer (any dtype can view it).
_ALIGN = 64


def default_readers() -> int:
    """Threads reading the checkpoint: page-cache copies scale to a handful of cores."""
    return max(1, min(8, os.cpu_count() or 1))


@dataclass(frozen=True)
class _Piece:
    """Rows of a checkpoint tensor (`shape`, read from `offset`) bound for `dst`, which takes
    all of their columns or those in `cols`."""

    dst: torch.Tensor
    path: Path
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    cols: tuple[int, int] | None
    position: int = 0  # in its buffer, once batched

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class _Batch:
    buffer: int
    pieces: list[_Piece]
    reads: list[Future[None]]


class CheckpointCopies:
    """`copy(dst, stored, rows, cols)` queues the part of a checkpoint tensor that goes into
    `dst`; use as a context manager: leaving it reads and copies what is queued, waits for
    the copies and releases the buffers, the threads and the files. `page_locked=False` stages
    through plain memory (the CPU, where copies are synchronous)."""

    def __init__(
        self,
        device: torch.device,
        buffer_bytes: int = BUFFER_BYTES,
        num_buffers: int = NUM_BUFFERS,
        readers: int | None = None,
        progress: bool = False,
    ) -> None:
        if num_buffers < 2 or buffer_bytes < _ALIGN or buffer_bytes % _ALIGN:
            raise ValueError(f"staging needs two buffers at least, of a multiple of {_ALIGN} bytes")
        self._started = time.perf_counter()  # the buffers' registration included
        self.device = device
        self._cuda = device.type == "cuda"
        self._capacity = buffer_bytes
        self._buffers = [torch.empty(buffer_bytes, dtype=torch.uint8) for _ in range(num_buffers)]
        self._registered = False
        if self._cuda:
            for buffer in self._buffers:
                _check(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer_bytes, 0))
            self._registered = True
            self._stream = torch.cuda.Stream(device)
            # The parameters were made on the current stream.
            self._stream.wait_stream(torch.cuda.current_stream(device))
        self._memory = [_writable(buffer) for buffer in self._buffers]
        self._copied: list[torch.cuda.Event | None] = [None] * num_buffers
        self._readers = readers or default_readers()
        self._pool = ThreadPoolExecutor(self._readers, "pegainfer-read")
        self._files: dict[Path, int] = {}
        self._queued: list[_Piece] = []
        self._queued_bytes = 0
        self._in_flight: deque[_Batch] = deque()
        self._next_buffer = 0
        self._progress = tqdm(desc="Loading weights", unit="B", unit_scale=True,
                              disable=not progress)  # fmt: skip
        self._copied_bytes = 0

    def __enter__(self) -> CheckpointCopies:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(finish=exc_type is None)

    def copy(
        self,
        dst: torch.Tensor,
        stored: StoredTensor,
        rows: tuple[int, int] | None = None,
        cols: tuple[int, int] | None = None,
    ) -> None:
        """Queue `stored`'s rows [start, end) (all by default), of those its columns
        [start, end) (all by default), for `dst`, a tensor of the selection's shape (its dtype
        may differ: converted as `Tensor.copy_` does)."""
        start, end = rows or (0, stored.num_rows)
        shape = (end - start, *stored.shape[1:]) if stored.shape else ()
        if cols is not None:
            if len(shape) < 2:
                raise WeightLoadError(f"checkpoint tensor {stored.name!r} has no columns to select")
            shape_of_dst = (shape[0], cols[1] - cols[0], *shape[2:])
        else:
            shape_of_dst = shape
        if tuple(dst.shape) != shape_of_dst:
            raise ValueError(f"cannot copy a {shape_of_dst} selection into {tuple(dst.shape)}")
        if stored.numel == 0 or dst.numel() == 0:
            return
        row_bytes = stored.row_bytes if stored.shape else stored.nbytes
        if row_bytes > self._capacity:
            self._copy_wide_rows(dst, stored, start, end, cols)
            return
        step = self._capacity // row_bytes
        for first in range(start, end, step):
            last = min(first + step, end)
            piece_shape = (last - first, *stored.shape[1:]) if stored.shape else ()
            target = dst[first - start : last - start] if stored.shape else dst
            self._queue(_Piece(target, stored.path, stored.offset + first * row_bytes,
                               stored.dtype, piece_shape, cols))  # fmt: skip

    def _copy_wide_rows(
        self, dst: torch.Tensor, stored: StoredTensor, start: int, end: int,
        cols: tuple[int, int] | None,
    ) -> None:  # fmt: skip
        """Rows wider than a buffer (of a tensor of two dimensions or more): each row as a
        tensor of its own, whose rows are the selected columns."""
        for row in range(start, end):
            inner = StoredTensor(stored.name, stored.path, stored.offset + row * stored.row_bytes,
                                 stored.dtype, stored.shape[1:])  # fmt: skip
            self.copy(dst[row - start], inner, rows=cols)

    def read(self, stored: StoredTensor) -> torch.Tensor:
        """`stored` read now, into memory of its own (small tensors: an INT4 weight's shape)."""
        out = torch.empty(stored.shape, dtype=stored.dtype)
        if stored.numel:
            _read_into(stored.path, self._fd(stored.path),
                       _writable(out.view(-1).view(torch.uint8)), stored.offset)  # fmt: skip
        return out

    def _queue(self, piece: _Piece) -> None:
        size = -(-piece.nbytes // _ALIGN) * _ALIGN
        if self._queued_bytes + size > self._capacity:
            self._submit()
        self._queued.append(_Piece(piece.dst, piece.path, piece.offset, piece.dtype, piece.shape,
                                   piece.cols, self._queued_bytes))  # fmt: skip
        self._queued_bytes += size

    def _submit(self) -> None:
        """Start reading the queued pieces into the next free buffer; when every buffer but
        the one being copied is reading, copy the oldest batch first."""
        if not self._queued:
            return
        if len(self._in_flight) == len(self._buffers) - 1:
            self._copy_batch(self._in_flight.popleft())
        index, self._next_buffer = self._next_buffer, (self._next_buffer + 1) % len(self._buffers)
        done = self._copied[index]
        if done is not None:
            done.synchronize()  # the copies still reading this buffer
        memory = self._memory[index]
        # Each thread gets reads of about the same bytes in all.
        tasks: list[list[_Read]] = [[] for _ in range(self._readers)]
        load = [0] * self._readers
        for piece in self._queued:
            fd, nbytes = self._fd(piece.path), piece.nbytes
            for part in range(0, nbytes, _READ_BYTES):
                size = min(_READ_BYTES, nbytes - part)
                least = load.index(min(load))
                tasks[least].append(_Read(piece.path, fd, piece.offset + part,
                                          piece.position + part, size))  # fmt: skip
                load[least] += size
        futures = [self._pool.submit(_read_all, memory, task) for task in tasks if task]
        self._in_flight.append(_Batch(index, self._queued, futures))
        self._queued, self._queued_bytes = [], 0

    def _copy_batch(self, batch: _Batch) -> None:
        for future in batch.reads:
            future.result()
        buffer = self._buffers[batch.buffer]
        with torch.cuda.stream(self._stream) if self._cuda else contextlib.nullcontext():
            for piece in batch.pieces:
                host = buffer[piece.position : piece.position + piece.nbytes]
                host = host.view(piece.dtype).view(piece.shape)
                self._copy_piece(piece, host)
            if self._cuda:
                event = torch.cuda.Event()
                event.record(self._stream)
                self._copied[batch.buffer] = event
        nbytes = sum(piece.nbytes for piece in batch.pieces)
        self._copied_bytes += nbytes
        self._progress.update(nbytes)

    def _copy_piece(self, piece: _Piece, host: torch.Tensor) -> None:
        if not self._cuda:
            piece.dst.copy_(host if piece.cols is None else host[:, piece.cols[0] : piece.cols[1]])
        elif piece.cols is None and piece.dtype == piece.dst.dtype:
            piece.dst.copy_(host, non_blocking=True)
        else:  # over as stored; columns chosen and the dtype converted on the device
            staged = host.to(self.device, non_blocking=True)
            if piece.cols is not None:
                staged = staged[:, piece.cols[0] : piece.cols[1]]
            piece.dst.copy_(staged)

    def _fd(self, path: Path) -> int:
        fd = self._files.get(path)
        if fd is None:
            try:
                fd = self._files[path] = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise WeightLoadError(f"cannot read {path}: {exc.strerror or exc}") from exc
        return fd

    def close(self, finish: bool = True) -> None:
        """Copy what is queued (unless `finish` is False: a load that failed), wait for the
        copies, then release the buffers, threads and files."""
        try:
            if finish:
                self._submit()
                while self._in_flight:
                    self._copy_batch(self._in_flight.popleft())
        finally:
            for batch in self._in_flight:  # a failed load: its reads end before the buffers go
                for future in batch.reads:
                    future.exception()
            self._in_flight.clear()
            self._pool.shutdown(wait=True)
            if self._cuda:
                self._stream.synchronize()
                torch.cuda.current_stream(self.device).wait_stream(self._stream)
            if self._registered:
                for buffer in self._buffers:
                    _check(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()))
                self._registered = False
            self._memory, self._buffers = [], []
            for fd in self._files.values():
                os.close(fd)
            self._files = {}
            self._progress.close()
        if finish:
            seconds = max(time.perf_counter() - self._started, 1e-6)
            logger.info("weights: %.2f GB read and copied in %.2f s (%.1f GB/s; %d reader threads)",
                        self._copied_bytes / 1e9, seconds, self._copied_bytes / 1e9 / seconds,
                        self._readers)  # fmt: skip


def _writable(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (for `os.preadv`)."""
    return memoryview((ctypes.c_ubyte * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")


@dataclass(frozen=True)
class _Read:
    """`size` bytes at `offset` of file `path` (open as `fd`) into a buffer at `position`."""

    path: Path
    fd: int
    offset: int
    position: int
    size: int


def _read_all(memory: memoryview, reads: list[_Read]) -> None:
    """Each read into `memory` (on a reader thread)."""
    for read in reads:
        _read_into(read.path, read.fd, memory[read.position : read.position + read.size],
                   read.offset)  # fmt: skip


def _read_into(path: Path, fd: int, memory: memoryview, offset: int) -> None:
    try:
        while memory:
            count = os.preadv(fd, [memory], offset)
            if count == 0:
                raise WeightLoadError(f"cannot read {path}: it ends before byte {offset}")
            memory, offset = memory[count:], offset + count
    except OSError as exc:
        raise WeightLoadError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _check(status: object) -> None:
    """Raise on a failed CUDA runtime call (`torch.cuda.cudart()` returns its status)."""
    code = getattr(status, "value", status)
    if code != 0:
        raise RuntimeError(f"CUDA host registration failed with status {status}")
