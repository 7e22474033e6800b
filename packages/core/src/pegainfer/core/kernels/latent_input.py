"""MLA's attention input in one kernel (CUDA; reference: `core.ops.latent_input`).

Per token, after the q and kv_a projections: the query's rope part rotated (interleaved pairs,
in float32) into a contiguous [tokens, heads, rope] tensor, the KV latent RMS-normalised with
transformers' casts (float32, rounded to the input dtype before the weight) and written to the
`ckv` arena, the shared rope key rotated and written to `kpe`. One launch replaces the ~30
small torch kernels of the reference ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_pairs(src, dst, cos, sin, i):
    """dst[2i], dst[2i+1] = the pair (src[2i], src[2i+1]) rotated, in float32."""
    even = tl.load(src + 2 * i).to(tl.float32)
    odd = tl.load(src + 2 * i + 1).to(tl.float32)
    tl.store(dst + 2 * i, (even * cos - odd * sin).to(dst.dtype.element_ty))
    tl.store(dst + 2 * i + 1, (even * sin + odd * cos).to(dst.dtype.element_ty))


@triton.jit
def _latent_input_kernel(
    q, kv_a, norm, cos_table, sin_table, positions, slots, q_pe, ckv, kpe,
    stride_q, stride_kv_a, stride_q_pe, stride_cos,
    stride_ckv_block, stride_ckv_slot, stride_kpe_block, stride_kpe_slot,
    block_size, eps,
    NUM_HEADS: tl.constexpr, NOPE: tl.constexpr, HALF_ROPE: tl.constexpr,
    LATENT: tl.constexpr, LATENT_BLOCK: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # NUM_HEADS: the latent and the shared key
    pos = tl.load(positions + token)
    i = tl.arange(0, HALF_ROPE)
    cos = tl.load(cos_table + pos * stride_cos + i)
    sin = tl.load(sin_table + pos * stride_cos + i)
    if head < NUM_HEADS:
        src = q + token * stride_q + head * (NOPE + 2 * HALF_ROPE) + NOPE
        _rotate_pairs(src, q_pe + token * stride_q_pe + head * 2 * HALF_ROPE, cos, sin, i)
    else:
        slot = tl.load(slots + token)
        block, offset = slot // block_size, slot % block_size
        row = kv_a + token * stride_kv_a
        cols = tl.arange(0, LATENT_BLOCK)
        keep = cols < LATENT
        c = tl.load(row + cols, mask=keep, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(c * c, axis=0) / LATENT + eps)
        w = tl.load(norm + cols, mask=keep, other=0.0).to(tl.float32)
        dtype = ckv.dtype.element_ty
        c = ((c * rstd).to(dtype).to(tl.float32) * w).to(dtype)
        tl.store(ckv + block * stride_ckv_block + offset * stride_ckv_slot + cols, c, mask=keep)
        dst = kpe + block * stride_kpe_block + offset * stride_kpe_slot
        _rotate_pairs(row + LATENT, dst, cos, sin, i)


def latent_input(
    q: torch.Tensor,
    kv_a: torch.Tensor,
    norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    ckv_layer: torch.Tensor,
    kpe_layer: torch.Tensor,
    num_heads: int,
    nope_dim: int,
    eps: float,
) -> torch.Tensor:
    """Write the step's normalised latents and rotated shared keys into one layer's arenas
    (`[blocks, block_size, dim]`) and return the queries' rotated rope part [tokens, heads,
    rope]. `q` is [tokens, heads * (nope + rope)], `kv_a` [tokens, latent + rope]; `cos`/`sin`
    are [positions, rope / 2] float32 (YaRN's attention factor folded in)."""
    tokens, half = q.shape[0], cos.shape[1]
    latent = kv_a.shape[1] - 2 * half
    q_pe = torch.empty(tokens, num_heads, 2 * half, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return q_pe
    if q.stride(1) != 1 or kv_a.stride(1) != 1 or ckv_layer.stride(2) != 1:
        raise ValueError("rows must be contiguous in their last dimension")
    _latent_input_kernel[(tokens, num_heads + 1)](
        q, kv_a, norm, cos, sin, positions, slot_mapping, q_pe, ckv_layer, kpe_layer,
        q.stride(0), kv_a.stride(0), q_pe.stride(0), cos.stride(0),
        ckv_layer.stride(0), ckv_layer.stride(1), kpe_layer.stride(0), kpe_layer.stride(1),
        ckv_layer.shape[1], eps,
        NUM_HEADS=num_heads, NOPE=nope_dim, HALF_ROPE=half, LATENT=latent,
        LATENT_BLOCK=triton.next_power_of_2(latent),
    )  # fmt: skip
    return q_pe
