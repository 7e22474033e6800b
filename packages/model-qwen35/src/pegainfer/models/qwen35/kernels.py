"""Triton kernels for the Gated DeltaNet layers, over a whole step at once.

References (torch, one sequence at a time): `ops.causal_conv1d`, `ops.recurrent_gated_delta_rule`
and `ops.chunked_gated_delta_rule`. Every kernel reads the layer's fused input projection as it
comes out of the GEMM (`[qkv | z | b | a]` per token, see `GatedDeltaNet`) and each sequence's
state in place in its slot of the layer's state arena.

- `causal_conv1d`: one program per (sequence, channel block) walks the sequence's tokens in
  tiles, so it serves decode and prefill alike; it also leaves the conv window at a checkpoint.
- `recurrent_gated_delta_rule`: decode (one token per sequence); captured in CUDA graphs.
- `gated_rms_norm`: the DeltaNet's output norm, gated by SiLU(z) (reference: `ops.gated_rms_norm`).
- `chunked_gated_delta_rule`: any step with longer chunks. Two launches, as flash-linear-attention
  splits it: first, independently per 64-token chunk and value head, the unit-triangular system
  of the chunk is inverted by forward substitution and applied to the keys and values (`W`,
  `U`); then one program per (sequence, value head, value block) carries the state across its
  chunks, which is the only sequential part, and writes the outputs.

The gates are computed inside the kernels from the projection's raw `a` and `b` columns:
`g = -exp(A_log) softplus(a + dt_bias)` and `beta = sigmoid(b)` (rounded to the input dtype, as
transformers computes it), and q and k are L2-normalised in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

#: Tokens per chunk of the chunked delta rule (transformers' and flash-linear-attention's 64).
CHUNK = 64


@dataclass(frozen=True)
class DeltaNetShape:
    num_key_heads: int
    num_value_heads: int
    key_dim: int  # per head
    value_dim: int  # per head

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_key_heads * self.key_dim + self.num_value_heads * self.value_dim


@triton.jit
def _gates(ab_row, a_col, b_col, hv, a_log_ptr, dt_bias_ptr, mask):
    """Log-decay g and beta (float32) of value head `hv` for the rows at `ab_row`."""
    a = tl.load(ab_row + a_col + hv, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(ab_row + b_col + hv, mask=mask, other=0.0)
    x = a + tl.load(dt_bias_ptr + hv).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = -tl.exp(tl.load(a_log_ptr + hv).to(tl.float32)) * softplus
    beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)
    return tl.where(mask, g, 0.0), tl.where(mask, beta, 0.0)


@triton.jit
def _l2_normalize(x):
    """Rows of x [N, D] (float32) over their last dimension, as `ops.l2_normalize`."""
    return x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


@triton.jit
def _causal_conv1d_kernel(
    x_ptr,
    w_ptr,
    state_ptr,
    out_ptr,
    slots_ptr,
    bounds_ptr,
    snap_offset_ptr,
    snap_slot_ptr,
    channels,
    stride_x,
    stride_out,
    stride_state_slot,
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = cols < channels
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    start = tl.load(bounds_ptr + seq).to(tl.int64)
    n = tl.load(bounds_ptr + seq + 1).to(tl.int64) - start
    state = state_ptr + slot * stride_state_slot + cols * 3
    # The window at a checkpoint inside the chunk and at its end, read before anything is stored:
    # input j of the window ending at offset e is row e - 3 + j, or the old window before row 0.
    snap = tl.load(snap_offset_ptr + seq)
    snap_state = state_ptr + tl.load(snap_slot_ptr + seq).to(tl.int64) * stride_state_slot
    for j in tl.static_range(3):
        e = n - 3 + j
        last = tl.load(x_ptr + (start + e) * stride_x + cols, mask=cmask & (e >= 0), other=0.0)
        old = tl.load(state + n + j, mask=cmask & (e < 0), other=0.0)
        if snap >= 0:
            s = snap - 3 + j
            at = tl.load(x_ptr + (start + s) * stride_x + cols, mask=cmask & (s >= 0), other=0.0)
            before = tl.load(state + snap + j, mask=cmask & (s < 0), other=0.0)
            tl.store(snap_state + cols * 3 + j, at.to(tl.float32) + before, mask=cmask)
        if j == 0:
            w0 = last.to(tl.float32) + old
        elif j == 1:
            w1 = last.to(tl.float32) + old
        else:
            w2 = last.to(tl.float32) + old
    for t0 in range(0, n, BT):
        rows = t0 + tl.arange(0, BT)
        rmask = rows < n
        acc = tl.zeros((BT, BC), dtype=tl.float32)
        for k in tl.static_range(4):
            r = rows - (3 - k)  # the input row tap k reads; below 0 it is in the old window
            m = rmask[:, None] & cmask[None, :]
            from_x = tl.load(x_ptr + (start + r)[:, None] * stride_x + cols[None, :],
                             mask=m & (r >= 0)[:, None], other=0.0)  # fmt: skip
            from_state = tl.load(state[None, :] + (3 + r)[:, None], mask=m & (r < 0)[:, None],
                                 other=0.0)  # fmt: skip
            weight = tl.load(w_ptr + cols * 4 + k, mask=cmask, other=0.0).to(tl.float32)
            acc += weight[None, :] * (from_x.to(tl.float32) + from_state)
        # As transformers: the conv's output is rounded to the input dtype, then SiLU.
        y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + (start + rows)[:, None] * stride_out + cols[None, :],
                 (y * tl.sigmoid(y)).to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])  # fmt: skip
    tl.store(state + 0, w0, mask=cmask)
    tl.store(state + 1, w1, mask=cmask)
    tl.store(state + 2, w2, mask=cmask)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    bounds: torch.Tensor,
    snapshots: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_len: int = 64,
) -> torch.Tensor:
    """SiLU(causal depthwise conv) of every sequence's rows of x [T, C] (sequence i owns rows
    bounds[i]:bounds[i+1]), continuing from states[slots[i]] [C, 3] and leaving its last three
    inputs there. weight [C, 1, 4] (or [C, 4]); states float32. `snapshots` (offsets, slots),
    per sequence: also store the window after `offset` rows into that slot (offset -1: none).
    `max_len` (the longest sequence's rows) only picks the tile height."""
    assert weight.shape[-1] == 4 and states.dtype == torch.float32 and x.stride(1) == 1
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_seqs = slots.shape[0]
    if snapshots is None:
        none = torch.full((num_seqs,), -1, dtype=torch.int32, device=x.device)
        snapshots = (none, slots)
    block_c = 128 if max_len > 1 else 256
    grid = (num_seqs, triton.cdiv(x.shape[1], block_c))
    _causal_conv1d_kernel[grid](
        x, weight.reshape(weight.shape[0], 4), states, out, slots, bounds, snapshots[0],
        snapshots[1], x.shape[1], x.stride(0), out.stride(0), states.stride(0),
        BT=min(32, triton.next_power_of_2(max_len)), BC=block_c,
    )  # fmt: skip
    return out


@triton.jit
def _recurrent_kernel(
    qkv_ptr,
    ab_ptr,
    a_log_ptr,
    dt_bias_ptr,
    out_ptr,
    state_ptr,
    slots_ptr,
    stride_qkv,
    stride_ab,
    a_col,
    b_col,
    stride_out,
    stride_state_slot,
    scale,
    KEY_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
):
    t = tl.program_id(0)  # one token per sequence: row t is sequence t
    hv = tl.program_id(1)
    hk = hv // GROUP
    ks = tl.arange(0, DK)
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    state = state_ptr + slot * stride_state_slot + hv * DK * DV + ks[:, None] * DV + vs[None, :]
    s = tl.load(state)  # [DK, BV] float32
    row = qkv_ptr + t * stride_qkv
    q = tl.load(row + hk * DK + ks).to(tl.float32)
    k = tl.load(row + KEY_DIM + hk * DK + ks).to(tl.float32)
    v = tl.load(row + 2 * KEY_DIM + hv * DV + vs).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    g, beta = _gates(ab_ptr + t * stride_ab, a_col, b_col, hv, a_log_ptr, dt_bias_ptr, True)
    s = s * tl.exp(g)
    read = tl.sum(s * k[:, None], axis=0)
    s = s + k[:, None] * (beta * (v - read))[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(out_ptr + t * stride_out + hv * DV + vs, o.to(out_ptr.dtype.element_ty))
    tl.store(state, s)


def recurrent_gated_delta_rule(
    qkv: torch.Tensor,
    proj: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    shape: DeltaNetShape,
) -> torch.Tensor:
    """One delta-rule step for each sequence of a decode batch (row i is sequence i).

    qkv [S, C] is the conv's output ([q | k | v]); proj [S, *] the layer's input projection,
    whose last 2·Hv columns are b then a; states [slots, Hv, dk, dv] float32, updated in place.
    Returns o [S, Hv, dv] in qkv's dtype.
    """
    heads, dk, dv = shape.num_value_heads, shape.key_dim, shape.value_dim
    assert states.shape[1:] == (heads, dk, dv) and qkv.stride(1) == 1 and proj.stride(1) == 1
    out = torch.empty(qkv.shape[0], heads, dv, dtype=qkv.dtype, device=qkv.device)
    bv = min(dv, 32)
    grid = (qkv.shape[0], heads, dv // bv)
    _recurrent_kernel[grid](
        qkv, proj, a_log, dt_bias, out, states, slots, qkv.stride(0), proj.stride(0),
        proj.shape[1] - heads, proj.shape[1] - 2 * heads, out.stride(0), states.stride(0),
        dk**-0.5, KEY_DIM=shape.num_key_heads * dk, GROUP=heads // shape.num_key_heads, DK=dk,
        DV=dv, BV=bv,
    )  # fmt: skip
    return out


@triton.jit
def _dot(a, b):
    """Float32 products on tensor cores in three TF32 passes (float32 accuracy): with one
    pass (10-bit mantissa) the 4B golden gate's p99 drifted past its tolerance."""
    return tl.dot(a, b, input_precision="tf32x3")


@triton.jit
def _sub_block(
    qkv_ptr, ab_ptr, a_log_ptr, dt_bias_ptr, start, end, offset, hk, hv, stride_qkv, stride_ab,
    a_col, b_col, KEY_DIM: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """Rows offset..offset+BC of a chunk: normalised q and k, v, the gates."""
    rows = start + offset + tl.arange(0, BC)
    mask = rows < end
    ks, vs = tl.arange(0, DK), tl.arange(0, DV)
    base = qkv_ptr + rows[:, None] * stride_qkv + hk * DK + ks[None, :]
    q = _l2_normalize(tl.load(base, mask=mask[:, None], other=0.0).to(tl.float32))
    k = _l2_normalize(tl.load(base + KEY_DIM, mask=mask[:, None], other=0.0).to(tl.float32))
    v = tl.load(qkv_ptr + rows[:, None] * stride_qkv + 2 * KEY_DIM + hv * DV + vs[None, :],
                mask=mask[:, None], other=0.0).to(tl.float32)  # fmt: skip
    g, beta = _gates(ab_ptr + rows * stride_ab, a_col, b_col, hv, a_log_ptr, dt_bias_ptr, mask)
    return rows, mask, q, k, v, g, beta


@triton.jit
def _inverse_unit_lower(a, BC: tl.constexpr):
    """(I + a)^-1 of a strictly lower-triangular [BC, BC] a, by forward substitution: row r
    of the inverse is e_r - sum_{j<r} a[r, j] T[j, :]."""
    i = tl.arange(0, BC)[:, None]
    j = tl.arange(0, BC)[None, :]
    t = tl.where(i == j, 1.0, 0.0)
    for r in range(1, BC):
        a_row = tl.sum(tl.where(i == r, a, 0.0), axis=0)
        t = tl.where(i == r, t - tl.sum(a_row[:, None] * t, axis=0)[None, :], t)
    return t


@triton.jit
def _decayed(x, c_rows, c_cols, causal_diagonal: tl.constexpr, BC: tl.constexpr):
    """x * exp(c_i - c_j), zero above the diagonal (strictly, or not) of a diagonal block."""
    i = tl.arange(0, BC)[:, None]
    j = tl.arange(0, BC)[None, :]
    if causal_diagonal == 1:  # strictly lower
        keep = i > j
    elif causal_diagonal == 2:  # lower, diagonal included
        keep = i >= j
    else:  # an off-diagonal block: every row comes after every column
        keep = i >= 0
    return tl.where(keep, x * tl.exp(tl.where(keep, c_rows[:, None] - c_cols[None, :], 0.0)), 0.0)


@triton.jit
def _chunk_prepare_kernel(
    qkv_ptr,
    ab_ptr,
    a_log_ptr,
    dt_bias_ptr,
    chunk_start_ptr,
    chunk_end_ptr,
    w_ptr,
    u_ptr,
    c_ptr,
    aqk_ptr,
    stride_qkv,
    stride_ab,
    a_col,
    b_col,
    scale,
    HV: tl.constexpr,
    KEY_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BC: tl.constexpr,
):
    """Per (chunk, value head), with the 64-token chunk as four blocks of BC=16 rows:
    A[i, j] = beta_i exp(c_i - c_j) k_i.k_j (strictly lower), T = (I + A)^-1 blockwise (each
    diagonal block by substitution, the blocks below it from those), W = T (beta exp(c) K),
    U = T (beta V), and the chunk's causal decayed q.k matrix; all stored for the scan."""
    chunk = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // GROUP
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    end = tl.load(chunk_end_ptr + chunk).to(tl.int64)
    r0, m0, q0, k0, v0, g0, b0 = _sub_block(
        qkv_ptr, ab_ptr, a_log_ptr, dt_bias_ptr, start, end, 0, hk, hv, stride_qkv,
        stride_ab, a_col, b_col, KEY_DIM, DK, DV, BC,
    )  # fmt: skip
    r1, m1, q1, k1, v1, g1, b1 = _sub_block(
        qkv_ptr, ab_ptr, a_log_ptr, dt_bias_ptr, start, end, BC, hk, hv, stride_qkv,
        stride_ab, a_col, b_col, KEY_DIM, DK, DV, BC,
    )  # fmt: skip
    r2, m2, q2, k2, v2, g2, b2 = _sub_block(
        qkv_ptr, ab_ptr, a_log_ptr, dt_bias_ptr, start, end, 2 * BC, hk, hv, stride_qkv,
        stride_ab, a_col, b_col, KEY_DIM, DK, DV, BC,
    )  # fmt: skip
    r3, m3, q3, k3, v3, g3, b3 = _sub_block(
        qkv_ptr, ab_ptr, a_log_ptr, dt_bias_ptr, start, end, 3 * BC, hk, hv, stride_qkv,
        stride_ab, a_col, b_col, KEY_DIM, DK, DV, BC,
    )  # fmt: skip
    # Cumulative log-decay across the chunk.
    c0 = tl.cumsum(g0, axis=0)
    c1 = tl.cumsum(g1, axis=0) + tl.sum(g0, axis=0)
    c2 = tl.cumsum(g2, axis=0) + tl.sum(g0, axis=0) + tl.sum(g1, axis=0)
    c3 = tl.cumsum(g3, axis=0) + tl.sum(g0, axis=0) + tl.sum(g1, axis=0) + tl.sum(g2, axis=0)
    tl.store(c_ptr + r0 * HV + hv, c0, mask=m0)
    tl.store(c_ptr + r1 * HV + hv, c1, mask=m1)
    tl.store(c_ptr + r2 * HV + hv, c2, mask=m2)
    tl.store(c_ptr + r3 * HV + hv, c3, mask=m3)
    # The causal decayed q.k matrix, block by block (zero above the diagonal).
    ii = tl.arange(0, BC)[:, None]
    jj = tl.arange(0, BC)[None, :]
    aqk = aqk_ptr + (chunk * HV + hv) * (16 * BC * BC) + ii * (4 * BC) + jj
    q0, q1, q2, q3 = q0 * scale, q1 * scale, q2 * scale, q3 * scale
    zero = tl.zeros((BC, BC), dtype=tl.float32)
    tl.store(aqk, _decayed(_dot(q0, tl.trans(k0)), c0, c0, 2, BC))
    tl.store(aqk + BC, zero)
    tl.store(aqk + 2 * BC, zero)
    tl.store(aqk + 3 * BC, zero)
    row1 = aqk + BC * 4 * BC
    tl.store(row1, _decayed(_dot(q1, tl.trans(k0)), c1, c0, 0, BC))
    tl.store(row1 + BC, _decayed(_dot(q1, tl.trans(k1)), c1, c1, 2, BC))
    tl.store(row1 + 2 * BC, zero)
    tl.store(row1 + 3 * BC, zero)
    row2 = row1 + BC * 4 * BC
    tl.store(row2, _decayed(_dot(q2, tl.trans(k0)), c2, c0, 0, BC))
    tl.store(row2 + BC, _decayed(_dot(q2, tl.trans(k1)), c2, c1, 0, BC))
    tl.store(row2 + 2 * BC, _decayed(_dot(q2, tl.trans(k2)), c2, c2, 2, BC))
    tl.store(row2 + 3 * BC, zero)
    row3 = row2 + BC * 4 * BC
    tl.store(row3, _decayed(_dot(q3, tl.trans(k0)), c3, c0, 0, BC))
    tl.store(row3 + BC, _decayed(_dot(q3, tl.trans(k1)), c3, c1, 0, BC))
    tl.store(row3 + 2 * BC, _decayed(_dot(q3, tl.trans(k2)), c3, c2, 0, BC))
    tl.store(row3 + 3 * BC, _decayed(_dot(q3, tl.trans(k3)), c3, c3, 2, BC))
    # A by blocks (row scale beta), then T = (I + A)^-1 by blocks.
    a10 = b1[:, None] * _decayed(_dot(k1, tl.trans(k0)), c1, c0, 0, BC)
    a20 = b2[:, None] * _decayed(_dot(k2, tl.trans(k0)), c2, c0, 0, BC)
    a21 = b2[:, None] * _decayed(_dot(k2, tl.trans(k1)), c2, c1, 0, BC)
    a30 = b3[:, None] * _decayed(_dot(k3, tl.trans(k0)), c3, c0, 0, BC)
    a31 = b3[:, None] * _decayed(_dot(k3, tl.trans(k1)), c3, c1, 0, BC)
    a32 = b3[:, None] * _decayed(_dot(k3, tl.trans(k2)), c3, c2, 0, BC)
    t00 = _inverse_unit_lower(b0[:, None] * _decayed(_dot(k0, tl.trans(k0)), c0, c0, 1, BC), BC)
    t11 = _inverse_unit_lower(b1[:, None] * _decayed(_dot(k1, tl.trans(k1)), c1, c1, 1, BC), BC)
    t22 = _inverse_unit_lower(b2[:, None] * _decayed(_dot(k2, tl.trans(k2)), c2, c2, 1, BC), BC)
    t33 = _inverse_unit_lower(b3[:, None] * _decayed(_dot(k3, tl.trans(k3)), c3, c3, 1, BC), BC)
    t10 = -_dot(t11, _dot(a10, t00))
    t21 = -_dot(t22, _dot(a21, t11))
    t20 = -_dot(t22, _dot(a20, t00) + _dot(a21, t10))
    t32 = -_dot(t33, _dot(a32, t22))
    t31 = -_dot(t33, _dot(a31, t11) + _dot(a32, t21))
    t30 = -_dot(t33, _dot(a30, t00) + _dot(a31, t10) + _dot(a32, t20))
    # W = T (beta exp(c) K) and U = T (beta V), block row by block row.
    kb0, kb1 = k0 * (b0 * tl.exp(c0))[:, None], k1 * (b1 * tl.exp(c1))[:, None]
    kb2, kb3 = k2 * (b2 * tl.exp(c2))[:, None], k3 * (b3 * tl.exp(c3))[:, None]
    vb0, vb1, vb2, vb3 = v0 * b0[:, None], v1 * b1[:, None], v2 * b2[:, None], v3 * b3[:, None]
    ks, vs = tl.arange(0, DK), tl.arange(0, DV)
    w_at = w_ptr + hv * DK + ks[None, :]
    u_at = u_ptr + hv * DV + vs[None, :]
    tl.store(w_at + (r0 * HV * DK)[:, None], _dot(t00, kb0), mask=m0[:, None])
    tl.store(u_at + (r0 * HV * DV)[:, None], _dot(t00, vb0), mask=m0[:, None])
    tl.store(w_at + (r1 * HV * DK)[:, None], _dot(t10, kb0) + _dot(t11, kb1),
             mask=m1[:, None])  # fmt: skip
    tl.store(u_at + (r1 * HV * DV)[:, None], _dot(t10, vb0) + _dot(t11, vb1),
             mask=m1[:, None])  # fmt: skip
    w2 = _dot(t20, kb0) + _dot(t21, kb1) + _dot(t22, kb2)
    tl.store(w_at + (r2 * HV * DK)[:, None], w2, mask=m2[:, None])
    u2 = _dot(t20, vb0) + _dot(t21, vb1) + _dot(t22, vb2)
    tl.store(u_at + (r2 * HV * DV)[:, None], u2, mask=m2[:, None])
    w3 = _dot(t30, kb0) + _dot(t31, kb1) + _dot(t32, kb2) + _dot(t33, kb3)
    tl.store(w_at + (r3 * HV * DK)[:, None], w3, mask=m3[:, None])
    u3 = _dot(t30, vb0) + _dot(t31, vb1) + _dot(t32, vb2) + _dot(t33, vb3)
    tl.store(u_at + (r3 * HV * DV)[:, None], u3, mask=m3[:, None])


@triton.jit
def _chunk_scan_kernel(
    qkv_ptr,
    w_ptr,
    u_ptr,
    c_ptr,
    aqk_ptr,
    out_ptr,
    state_ptr,
    slots_ptr,
    seq_chunks_ptr,
    chunk_start_ptr,
    chunk_end_ptr,
    chunk_snapshot_ptr,
    stride_qkv,
    stride_out,
    stride_state_slot,
    scale,
    HV: tl.constexpr,
    KEY_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
):
    """Per (sequence, value head, value block): the state across the sequence's chunks. With
    u = U - W S, the chunk's outputs are exp(c) (q S) + Aqk u and it leaves
    S' = exp(c_last) S + (K exp(c_last - c))^T u."""
    seq = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // GROUP
    ks = tl.arange(0, DK)
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    ts = tl.arange(0, BT)
    offsets = hv * DK * DV + ks[:, None] * DV + vs[None, :]
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    s = tl.load(state_ptr + slot * stride_state_slot + offsets)  # [DK, BV] float32
    for chunk in range(tl.load(seq_chunks_ptr + seq), tl.load(seq_chunks_ptr + seq + 1)):
        start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
        end = tl.load(chunk_end_ptr + chunk).to(tl.int64)
        rows = start + ts
        rmask = rows < end
        base = qkv_ptr + rows[:, None] * stride_qkv + hk * DK + ks[None, :]
        q = _l2_normalize(tl.load(base, mask=rmask[:, None], other=0.0).to(tl.float32)) * scale
        k = _l2_normalize(tl.load(base + KEY_DIM, mask=rmask[:, None], other=0.0).to(tl.float32))
        c = tl.load(c_ptr + rows * HV + hv, mask=rmask, other=0.0)
        c_last = tl.sum(tl.where(rows == end - 1, c, 0.0), axis=0)
        w_rows = (rows * HV + hv)[:, None]
        w = tl.load(w_ptr + w_rows * DK + ks[None, :], mask=rmask[:, None], other=0.0)
        u = tl.load(u_ptr + w_rows * DV + vs[None, :], mask=rmask[:, None], other=0.0)
        aqk = tl.load(aqk_ptr + (chunk * HV + hv) * BT * BT + ts[:, None] * BT + ts[None, :])
        u = u - _dot(w, s)  # the chunk's updates given the state
        o = tl.exp(c)[:, None] * _dot(q, s) + _dot(aqk, u)
        tl.store(out_ptr + rows[:, None] * stride_out + hv * DV + vs[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=rmask[:, None])  # fmt: skip
        k_tail = k * tl.where(rmask, tl.exp(c_last - c), 0.0)[:, None]
        s = tl.exp(c_last) * s + _dot(tl.trans(k_tail), u)
        snapshot = tl.load(chunk_snapshot_ptr + chunk)
        if snapshot >= 0:  # a checkpoint after this chunk
            tl.store(state_ptr + snapshot.to(tl.int64) * stride_state_slot + offsets, s)
    tl.store(state_ptr + slot * stride_state_slot + offsets, s)


@dataclass(frozen=True)
class ChunkPlan:
    """A step's sequences cut into chunks of at most CHUNK tokens (int32, on the device).

    Sequence i owns chunks seq_chunks[i]:seq_chunks[i+1], chunk n covers token rows
    start[n]:end[n], and snapshot[n] is the slot that takes the state after chunk n, or -1.
    """

    seq_chunks: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    snapshot: torch.Tensor

    @property
    def num_chunks(self) -> int:
        return self.start.shape[0]

    @staticmethod
    def host_lists(
        bounds: list[int], snapshots: list[tuple[int, int] | None]
    ) -> tuple[list[int], list[int], list[int], list[int]]:
        """The plan's four lists: chunks break every CHUNK tokens and at each checkpoint."""
        seq_chunks, starts, ends, snaps = [0], [], [], []
        for i, snap in enumerate(snapshots):
            lo, hi = bounds[i], bounds[i + 1]
            cut = lo + snap[0] if snap is not None and snap[0] > 0 else None
            for piece_lo, piece_hi in ((lo, cut), (cut, hi)) if cut is not None else ((lo, hi),):
                for s in range(piece_lo, piece_hi, CHUNK):
                    starts.append(s)
                    ends.append(min(s + CHUNK, piece_hi))
                    snaps.append(-1)
                if piece_hi == cut and snaps:
                    snaps[-1] = snap[1]
            seq_chunks.append(len(starts))
        return seq_chunks, starts, ends, snaps


def chunked_gated_delta_rule(
    qkv: torch.Tensor,
    proj: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    plan: ChunkPlan,
    shape: DeltaNetShape,
) -> torch.Tensor:
    """The delta rule over every sequence's chunks, from and into its state slot.

    Arguments as `recurrent_gated_delta_rule`, with rows grouped by sequence as `plan` says.
    Returns o [T, Hv, dv] in qkv's dtype.
    """
    heads, dk, dv = shape.num_value_heads, shape.key_dim, shape.value_dim
    assert states.shape[1:] == (heads, dk, dv) and qkv.stride(1) == 1 and proj.stride(1) == 1
    tokens, device = qkv.shape[0], qkv.device
    w = torch.empty(tokens, heads, dk, dtype=torch.float32, device=device)
    u = torch.empty(tokens, heads, dv, dtype=torch.float32, device=device)
    c = torch.empty(tokens, heads, dtype=torch.float32, device=device)
    aqk = torch.empty(plan.num_chunks, heads, CHUNK, CHUNK, dtype=torch.float32, device=device)
    out = torch.empty(tokens, heads, dv, dtype=qkv.dtype, device=device)
    key_dim, group = shape.num_key_heads * dk, heads // shape.num_key_heads
    a_col, b_col = proj.shape[1] - heads, proj.shape[1] - 2 * heads
    _chunk_prepare_kernel[(plan.num_chunks, heads)](
        qkv, proj, a_log, dt_bias, plan.start, plan.end, w, u, c, aqk, qkv.stride(0),
        proj.stride(0), a_col, b_col, dk**-0.5, HV=heads, KEY_DIM=key_dim, GROUP=group, DK=dk,
        DV=dv, BC=CHUNK // 4, num_warps=4,
    )  # fmt: skip
    bv = min(dv, 32)
    _chunk_scan_kernel[(slots.shape[0], heads, dv // bv)](
        qkv, w, u, c, aqk, out, states, slots, plan.seq_chunks, plan.start, plan.end,
        plan.snapshot,
        qkv.stride(0), out.stride(0), states.stride(0), dk**-0.5, HV=heads, KEY_DIM=key_dim,
        GROUP=group, DK=dk, DV=dv, BV=bv, BT=CHUNK, num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr, rows, heads, stride_z, eps,
    D: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = r < rows
    cols = tl.arange(0, D)
    m = rmask[:, None]
    x = tl.load(x_ptr + r[:, None] * D + cols[None, :], mask=m, other=0.0)
    z_rows = (r // heads) * stride_z + (r % heads) * D
    z = tl.load(z_ptr + z_rows[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]).to(x.dtype)
    # As transformers: weight * norm in the input dtype, then times SiLU(z) in float32.
    scaled = (tl.load(w_ptr + cols)[None, :] * normed).to(x.dtype).to(tl.float32)
    out = scaled * z * tl.sigmoid(z)
    tl.store(out_ptr + r[:, None] * D + cols[None, :], out.to(x.dtype), mask=m)


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`weight * norm(x) * silu(z)` per head: x [T, H, D] contiguous, z [T, H, D] with rows of
    any stride (a view into the input projection)."""
    tokens, heads, dim = x.shape
    assert x.is_contiguous() and z.stride(2) == 1 and z.stride(1) == dim
    assert weight.dtype == x.dtype
    out = torch.empty_like(x)
    rows, block = tokens * heads, 16
    _gated_rms_norm_kernel[(triton.cdiv(rows, block),)](
        x, z, weight, out, rows, heads, z.stride(0), eps, D=dim, ROWS=block
    )
    return out
