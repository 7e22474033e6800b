"""`core.dense` with the small-batch GEMV on CUDA: steps of up to 16 rows of plain weights go
through the GEMV (the gated gate_up and the LM head), larger ones through cuBLAS (CUDA; skipped
elsewhere)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.dense import dense_ops
from pegainfer.core.kernels.activation import silu_and_mul
from pegainfer.core.kernels.gemv import MAX_ROWS, GemvConfig, gemv

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.mark.parametrize("rows", [1, MAX_ROWS, MAX_ROWS + 1, 64])
def test_small_steps_take_the_gemv_and_larger_ones_cublas(rows):
    g = torch.Generator("cuda").manual_seed(rows)
    x = torch.randn(rows, 512, device=CUDA, dtype=torch.bfloat16, generator=g)
    w = torch.randn(384, 512, device=CUDA, dtype=torch.bfloat16, generator=g)
    ops = dense_ops(CUDA, small_batch_gemv=True)
    if rows <= MAX_ROWS:  # the very kernel (at dense.py's tiles), bit for bit
        assert torch.equal(ops.head(x, w), gemv(x, w, GemvConfig(64, 256, 3, 4)))
        assert torch.equal(ops.gated(x, w), gemv(x, w, GemvConfig(64, 128, 4, 4), gated=True))
    else:
        assert torch.equal(ops.head(x, w), torch.nn.functional.linear(x, w))
        want = silu_and_mul(torch.nn.functional.linear(x, w))
        assert torch.equal(ops.gated(x, w), want)
