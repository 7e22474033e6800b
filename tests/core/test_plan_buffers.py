"""`share_plan_buffers` on stand-ins for FlashInfer's wrappers (the GPU test runs real ones)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pegainfer.core.attention.paged import share_plan_buffers


def wrapper() -> SimpleNamespace:
    buffers = torch.zeros(2, 8, dtype=torch.uint8)
    return SimpleNamespace(_int_workspace_buffer=buffers[0],
                           _pin_memory_int_workspace_buffer=buffers[1])  # fmt: skip


def test_every_wrapper_takes_the_first_ones_buffers():
    wrappers = [wrapper() for _ in range(3)]
    first = vars(wrappers[0]).copy()
    share_plan_buffers(wrappers)
    for w in wrappers:
        assert w._int_workspace_buffer is first["_int_workspace_buffer"]
        assert w._pin_memory_int_workspace_buffer is first["_pin_memory_int_workspace_buffer"]
    share_plan_buffers([])  # no graph buckets: nothing to share


def test_a_wrapper_without_those_buffers_is_refused():
    with pytest.raises(RuntimeError, match="_pin_memory_int_workspace_buffer"):
        share_plan_buffers([SimpleNamespace(_int_workspace_buffer=torch.zeros(1)), wrapper()])
