"""Triton kernels for the Gated DeltaNet layers (references: `ops.causal_conv1d`,
`ops.recurrent_gated_delta_rule`), over the whole batch with each sequence's state slot.

Both walk each sequence's tokens in order, so they serve decode (one token) and any chunk that
continues from a state; the chunked prefill form is still the torch reference. Not wired into
the model yet: they pass their tests on the CPU interpreter, not yet on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _causal_conv1d_kernel(
    x_ptr,
    w_ptr,
    state_ptr,
    out_ptr,
    slots_ptr,
    bounds_ptr,
    channels,
    stride_x,
    stride_out,
    stride_state_slot,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < channels
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    start = tl.load(bounds_ptr + seq)
    end = tl.load(bounds_ptr + seq + 1)
    state = state_ptr + slot * stride_state_slot + cols * (WIDTH - 1)
    # The window of the last three inputs (WIDTH 4, as every Qwen3.5 size has).
    x0 = tl.load(state + 0, mask=mask, other=0.0)
    x1 = tl.load(state + 1, mask=mask, other=0.0)
    x2 = tl.load(state + 2, mask=mask, other=0.0)
    w0 = tl.load(w_ptr + cols * WIDTH + 0, mask=mask, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + cols * WIDTH + 1, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + cols * WIDTH + 2, mask=mask, other=0.0).to(tl.float32)
    w3 = tl.load(w_ptr + cols * WIDTH + 3, mask=mask, other=0.0).to(tl.float32)
    for t in range(start, end):
        x3 = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        y = w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3
        # As transformers: the conv's output is rounded to the input dtype, then SiLU.
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + t * stride_out + cols, (y * tl.sigmoid(y)).to(out_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip
        x0, x1, x2 = x1, x2, x3
    tl.store(state + 0, x0, mask=mask)
    tl.store(state + 1, x1, mask=mask)
    tl.store(state + 2, x2, mask=mask)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    bounds: torch.Tensor,
) -> torch.Tensor:
    """SiLU(causal depthwise conv) of every sequence's rows of x [T, C] (sequence i owns rows
    bounds[i]:bounds[i+1]), continuing from states[slots[i]] [C, 3] and leaving its last three
    inputs there. weight [C, 4]; states float32; slots and bounds int32 on x's device."""
    assert weight.shape[1] == 4 and states.dtype == torch.float32 and x.stride(1) == 1
    out = torch.empty_like(x)
    block = 256
    grid = (slots.shape[0], triton.cdiv(x.shape[1], block))
    _causal_conv1d_kernel[grid](
        x, weight.contiguous(), states, out, slots, bounds, x.shape[1], x.stride(0),
        out.stride(0), states.stride(0), WIDTH=4, BLOCK=block,
    )  # fmt: skip
    return out


@triton.jit
def _recurrent_gated_delta_rule_kernel(
    qkv_ptr,
    decay_ptr,
    beta_ptr,
    out_ptr,
    state_ptr,
    slots_ptr,
    bounds_ptr,
    stride_qkv,
    stride_decay,
    stride_beta,
    stride_out,
    stride_state_slot,
    scale,
    KEY_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
):
    seq = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // GROUP
    ks = tl.arange(0, DK)
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    start = tl.load(bounds_ptr + seq)
    end = tl.load(bounds_ptr + seq + 1)
    state = state_ptr + slot * stride_state_slot + hv * DK * DV + ks[:, None] * DV + vs[None, :]
    s = tl.load(state)  # [DK, BV] float32
    for t in range(start, end):
        row = qkv_ptr + t * stride_qkv
        q = tl.load(row + hk * DK + ks).to(tl.float32)
        k = tl.load(row + KEY_DIM + hk * DK + ks).to(tl.float32)
        v = tl.load(row + 2 * KEY_DIM + hv * DV + vs).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        decay = tl.load(decay_ptr + t * stride_decay + hv)
        beta = tl.load(beta_ptr + t * stride_beta + hv).to(tl.float32)
        s = s * tl.exp(decay)
        read = tl.sum(s * k[:, None], axis=0)
        s = s + k[:, None] * (beta * (v - read))[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(out_ptr + t * stride_out + hv * DV + vs, o.to(out_ptr.dtype.element_ty))
    tl.store(state, s)


def recurrent_gated_delta_rule(
    qkv: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    bounds: torch.Tensor,
    num_key_heads: int,
    key_dim: int,
) -> torch.Tensor:
    """The delta rule token by token for every sequence of the batch.

    qkv [T, 2·Hk·dk + Hv·dv] is the conv's output ([q | k | v]; q and k are L2-normalised and
    q scaled by dk^-0.5 here), decay (float32) and beta [T, Hv], states [slots, Hv, dk, dv]
    float32, updated in place. Returns o [T, Hv, dv] in qkv's dtype.
    """
    heads, dk, dv = states.shape[1], key_dim, states.shape[3]
    assert states.shape[2] == dk and decay.dtype == torch.float32 and qkv.stride(1) == 1
    out = torch.empty(qkv.shape[0], heads, dv, dtype=qkv.dtype, device=qkv.device)
    bv = min(dv, 32)
    grid = (slots.shape[0], heads, dv // bv)
    _recurrent_gated_delta_rule_kernel[grid](
        qkv, decay, beta, out, states, slots, bounds, qkv.stride(0), decay.stride(0),
        beta.stride(0), out.stride(0), states.stride(0), dk**-0.5,
        KEY_DIM=num_key_heads * dk, GROUP=heads // num_key_heads, DK=dk, DV=dv, BV=bv,
    )  # fmt: skip
    return out
