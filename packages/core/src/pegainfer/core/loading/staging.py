"""Checkpoint tensors to device memory through two page-locked staging buffers.

A copy to the GPU from pageable memory (a view of the checkpoint's memory map) is staged by
the driver itself, a piece at a time, with the host waiting for each. Here the host fills one
page-locked buffer from the file (torch's copy, on its threads) while the other buffer's
asynchronous copy to the device runs; a buffer is refilled once the copy reading it is done
(an event). Tensors larger than a buffer go in runs of rows.

The buffers are plain host memory page-locked by registering it with CUDA, not torch's
pinned-memory cache, which would keep them resident after the load; `close` unregisters and
frees them (issue 21: no host copies of the weights outlive loading).
"""

from __future__ import annotations

import math

import torch

_BUFFER_BYTES = 64 << 20


class StagedCopies:
    """`copy(dst, src)`: a host tensor into a device tensor of the same shape (converting the
    dtype on the device). Use as a context manager: leaving it waits for the copies in flight
    and releases the buffers. `page_locked=False` stages through plain memory (the CPU, where
    it only serves tests of the chunking)."""

    def __init__(
        self, device: torch.device, buffer_bytes: int | None = None, page_locked: bool = True
    ) -> None:
        buffer_bytes = buffer_bytes or _BUFFER_BYTES
        self.device = device
        self._cuda = device.type == "cuda"
        self._page_locked = page_locked and self._cuda
        self._buffers = [torch.empty(buffer_bytes, dtype=torch.uint8) for _ in range(2)]
        if self._page_locked:
            for buffer in self._buffers:
                _check(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer_bytes, 0))
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._next = 0

    def __enter__(self) -> StagedCopies:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"cannot copy a {tuple(src.shape)} tensor into {tuple(dst.shape)}")
        row_bytes = math.prod(src.shape[1:]) * src.element_size() if src.dim() else 0
        capacity = self._buffers[0].numel()
        if src.dim() == 0 or row_bytes > capacity or src.numel() == 0:
            dst.copy_(src)  # a scalar, or rows wider than a buffer: the driver stages it
            return
        step = capacity // row_bytes
        for start in range(0, src.shape[0], step):
            self._copy_rows(dst[start : start + step], src[start : start + step])

    def _copy_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        index, self._next = self._next, 1 - self._next
        if self._done[index] is not None:
            self._done[index].synchronize()  # the copy still reading this buffer is done
        staged = self._buffers[index][: src.numel() * src.element_size()]
        staged = staged.view(src.dtype).view(src.shape)
        staged.copy_(src)
        if src.dtype == dst.dtype:
            dst.copy_(staged, non_blocking=self._page_locked)
        else:  # over in the file's dtype, converted there
            dst.copy_(staged.to(self.device, non_blocking=self._page_locked))
        if self._cuda:
            self._done[index] = torch.cuda.Event()
            self._done[index].record()

    def close(self) -> None:
        for event in self._done:
            if event is not None:
                event.synchronize()
        self._done = [None, None]
        if self._page_locked:
            for buffer in self._buffers:
                _check(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()))
            self._page_locked = False
        self._buffers = []


def _check(status: object) -> None:
    """Raise on a failed CUDA runtime call (`torch.cuda.cudart()` returns its status)."""
    code = getattr(status, "value", status)
    if code != 0:
        raise RuntimeError(f"CUDA host registration failed with status {status}")
