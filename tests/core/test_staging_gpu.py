"""Checkpoint bytes to the GPU through page-locked buffers on a side stream (CUDA; skipped
elsewhere): every dtype and selection (rows, columns, dtype conversions on the device) in many
runs through small buffers equals safetensors' tensors, and a checkpoint loads on CUDA exactly
as on the CPU, the weights visible to the current stream once the load returns."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from safetensors import safe_open

from pegainfer.core.loading import weights as weights_module
from pegainfer.core.loading.model_files import read_config
from pegainfer.core.loading.safetensors_index import read_index
from pegainfer.core.loading.staging import CheckpointCopies
from pegainfer.core.model import ModelContext
from pegainfer.models.qwen3.line import Qwen3Line
from tests.core.test_staging import as_bytes, stored  # noqa: F401 (a fixture)

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


@pytest.mark.parametrize("buffer_bytes", [256, 4096, 1 << 20])
@pytest.mark.parametrize("into", [None, torch.bfloat16])
def test_copies_to_the_device_equal_safetensors(stored, buffer_bytes, into):  # noqa: F811
    """As stored, and into bf16 (floats only) with rows [1, 30) and columns [2, 5) where the
    tensor has them."""
    tensors = read_index(stored)
    selections = {}
    with CheckpointCopies(CUDA, buffer_bytes, num_buffers=3, readers=3) as copies:
        for t in tensors:
            convert = into is not None and t.dtype.is_floating_point and t.dtype.itemsize >= 2
            rows = cols = None
            shape = t.shape
            if convert and len(t.shape) == 2 and t.shape[0] >= 30 and t.shape[1] >= 5:
                rows, cols, shape = (1, 30), (2, 5), (29, 3)
            dst = torch.empty(shape, dtype=into if convert else t.dtype, device=CUDA)
            copies.copy(dst, t, rows, cols)
            selections[t.name] = (dst, rows, cols)
    with safe_open(stored, "pt") as f:
        for name, (dst, rows, cols) in selections.items():
            want = f.get_tensor(name)
            if rows is not None:
                want = want[rows[0] : rows[1], cols[0] : cols[1]]
            want = want.to(dst.dtype)
            assert torch.equal(as_bytes(dst.cpu()), as_bytes(want)), name


def test_a_checkpoint_loads_on_cuda_as_on_the_cpu(tmp_path, monkeypatch):
    line = Qwen3Line()
    line.write_tiny_checkpoint(tmp_path, seed=6, num_shards=2)
    config = read_config(tmp_path)
    # 8 KiB buffers: many runs per tensor, every buffer reused many times.
    monkeypatch.setattr(weights_module, "CheckpointCopies",
                        partial(CheckpointCopies, buffer_bytes=8192, readers=4))  # fmt: skip
    on_cuda = line.build_model(ModelContext(tmp_path, config, torch.bfloat16, CUDA))
    # Read on the current stream at once, with no synchronization: the load's stream is waited.
    on_cuda_now = {name: param.clone() for name, param in on_cuda.named_parameters()}
    on_cpu = line.build_model(ModelContext(tmp_path, config, torch.bfloat16, torch.device("cpu")))
    cpu_params = dict(on_cpu.named_parameters())
    for name, param in on_cuda_now.items():
        assert torch.equal(param.cpu(), cpu_params[name]), name


def test_the_buffers_are_page_locked_while_loading_and_released_after():
    copies = CheckpointCopies(CUDA, 1 << 20, num_buffers=2)
    buffers = list(copies._buffers)
    assert all(buffer.is_pinned() for buffer in buffers)
    copies.close()
    assert not any(buffer.is_pinned() for buffer in buffers)
