"""Creating the engine's CUDA context while torch imports (issue 21: the first seconds).

An engine process spends seconds importing torch, in Python bytecode that holds the GIL, and
then creates its CUDA context on its first device allocation (the driver's initialisation and
the primary context: a few hundred milliseconds on an H200, none of it Python). The context
torch's runtime uses is the device's primary context, which the driver API can create ahead:
`cuDevicePrimaryCtxRetain` from a thread, through ctypes (which releases the GIL for the call),
runs beside the import, and torch's runtime later finds the context there. Torch-free: the
engine process starts it before it imports torch.

`CUDA_MODULE_LOADING` is read by the driver when it initialises, so it is set first, to what
torch would set (lazy loading, unless the environment says otherwise).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable

_SUCCESS = 0


def device_ordinal(device: str) -> int | None:
    """The CUDA device an engine `--device` names (`auto` and `cuda`: the first visible one),
    or None for one that is not CUDA."""
    if device in ("auto", "cuda"):
        return 0
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return None
    return int(index) if index.isdigit() else None


def retain_primary_context(ordinal: int) -> str | None:
    """Initialise the CUDA driver and create (retain) device `ordinal`'s primary context; the
    reason it was not, or None. A machine without the driver or the device is not an error
    here: torch decides later what the engine runs on."""
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no CUDA driver (libcuda.so.1)"
    status = driver.cuInit(0)
    if status != _SUCCESS:
        return f"cuInit failed with status {status}"
    count = ctypes.c_int()
    status = driver.cuDeviceGetCount(ctypes.byref(count))
    if status != _SUCCESS or ordinal >= count.value:
        return f"no CUDA device {ordinal} ({count.value} visible)"
    device = ctypes.c_int()
    status = driver.cuDeviceGet(ctypes.byref(device), ordinal)
    if status != _SUCCESS:
        return f"cuDeviceGet({ordinal}) failed with status {status}"
    context = ctypes.c_void_p()
    # Kept retained for the process's life, as torch's runtime keeps it.
    status = driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)
    if status != _SUCCESS:
        return f"cuDevicePrimaryCtxRetain failed with status {status}"
    return None


def start_primary_context(
    device: str, done: Callable[[str | None], None]
) -> threading.Thread | None:
    """Create `device`'s primary context on a thread (None, and nothing started, for a device
    that is not CUDA); `done` gets what `retain_primary_context` returned."""
    ordinal = device_ordinal(device)
    if ordinal is None:
        return None
    thread = threading.Thread(
        target=lambda: done(retain_primary_context(ordinal)),
        name="pegainfer-cuda-context",
        daemon=True,
    )
    thread.start()
    return thread
