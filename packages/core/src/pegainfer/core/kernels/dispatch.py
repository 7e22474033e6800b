"""Which path an op on a tensor takes: its CUDA kernel or its torch reference.

On CUDA tensors, the kernel. On meta tensors too while a kernel plan records a model's
launches (`runner/meta_steps.py`, on the recording thread only): the model's forward then lists
the kernels a GPU's would launch, without running any.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_STATE = threading.local()


def uses_cuda_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda or (x.is_meta and getattr(_STATE, "meta_as_cuda", False))


@contextlib.contextmanager
def meta_as_cuda() -> Iterator[None]:
    """Within the block, on this thread, ops on meta tensors take their CUDA kernels' path."""
    _STATE.meta_as_cuda = True
    try:
        yield
    finally:
        _STATE.meta_as_cuda = False
