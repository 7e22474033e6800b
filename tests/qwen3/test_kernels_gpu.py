"""Qwen3's fused q/k norm + RoPE + KV write against the reference ops (CUDA; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.ops.rms_norm import rms_norm
from pegainfer.core.ops.rotary import RotaryEmbedding

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "head_dim"), [(1, 32, 8, 128), (77, 32, 8, 128), (5, 4, 2, 64)]
)
def test_qk_norm_rope_kv_write(dtype, tokens, heads, kv_heads, head_dim):
    from pegainfer.models.qwen3.kernels import qk_norm_rope_kv_write

    g = torch.Generator("cuda").manual_seed(tokens)
    dev = torch.device("cuda")
    block_size, num_blocks = 16, 64
    qkv = torch.randn(
        tokens, (heads + 2 * kv_heads) * head_dim, device=dev, dtype=dtype, generator=g
    )
    q_w = 1 + 0.1 * torch.randn(head_dim, device=dev, dtype=dtype, generator=g)
    k_w = 1 + 0.1 * torch.randn(head_dim, device=dev, dtype=dtype, generator=g)
    rope = RotaryEmbedding(head_dim, 1e6, 4096, dev)
    positions = torch.randint(0, 4096, (tokens,), device=dev, generator=g)
    slots = torch.randperm(num_blocks * block_size, device=dev, generator=g)[:tokens]
    kv = torch.zeros(num_blocks, 2, block_size, kv_heads, head_dim, device=dev, dtype=dtype)
    q = qk_norm_rope_kv_write(
        qkv, q_w, k_w, rope.cos, rope.sin, positions, slots, kv, heads, kv_heads, 1e-6
    )

    q_ref, k_ref, v_ref = qkv.split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1
    )
    q_ref = rope.apply(rms_norm(q_ref.view(tokens, heads, head_dim), q_w, 1e-6), positions)
    k_ref = rope.apply(rms_norm(k_ref.view(tokens, kv_heads, head_dim), k_w, 1e-6), positions)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    assert rel(q, q_ref) < tol
    assert rel(kv[slots // block_size, 0, slots % block_size], k_ref) < tol
    assert torch.equal(
        kv[slots // block_size, 1, slots % block_size], v_ref.view(tokens, kv_heads, head_dim)
    )
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=dev)
    untouched[slots] = False
    assert (kv.transpose(1, 2).reshape(num_blocks * block_size, -1)[untouched] == 0).all()
