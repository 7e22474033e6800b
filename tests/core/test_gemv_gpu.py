"""The decode GEMV (`core.kernels.gemv`) against torch.matmul in bf16 at the decode shapes of
Qwen3-4B and -8B's layers (and ragged ones), one to sixteen rows, under the default
configuration and the benchmark's; gated, against matmul then SiLU-and-mul's kernel (CUDA;
skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.kernels.activation import silu_and_mul
from pegainfer.core.kernels.gemv import MAX_ROWS, GemvConfig, gemv

pytestmark = pytest.mark.gpu

# (N, K): Qwen3-4B's qkv, o, gate_up, down; Qwen3-8B's down; ragged N and K.
SHAPES = [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728), (4096, 12288), (1000, 200)]
CONFIGS = [None, GemvConfig(16, 128, 3), GemvConfig(64, 256, 4, 8)]


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, MAX_ROWS])
@pytest.mark.parametrize("config", CONFIGS, ids=["default", "16x128", "64x256"])
def test_gemv_matches_matmul(n, k, rows, config):
    g = torch.Generator("cuda").manual_seed(n + k + rows)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k**-0.5
    ours = gemv(x, w, config)
    assert ours.shape == (rows, n) and ours.dtype == torch.bfloat16
    exact = x.float() @ w.float().T
    # Both accumulate in fp32 and round once to bf16: within a rounding of each other.
    torch.testing.assert_close(ours, torch.matmul(x, w.T), rtol=1.6e-2, atol=1e-2)
    err = ((ours.float() - exact).norm() / exact.norm()).item()
    assert err < 4e-3


# (intermediate, hidden): Qwen3-4B's and -8B's gate_up; ragged.
@pytest.mark.parametrize(("n", "k"), [(9728, 2560), (12288, 4096), (1000, 200)])
@pytest.mark.parametrize("rows", [1, 4, MAX_ROWS])
@pytest.mark.parametrize("config", [None, GemvConfig(32, 128, 3)], ids=["default", "32x128"])
def test_gated_gemv_matches_matmul_then_silu_and_mul(n, k, rows, config):
    g = torch.Generator("cuda").manual_seed(n + rows)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g)
    gate_up = torch.randn(2 * n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k**-0.5
    ours = gemv(x, gate_up, config, gated=True)
    assert ours.shape == (rows, n)
    # Both round gate and up to bf16, then silu(gate), then the product: one rounding apart.
    torch.testing.assert_close(ours, silu_and_mul(torch.matmul(x, gate_up.T)), rtol=1.6e-2,
                               atol=1e-2)  # fmt: skip


def test_gemv_reads_a_strided_x_and_a_weight_slice():
    """Rows of a wider activation (stride > K) and a weight that is a row slice of a bigger one
    (the fused qkv's q part)."""
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(4, 3000, device="cuda", dtype=torch.bfloat16, generator=g)[:, :2560]
    w = torch.randn(6144, 2560, device="cuda", dtype=torch.bfloat16, generator=g)[:4096]
    torch.testing.assert_close(gemv(x, w), torch.matmul(x, w.T), rtol=1.6e-2, atol=5e-2)


def test_gemv_replays_in_a_cuda_graph():
    g = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(3, 2560, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(2560, 2560, device="cuda", dtype=torch.bfloat16, generator=g)
    gemv(x, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv(x, w)
    x.copy_(torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=g))
    graph.replay()
    torch.testing.assert_close(y, torch.matmul(x, w.T), rtol=1.6e-2, atol=5e-2)
