"""Qwen3's fused attention-input kernel (CUDA): per-head q/k RMSNorm, RoPE, and the KV write.

One pass over the qkv projection replaces five reference ops (two norms, two rotations, the
cache write). Casts follow transformers' bf16 order: the norm in float32 rounded to the input
dtype before the weight, RoPE products rounded before their sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_rope(x1, x2, w1, w2, cos, sin, eps, HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr):
    """Normalise a head given as two halves, scale by the norm weight, rotate (neox)."""
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM + eps)
    x1 = ((x1 * rstd).to(DTYPE).to(tl.float32) * w1).to(DTYPE).to(tl.float32)
    x2 = ((x2 * rstd).to(DTYPE).to(tl.float32) * w2).to(DTYPE).to(tl.float32)
    a1 = (x1 * cos).to(DTYPE).to(tl.float32)
    b1 = (-x2 * sin).to(DTYPE).to(tl.float32)
    a2 = (x2 * cos).to(DTYPE).to(tl.float32)
    b2 = (x1 * sin).to(DTYPE).to(tl.float32)
    return (a1 + b1).to(DTYPE), (a2 + b2).to(DTYPE)


# Per-row indices, read one scalar at a time: their alignment changes no code, so a
# step's packing of them (slices at any offset) does not compile another variant.
@triton.jit(do_not_specialize_on_alignment=["positions_ptr", "slots_ptr"])
def _qk_norm_rope_kv_kernel(
    qkv_ptr,
    q_norm_ptr,
    k_norm_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    slots_ptr,
    q_out_ptr,
    kv_ptr,
    stride_qkv,
    stride_q_out,
    stride_cos,
    stride_kv_block,
    stride_kv_kind,
    stride_kv_slot,
    block_size,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    half = HALF
    d = tl.arange(0, HALF)
    dtype = qkv_ptr.dtype.element_ty
    pos = tl.load(positions_ptr + token)
    cos = tl.load(cos_ptr + pos * stride_cos + d).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + d).to(dtype).to(tl.float32)
    row = qkv_ptr + token * stride_qkv
    if head < NUM_HEADS:
        src = row + head * HEAD_DIM
        x1 = tl.load(src + d).to(tl.float32)
        x2 = tl.load(src + half + d).to(tl.float32)
        w1 = tl.load(q_norm_ptr + d).to(tl.float32)
        w2 = tl.load(q_norm_ptr + half + d).to(tl.float32)
        o1, o2 = _rms_rope(x1, x2, w1, w2, cos, sin, eps, HEAD_DIM, dtype)
        dst = q_out_ptr + token * stride_q_out + head * HEAD_DIM
        tl.store(dst + d, o1)
        tl.store(dst + half + d, o2)
    else:
        kv_head = head - NUM_HEADS
        slot = tl.load(slots_ptr + token)
        block, offset = slot // block_size, slot % block_size
        base = kv_ptr + block * stride_kv_block + offset * stride_kv_slot + kv_head * HEAD_DIM
        src = row + (NUM_HEADS + kv_head) * HEAD_DIM
        x1 = tl.load(src + d).to(tl.float32)
        x2 = tl.load(src + half + d).to(tl.float32)
        w1 = tl.load(k_norm_ptr + d).to(tl.float32)
        w2 = tl.load(k_norm_ptr + half + d).to(tl.float32)
        o1, o2 = _rms_rope(x1, x2, w1, w2, cos, sin, eps, HEAD_DIM, dtype)
        tl.store(base + d, o1)
        tl.store(base + half + d, o2)
        v_src = row + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM
        v_dst = base + stride_kv_kind
        tl.store(v_dst + d, tl.load(v_src + d))
        tl.store(v_dst + half + d, tl.load(v_src + half + d))


def qk_norm_rope_kv_write(
    qkv: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_layer: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
) -> torch.Tensor:
    """Return normalised, rotated q [tokens, heads, head_dim]; write k and v into `kv_layer`.

    `kv_layer` is one layer's paged cache `[blocks, 2, block_size, kv_heads, head_dim]`;
    `cos`/`sin` are the rotary tables `[positions, head_dim]` (float32, halves repeated).
    """
    tokens = qkv.shape[0]
    head_dim = q_norm.shape[0]
    q_out = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q_out
    _qk_norm_rope_kv_kernel[(tokens, num_heads + num_kv_heads)](
        qkv,
        q_norm,
        k_norm,
        cos,
        sin,
        positions,
        slot_mapping,
        q_out,
        kv_layer,
        qkv.stride(0),
        q_out.stride(0),
        cos.stride(0),
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        kv_layer.shape[2],
        eps,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=head_dim // 2,
    )
    return q_out
