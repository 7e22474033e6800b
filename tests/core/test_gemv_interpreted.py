"""The decode GEMV's logic on the CPU, through Triton's interpreter (TRITON_INTERPRET=1, in a
process of its own: the interpreter is chosen when the kernel is defined): ragged N and K, one
to sixteen rows, every column block, plain and gated, against `F.linear` (then `silu_and_mul`)
in fp32 (the interpreter's bf16 is not the GPU's; `test_gemv_gpu.py` checks bf16 compiled)."""

from __future__ import annotations

import textwrap

import pytest

from tests.triton_interpreter import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from pegainfer.core.kernels.gemv import GemvConfig, gemv
    from pegainfer.core.ops.activation import silu_and_mul

    torch.manual_seed(0)
    cases = [(1, 40, 512, GemvConfig(16, 128)), (3, 64, 300, GemvConfig(16, 128)),
             (16, 33, 256, GemvConfig(32, 64)), (8, 130, 1024, GemvConfig(64, 256))]
    for m, n, k, config in cases:
        x, w = torch.randn(m, k), torch.randn(n, k)
        torch.testing.assert_close(gemv(x, w, config), F.linear(x, w), rtol=1e-4, atol=1e-4)
        gate_up = torch.randn(2 * n, k)
        torch.testing.assert_close(gemv(x, gate_up, config, gated=True),
                                   silu_and_mul(F.linear(x, gate_up)), rtol=1e-4,
                                   atol=1e-4)  # fmt: skip
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
