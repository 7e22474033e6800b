"""The decode GEMV's logic on the CPU, through Triton's interpreter (TRITON_INTERPRET=1, in a
process of its own: the interpreter is chosen when the kernel is defined): ragged N and K, one
to sixteen rows, every column block, plain and gated, in fp32 against `F.linear` (then SiLU and
the product) in fp64 within fp32's rounding bound (the interpreter's bf16 is not the GPU's;
`test_gemv_gpu.py` checks bf16 compiled)."""

from __future__ import annotations

import textwrap

import pytest

from tests.triton_interpreter import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from pegainfer.core.kernels.gemv import GemvConfig, gemv

    # An fp32 dot product of K terms is off the exact one by at most ~K eps sum|x_k w_k|; the
    # tolerance is 8 eps sum|x_k w_k| (far above a random walk's sqrt(K) eps, far below a wrong
    # or missing term), against an fp64 reference: the rounding of the kernel's summation order
    # is not the CPU BLAS's (which also varies with its thread count).
    eps = torch.finfo(torch.float32).eps
    def dot_bound(x, w):
        return 8 * eps * (x.abs().double() @ w.abs().double().T)
    def check(got, want, bound):
        excess = ((got.double() - want).abs() - bound).max().item()
        assert excess <= 0, f"off by {excess:.3g} past the rounding bound"

    torch.manual_seed(0)
    cases = [(1, 40, 512, GemvConfig(16, 128)), (3, 64, 300, GemvConfig(16, 128)),
             (16, 33, 256, GemvConfig(32, 64)), (8, 130, 1024, GemvConfig(64, 256))]
    for m, n, k, config in cases:
        x, w = torch.randn(m, k), torch.randn(n, k)
        check(gemv(x, w, config), F.linear(x.double(), w.double()), dot_bound(x, w))
        gate_up = torch.randn(2 * n, k)
        g, u = F.linear(x.double(), gate_up.double()).chunk(2, dim=-1)
        g_bound, u_bound = dot_bound(x, gate_up).chunk(2, dim=-1)
        # silu's slope is within (-0.1, 1.1): an error e in g moves silu(g) * u by < 1.1 e |u|.
        want = F.silu(g) * u
        bound = 1.1 * g_bound * u.abs() + F.silu(g).abs() * u_bound + 4 * eps * want.abs()
        check(gemv(x, gate_up, config, gated=True), want, bound)
    print("matched", len(cases))
""")


def test_gemv_matches_linear_interpreted():
    assert "matched 4" in run_interpreted(SCRIPT)


def test_default_config_gives_every_sm_two_programs():
    from pegainfer.core.kernels.gemv import default_config

    assert default_config(151936, 132).block_n == 32  # Qwen3's LM head
    assert default_config(19456, 132).block_n == 32  # Qwen3-4B's gate_up: 608 programs
    assert default_config(6144, 132).block_n == 16  # qkv: 192 programs of 32 would be < 264
    assert default_config(2560, 132).block_n == 16
    assert default_config(9728, 132, gated=True).block_n == 16  # 32 weight rows a program


def test_gemv_refuses_what_it_does_not_take():
    import torch

    from pegainfer.core.kernels.gemv import GemvConfig, gemv

    config = GemvConfig()
    with pytest.raises(ValueError, match="1 to 16 rows"):
        gemv(torch.zeros(17, 64), torch.zeros(32, 64), config)
    with pytest.raises(ValueError, match="one dtype"):
        gemv(torch.zeros(1, 64), torch.zeros(32, 64, dtype=torch.bfloat16), config)
    with pytest.raises(ValueError, match="contiguous"):
        gemv(torch.zeros(2, 128)[:, ::2], torch.zeros(32, 64), config)
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        gemv(torch.zeros(1, 64), torch.zeros(32, 63), config)
    with pytest.raises(ValueError, match=r"w \[2N, K\]"):
        gemv(torch.zeros(1, 64), torch.zeros(33, 64), config, gated=True)
