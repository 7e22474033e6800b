"""Weights to the GPU through page-locked staging buffers (CUDA; skipped elsewhere): copies in
many runs equal a direct copy, and a checkpoint loads on CUDA exactly as on the CPU."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.loading import staging as staging_module
from pegainfer.core.loading.model_files import read_config
from pegainfer.core.loading.staging import StagedCopies
from pegainfer.core.model import ModelContext
from pegainfer.models.qwen3.line import Qwen3Line

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("buffer_bytes", [4096, 1 << 20])
def test_staged_copies_to_the_device_equal_direct_copies(dtype, buffer_bytes):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(3000, 96, generator=g)
    sources = [base, base[:, 8:40], base.t(), torch.randn(5, 7, 11, generator=g), base[0]]
    targets = [torch.empty(s.shape, dtype=dtype, device=CUDA) for s in sources]
    with StagedCopies(CUDA, buffer_bytes) as staging:
        for dst, src in zip(targets, sources, strict=True):
            staging.copy(dst, src)
    for dst, src in zip(targets, sources, strict=True):
        assert torch.equal(dst.cpu(), src.to(dtype))


def test_a_checkpoint_loads_on_cuda_as_on_the_cpu(tmp_path, monkeypatch):
    line = Qwen3Line()
    line.write_tiny_checkpoint(tmp_path, seed=6)
    config = read_config(tmp_path)
    monkeypatch.setattr(staging_module, "_BUFFER_BYTES", 8192)  # many runs per tensor
    on_cuda = line.build_model(ModelContext(tmp_path, config, torch.bfloat16, CUDA))
    on_cpu = line.build_model(ModelContext(tmp_path, config, torch.bfloat16, torch.device("cpu")))
    cpu_params = dict(on_cpu.named_parameters())
    for name, param in on_cuda.named_parameters():
        assert torch.equal(param.cpu(), cpu_params[name]), name
