"""Qwen3.5's gated full-attention layers around FlashInfer (CUDA): two fused kernels.

- `qk_norm_rope_kv_write`: per token and head, one pass over the fused projection's output
  (`[per head: query | gate] | k | v`): the zero-centred RMSNorm of q and k (`1 + w`, in
  float32, one cast back), partial RoPE over the first `rotary_dim` dims (neox halves; the
  rest passes through) and the K/V write into the paged cache. It replaces two norms, two
  rotations with their `cat`s and the cache write (references: `core.ops.rms_norm` with
  `zero_centred`, `RotaryEmbedding.apply`, `write_kv`).
- `sigmoid_gate`: the attention output times sigmoid of the head's gate, in place.

Casts follow transformers' bf16 order: the rotation's products are rounded before their sum;
sigmoid(gate) is rounded before the product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rope(src, w_ptr, cos, sin, d, partner, sign, rotated, eps, HEAD_DIM: tl.constexpr,
               DTYPE: tl.constexpr):  # fmt: skip
    """One head: zero-centred RMSNorm, then RoPE on the rotated lanes (a lane's partner is the
    other half of the rotary part; `sign` is -1 on the first half)."""
    x = tl.load(src + d).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
    y = (x * rstd * (1.0 + tl.load(w_ptr + d).to(tl.float32))).to(DTYPE).to(tl.float32)
    xp = tl.load(src + partner).to(tl.float32)
    yp = (xp * rstd * (1.0 + tl.load(w_ptr + partner).to(tl.float32))).to(DTYPE).to(tl.float32)
    a = (y * cos).to(DTYPE).to(tl.float32)
    b = (sign * yp * sin).to(DTYPE).to(tl.float32)
    return tl.where(rotated, (a + b).to(DTYPE), y.to(DTYPE))


# Per-row indices, read one scalar at a time: their alignment changes no code, so a
# step's packing of them (slices at any offset) does not compile another variant.
@triton.jit(do_not_specialize_on_alignment=["positions_ptr", "slots_ptr"])
def _qk_norm_rope_kv_kernel(
    qkv_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr, q_out_ptr,
    kv_ptr, stride_qkv, stride_q_out, stride_cos, stride_kv_block, stride_kv_kind,
    stride_kv_slot, block_size, eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    head = tl.program_id(1)
    dtype = qkv_ptr.dtype.element_ty
    half: tl.constexpr = ROTARY_DIM // 2
    d = tl.arange(0, HEAD_DIM)
    rotated = d < ROTARY_DIM
    partner = tl.where(d < half, d + half, tl.where(rotated, d - half, d))
    sign = tl.where(d < half, -1.0, 1.0)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + d, mask=rotated, other=1.0)
    sin = tl.load(sin_ptr + pos * stride_cos + d, mask=rotated, other=0.0)
    cos = cos.to(dtype).to(tl.float32)
    sin = sin.to(dtype).to(tl.float32)
    row = qkv_ptr + token.to(tl.int64) * stride_qkv
    if head < NUM_HEADS:
        out = _norm_rope(row + head * 2 * HEAD_DIM, q_norm_ptr, cos, sin, d, partner, sign,
                         rotated, eps, HEAD_DIM, dtype)  # fmt: skip
        tl.store(q_out_ptr + token.to(tl.int64) * stride_q_out + head * HEAD_DIM + d, out)
    else:
        kv_head = head - NUM_HEADS
        k_src = row + 2 * NUM_HEADS * HEAD_DIM + kv_head * HEAD_DIM
        out = _norm_rope(k_src, k_norm_ptr, cos, sin, d, partner, sign, rotated, eps,
                         HEAD_DIM, dtype)  # fmt: skip
        slot = tl.load(slots_ptr + token).to(tl.int64)
        block, offset = slot // block_size, slot % block_size
        base = kv_ptr + block * stride_kv_block + offset * stride_kv_slot + kv_head * HEAD_DIM
        tl.store(base + d, out)
        tl.store(base + stride_kv_kind + d, tl.load(k_src + NUM_KV_HEADS * HEAD_DIM + d))


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
    rotary_dim: int,
    eps: float,
) -> torch.Tensor:
    """Normalised, rotated q [tokens, heads, head_dim] from the fused projection `qkv`
    [tokens, heads * 2 * head_dim + 2 * kv_heads * head_dim]; k and v written into
    `kv_layer` [blocks, 2, block_size, kv_heads, head_dim]. `cos`/`sin` [positions,
    rotary_dim] (float32, halves repeated); norm weights stored as w - 1."""
    tokens, head_dim = qkv.shape[0], q_norm.shape[0]
    q_out = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q_out
    _qk_norm_rope_kv_kernel[(tokens, num_heads + num_kv_heads)](
        qkv, q_norm, k_norm, cos, sin, positions, slot_mapping, q_out, kv_layer,
        qkv.stride(0), q_out.stride(0), cos.stride(0), kv_layer.stride(0), kv_layer.stride(1),
        kv_layer.stride(2), kv_layer.shape[2], eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, ROTARY_DIM=rotary_dim,
    )  # fmt: skip
    return q_out


@triton.jit
def _sigmoid_gate_kernel(out_ptr, qkv_ptr, stride_out, stride_qkv, HEAD_DIM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    gate = tl.load(qkv_ptr + token * stride_qkv + head * 2 * HEAD_DIM + HEAD_DIM + d)
    dtype = out_ptr.dtype.element_ty
    g = tl.sigmoid(gate.to(tl.float32)).to(dtype).to(tl.float32)
    dst = out_ptr + token * stride_out + head * HEAD_DIM + d
    tl.store(dst, (tl.load(dst).to(tl.float32) * g).to(dtype))


def sigmoid_gate(out: torch.Tensor, qkv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """`out` [tokens, heads * head_dim] times sigmoid of each head's gate (the second half of
    its `[query | gate]` columns in `qkv`), in place."""
    tokens = out.shape[0]
    if tokens:
        head_dim = out.shape[1] // num_heads
        _sigmoid_gate_kernel[(tokens, num_heads)](
            out, qkv, out.stride(0), qkv.stride(0), HEAD_DIM=head_dim
        )
    return out
