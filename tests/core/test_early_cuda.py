"""`early_cuda`: the engine process's CUDA context, created through the driver API while torch
imports. On the CPU: which devices it is made for, and that a machine without CUDA only gets a
reason; on CUDA, in a fresh interpreter: the context is active before torch is imported, and
torch's runtime then computes in that same context."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from pegainfer.core.engine.early_cuda import device_ordinal, retain_primary_context


@pytest.mark.parametrize(
    ("device", "ordinal"),
    [("auto", 0), ("cuda", 0), ("cuda:0", 0), ("cuda:3", 3), ("cpu", None), ("cuda:x", None)],
)
def test_the_device_an_engine_argument_names(device, ordinal):
    assert device_ordinal(device) == ordinal


def test_a_context_is_made_exactly_where_cuda_is_available():
    reason = retain_primary_context(0)
    assert (reason is None) == torch.cuda.is_available(), reason


_CHILD = textwrap.dedent(
    """
    import ctypes, sys
    from pegainfer.core.engine.early_cuda import retain_primary_context
    assert "torch" not in sys.modules
    assert retain_primary_context(0) is None
    driver = ctypes.CDLL("libcuda.so.1")
    device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert driver.cuDeviceGet(ctypes.byref(device), 0) == 0
    assert driver.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)) == 0
    assert active.value == 1, "the primary context is not active before torch is imported"
    primary = ctypes.c_void_p()
    assert driver.cuDevicePrimaryCtxRetain(ctypes.byref(primary), device) == 0
    import torch
    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    assert x.sum().item() == 499500.0
    current = ctypes.c_void_p()
    assert driver.cuCtxGetCurrent(ctypes.byref(current)) == 0
    assert current.value == primary.value, (current.value, primary.value)
    print("ok")
    """
)


@pytest.mark.gpu
def test_torch_computes_in_the_context_made_before_it_was_imported():
    result = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
