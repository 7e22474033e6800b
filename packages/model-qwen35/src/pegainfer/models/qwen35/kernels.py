"""Triton kernels for the Gated DeltaNet layers, over a whole step at once.

References (torch, one sequence at a time): `ops.causal_conv1d`, `ops.recurrent_gated_delta_rule`
and `ops.chunked_gated_delta_rule`. Every kernel reads the layer's fused input projection as it
comes out of the GEMM (`[qkv | z | b | a]` per token, see `GatedDeltaNet`) and each sequence's
state in place in its slot of the layer's state arena.

- `causal_conv1d`: one program per (tile of at most 32 rows of a sequence, channel block), so a
  long prompt spreads over the GPU; a sequence's first tile also moves its conv window (and
  leaves the window at a checkpoint).
- `recurrent_gated_delta_rule`: one-token sequences (a decode step, captured in CUDA graphs,
  and the decodes of a mixed step).
- `decode_gated_delta_net` (opt-in until the H200 has timed it: `model.FUSED_DECODE_ENV`): a
  decode step's conv, recurrent step and gated norm in one launch, each state and conv window
  read once and written once in place; `DecodeLaunch` sets its split of a value head.
- `gated_rms_norm`: the DeltaNet's output norm, gated by SiLU(z) (reference: `ops.gated_rms_norm`).
- `chunked_gated_delta_rule`: longer chunks, by flash-linear-attention's chunk algorithm in three
  launches: per 64-token chunk and value head, the chunk's unit-triangular system is inverted by
  16-row blocks and applied to the keys and values (the WY factors `W`, `U`); one program per
  (sequence, value head, value block) carries the state across its chunks, the only sequential
  part; per chunk again, the outputs. Products run on bf16 tensor cores with float32
  accumulation to float32 accuracy (`_mm`: a bf16 model's q, k and v enter exactly, float32
  operands as three bf16 pieces); the state, the inverse and every intermediate stay float32.

The gates are computed inside the kernels from the projection's raw `a` and `b` columns:
`g = -exp(A_log) softplus(a + dt_bias)` and `beta = sigmoid(b)` (rounded to the input dtype, as
transformers computes it), and q and k are L2-normalised in float32.

The per-step index arrays (slots, sequence bounds, chunk bounds, tiles, snapshots) are declared
`do_not_specialize_on_alignment`: they are often views at a step-dependent offset (the decodes'
slots, then the prompts'), and Triton would otherwise compile each kernel once more for every
pattern of their 16-byte alignment, in the middle of serving (21 such compiles, 1-2 s each,
stalled the first 40 requests of a 16-stream load on an H200). They are read once per program,
so the vectorisation alignment buys is worth nothing there.
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


#: Rows of one program of the conv over longer chunks: a step's sequences are cut into tiles of
#: at most this many rows, which run in parallel.
CONV_TILE = 32


@triton.jit(
    do_not_specialize_on_alignment=[
        "slots_ptr",
        "bounds_ptr",
        "tile_seq_ptr",
        "tile_row_ptr",
        "snap_offset_ptr",
        "snap_slot_ptr",
    ]
)
def _causal_conv1d_kernel(
    x_ptr,
    w_ptr,
    state_ptr,
    out_ptr,
    slots_ptr,
    bounds_ptr,
    tile_seq_ptr,
    tile_row_ptr,
    snap_offset_ptr,
    snap_slot_ptr,
    channels,
    stride_x,
    stride_out,
    stride_state_slot,
    BT: tl.constexpr,
    BC: tl.constexpr,
    TILED: tl.constexpr,
    SNAPSHOTS: tl.constexpr,
):
    """One tile of a sequence's rows (TILED: tile_seq/tile_row say whose and from which row;
    else tile i is all of sequence i) and a block of channels. Only a sequence's first tile
    reads the old window (the others start CONV_TILE rows in) and only it stores the new
    window and the checkpoint's, so no program reads a window another has replaced."""
    tile = tl.program_id(0)
    seq = tl.load(tile_seq_ptr + tile) if TILED else tile
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = cols < channels
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    start = tl.load(bounds_ptr + seq).to(tl.int64)
    n = tl.load(bounds_ptr + seq + 1).to(tl.int64) - start
    lo = tl.load(tile_row_ptr + tile).to(tl.int64) - start if TILED else start - start
    first = cmask & (lo == 0)
    state = state_ptr + slot * stride_state_slot + cols * 3
    # The window at a checkpoint inside the chunk and at its end: input j of the window ending
    # at offset e is row e - 3 + j, or the old window before row 0.
    if SNAPSHOTS:
        snap = tl.load(snap_offset_ptr + seq)
        snap_state = state_ptr + tl.load(snap_slot_ptr + seq).to(tl.int64) * stride_state_slot
        keep = first & (snap >= 0)
    for j in tl.static_range(3):
        e = n - 3 + j
        last = tl.load(x_ptr + (start + e) * stride_x + cols, mask=first & (e >= 0), other=0.0)
        old = tl.load(state + n + j, mask=first & (e < 0), other=0.0)
        if SNAPSHOTS:
            s = snap - 3 + j
            at = tl.load(x_ptr + (start + s) * stride_x + cols, mask=keep & (s >= 0), other=0.0)
            before = tl.load(state + snap + j, mask=keep & (s < 0), other=0.0)
            tl.store(snap_state + cols * 3 + j, at.to(tl.float32) + before, mask=keep)
        if j == 0:
            w0 = last.to(tl.float32) + old
        elif j == 1:
            w1 = last.to(tl.float32) + old
        else:
            w2 = last.to(tl.float32) + old
    rows = lo + tl.arange(0, BT)
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
    tl.debug_barrier()  # every thread has read the old window before it is replaced
    tl.store(state + 0, w0, mask=first)
    tl.store(state + 1, w1, mask=first)
    tl.store(state + 2, w2, mask=first)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    bounds: torch.Tensor,
    max_len: int,
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
    snapshots: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """SiLU(causal depthwise conv) of every sequence's rows of x [T, C] (sequence i owns rows
    bounds[i]:bounds[i+1]), continuing from states[slots[i]] [C, 3] and leaving its last three
    inputs there. weight [C, 1, 4] (or [C, 4]); states float32. `max_len` is the longest
    sequence's rows; beyond one, `tiles` (each tile's sequence and first row, from
    `conv_tiles`) cuts them into tiles of at most CONV_TILE rows. `snapshots` (offsets,
    slots), per sequence: also store the window after `offset` rows into that slot (offset
    -1: none)."""
    assert weight.shape[-1] == 4 and states.dtype == torch.float32 and x.stride(1) == 1
    assert tiles is not None or max_len == 1, "chunks longer than a token need conv tiles"
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    tile_seq, tile_row = tiles if tiles is not None else (slots, slots)
    snap_offset, snap_slot = snapshots if snapshots is not None else (slots, slots)
    block_c = 128 if max_len > 1 else 256
    grid = (tile_seq.shape[0], triton.cdiv(x.shape[1], block_c))
    _causal_conv1d_kernel[grid](
        x, weight.reshape(weight.shape[0], 4), states, out, slots, bounds, tile_seq, tile_row,
        snap_offset, snap_slot, x.shape[1], x.stride(0), out.stride(0), states.stride(0),
        BT=min(CONV_TILE, triton.next_power_of_2(max_len)), BC=block_c,
        TILED=tiles is not None, SNAPSHOTS=snapshots is not None,
    )  # fmt: skip
    return out


def conv_tiles(bounds: list[int]) -> tuple[list[int], list[int]]:
    """The conv's tiles over sequences of rows bounds[i]:bounds[i+1]: each tile's sequence and
    first row."""
    seqs, rows = [], []
    for i in range(len(bounds) - 1):
        starts = range(bounds[i], bounds[i + 1], CONV_TILE)
        seqs.extend([i] * len(starts))
        rows.extend(starts)
    return seqs, rows


@triton.jit(do_not_specialize_on_alignment=["slots_ptr", "rows_ptr"])
def _recurrent_kernel(
    qkv_ptr,
    ab_ptr,
    a_log_ptr,
    dt_bias_ptr,
    out_ptr,
    state_ptr,
    slots_ptr,
    rows_ptr,
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
    HAS_ROWS: tl.constexpr,
):
    seq = tl.program_id(0)  # one token per sequence: row rows[seq], or row seq
    t = tl.load(rows_ptr + seq).to(tl.int64) if HAS_ROWS else seq.to(tl.int64)
    hv = tl.program_id(1)
    hk = hv // GROUP
    ks = tl.arange(0, DK)
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
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
    rows: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One delta-rule step for each of a batch of one-token sequences.

    Sequence i feeds row rows[i] (default: row i) and keeps its state in slots[i]. qkv [T, C]
    is the conv's output ([q | k | v]); proj [T, *] the layer's input projection, whose last
    2·Hv columns are b then a; states [slots, Hv, dk, dv] float32, updated in place. Writes
    those rows of `out` [T, Hv, dv] (allocated in qkv's dtype when None) and returns it.
    """
    heads, dk, dv = shape.num_value_heads, shape.key_dim, shape.value_dim
    assert states.shape[1:] == (heads, dk, dv) and qkv.stride(1) == 1 and proj.stride(1) == 1
    if out is None:
        out = torch.empty(qkv.shape[0], heads, dv, dtype=qkv.dtype, device=qkv.device)
    bv = min(dv, 32)
    grid = (slots.shape[0], heads, dv // bv)
    _recurrent_kernel[grid](
        qkv, proj, a_log, dt_bias, out, states, slots, slots if rows is None else rows,
        qkv.stride(0), proj.stride(0), proj.shape[1] - heads, proj.shape[1] - 2 * heads,
        out.stride(0), states.stride(0), dk**-0.5, KEY_DIM=shape.num_key_heads * dk,
        GROUP=heads // shape.num_key_heads, DK=dk, DV=dv, BV=bv, HAS_ROWS=rows is not None,
    )  # fmt: skip
    return out


@dataclass(frozen=True)
class DecodeLaunch:
    """Launch parameters of the fused decode kernel (`benchmarks/qwen35_delta_rule.py` times
    them): the value columns of one program's state block (a power of two dividing dv; a
    block wider than dv is dv) and its warps.

    A block of the whole dv (one program per value head) normalises its own outputs and only
    waits on its key head's other value heads to move the q/k windows; a smaller block spreads
    the state over more programs (at batch 1, 32 value heads in blocks of 32 are 128 programs
    for the H200's 132 SMs) and the last program of a key head normalises its heads' outputs.
    """

    block: int = 32
    num_warps: int = 4


@triton.jit
def _conv_token(row, w_ptr, window, cols):
    """The conv of one token over channels `cols`, from the three inputs before it (the
    window, float32 [C, 3]), as `_causal_conv1d_kernel` computes it: SiLU(conv) in the input's
    dtype; and the window after the token (its second and third inputs, the token)."""
    x = tl.load(row + cols)
    w0 = tl.load(window + cols * 3)
    w1 = tl.load(window + cols * 3 + 1)
    w2 = tl.load(window + cols * 3 + 2)
    xf = x.to(tl.float32)
    acc = tl.load(w_ptr + cols * 4).to(tl.float32) * w0
    acc += tl.load(w_ptr + cols * 4 + 1).to(tl.float32) * w1
    acc += tl.load(w_ptr + cols * 4 + 2).to(tl.float32) * w2
    acc += tl.load(w_ptr + cols * 4 + 3).to(tl.float32) * xf
    y = acc.to(x.dtype).to(tl.float32)  # as transformers: rounded, then SiLU
    return (y * tl.sigmoid(y)).to(x.dtype), w1, w2, xf


@triton.jit
def _store_window(window, cols, w0, w1, w2, mask):
    tl.store(window + cols * 3, w0, mask=mask)
    tl.store(window + cols * 3 + 1, w1, mask=mask)
    tl.store(window + cols * 3 + 2, w2, mask=mask)


@triton.jit
def _gated_norm(x, z, w, eps, D: tl.constexpr):
    """`w * norm(x) * silu(z)` of rows x [R, D] (the input dtype; z float32, w [D]), with
    transformers' casts: the norm rounded to x's dtype, times the weight in that dtype, then
    times SiLU(z) in float32."""
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]).to(x.dtype)
    scaled = (w[None, :] * normed).to(x.dtype).to(tl.float32)
    return (scaled * z * tl.sigmoid(z)).to(x.dtype)


@triton.jit(do_not_specialize_on_alignment=["slots_ptr"])
def _decode_kernel(
    proj_ptr,
    conv_w_ptr,
    conv_state_ptr,
    a_log_ptr,
    dt_bias_ptr,
    norm_w_ptr,
    state_ptr,
    out_ptr,
    slots_ptr,
    arrivals_ptr,
    stride_proj,
    z_col,
    a_col,
    b_col,
    stride_conv_slot,
    stride_state_slot,
    stride_out,
    scale,
    eps,
    NUM_KEY_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    GROUP_P2: tl.constexpr,
):
    """A block of BV value columns of one value head of sequence (row) i: the conv of the
    head's q and k channels and of the block's v channels, the delta-rule step on the block's
    [dk, BV] state (as `_recurrent_kernel`), and the gated norm, which needs a head's whole dv.

    All GROUP * dv/BV programs of a key head convolve its q and k channels, so their windows
    may only move once every one of them has read them: each program counts itself in
    `arrivals` (per sequence and key head) and the last to arrive moves them and resets the
    count for the next launch. A program holding a whole head (BV == dv) counts itself as soon
    as it has read the windows, while its state is still loading, and normalises its own
    outputs. Smaller blocks store their outputs unnormalised and count themselves after
    that, and the last to arrive also normalises the key head's GROUP value heads in place, as
    the rows of one tile (of GROUP_P2, GROUP's next power of two, rows). No program waits on
    another; a block's v channels and state are its own.

    Every overwrite of what the program has read comes after a barrier: a vector with fewer
    elements than the program has threads is held by several of them and stored by one, which
    must not overwrite what another has yet to read (`tests/qwen35/test_kernels_compiled.py`)."""
    seq = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // GROUP
    t = seq.to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    ks = tl.arange(0, DK)
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    state = state_ptr + slot * stride_state_slot + hv * DK * DV + ks[:, None] * DV + vs[None, :]
    s = tl.load(state)  # [DK, BV] float32
    row = proj_ptr + t * stride_proj
    window = conv_state_ptr + slot * stride_conv_slot
    key_dim: tl.constexpr = NUM_KEY_HEADS * DK
    sharers: tl.constexpr = GROUP * (DV // BV)  # the programs that read a key head's windows
    q_cols = hk * DK + ks
    k_cols = key_dim + hk * DK + ks
    v_cols = 2 * key_dim + hv * DV + vs
    q, q0, q1, q2 = _conv_token(row, conv_w_ptr, window, q_cols)
    k, k0, k1, k2 = _conv_token(row, conv_w_ptr, window, k_cols)
    v, v0, v1, v2 = _conv_token(row, conv_w_ptr, window, v_cols)
    # The norm's gates and weight, loaded with the rest and not after the last arrival: the
    # block's head, or (with smaller blocks) the key head's GROUP value heads as rows.
    ds = tl.arange(0, DV)
    w = tl.load(norm_w_ptr + ds)
    if BV == DV:
        z = tl.load(row + z_col + hv * DV + ds).to(tl.float32)
    else:
        rs = tl.arange(0, GROUP_P2)
        heads = (hk * GROUP + rs)[:, None] * DV + ds[None, :]
        in_group = (rs < GROUP)[:, None]
        z = tl.load(row + z_col + heads, mask=in_group, other=0.0).to(tl.float32)
    arrival = arrivals_ptr + seq * NUM_KEY_HEADS + hk
    arrived = 0
    if BV == DV:
        tl.debug_barrier()  # every thread of the program has read the windows
        if sharers > 1:
            arrived = tl.atomic_add(arrival, 1, sem="acq_rel")
    # The delta rule, as `ops.recurrent_gated_delta_rule` (q and k L2-normalised in float32).
    qf = q.to(tl.float32)
    kf = k.to(tl.float32)
    qf = qf * tl.rsqrt(tl.sum(qf * qf, axis=0) + 1e-6) * scale
    kf = kf * tl.rsqrt(tl.sum(kf * kf, axis=0) + 1e-6)
    g, beta = _gates(row, a_col, b_col, hv, a_log_ptr, dt_bias_ptr, True)
    s = s * tl.exp(g)
    read = tl.sum(s * kf[:, None], axis=0)
    s = s + kf[:, None] * (beta * (v.to(tl.float32) - read))[None, :]
    tl.store(state, s)
    out_row = out_ptr + t * stride_out
    o = tl.sum(s * qf[:, None], axis=0).to(q.dtype)
    if BV == DV:
        tl.store(out_row + hv * DV + ds[None, :], _gated_norm(o[None, :], z[None, :], w, eps, DV))
        _store_window(window, v_cols, v0, v1, v2, vs < DV)
    else:
        tl.store(out_row + hv * DV + vs, o)
        tl.debug_barrier()  # every thread has read the windows and stored its outputs
        _store_window(window, v_cols, v0, v1, v2, vs < DV)
        arrived = tl.atomic_add(arrival, 1, sem="acq_rel")
        last = in_group & ((arrived + tl.zeros_like(rs)) == sharers - 1)[:, None]  # all or none
        # Written by other programs: read past this SM's L1, after the acquiring arrival.
        x = tl.load(out_row + heads, mask=last, other=0.0, cache_modifier=".cg")
        normed = _gated_norm(x, z, w, eps, DV)
        tl.debug_barrier()  # every thread has read the outputs it normalises in place
        tl.store(out_row + heads, normed, mask=last)
    last_k = (arrived + tl.zeros_like(ks)) == sharers - 1  # all or none
    if sharers > 1:
        tl.store(arrival + ks, 0, mask=last_k & (ks == 0))
    _store_window(window, q_cols, q0, q1, q2, last_k)
    _store_window(window, k_cols, k0, k1, k2, last_k)


def decode_gated_delta_net(
    proj: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_states: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    states: torch.Tensor,
    slots: torch.Tensor,
    arrivals: torch.Tensor,
    shape: DeltaNetShape,
    launch: DecodeLaunch = DecodeLaunch(),
) -> torch.Tensor:
    """A decode step's DeltaNet work between the layer's two projections, in one launch: the
    conv, the delta rule and the gated norm of `causal_conv1d`, `recurrent_gated_delta_rule`
    and `gated_rms_norm` (references: `ops.causal_conv1d`, `ops.recurrent_gated_delta_rule`,
    `ops.gated_rms_norm`).

    Sequence i is row i of proj [T, C + Hv·dv + 2·Hv], the layer's input projection
    `[qkv | z | b | a]`, and keeps its conv window in conv_states[slots[i]] [C, 3] and its
    state in states[slots[i]] [Hv, dk, dv] (both float32, updated in place: each read once
    and written once). Returns the normalised outputs [T, Hv, dv]. `arrivals` [>= T, Hk] int32
    must be zero (each launch leaves it so).
    """
    heads, dk, dv = shape.num_value_heads, shape.key_dim, shape.value_dim
    channels, tokens = shape.conv_channels, proj.shape[0]
    assert states.shape[1:] == (heads, dk, dv) and states.dtype == torch.float32
    assert states.stride()[1:] == (dk * dv, dv, 1)
    assert conv_states.shape[1:] == (channels, 3) and conv_states.dtype == torch.float32
    assert conv_states.stride()[1:] == (3, 1)
    assert conv_weight.shape[0] == channels and conv_weight.shape[-1] == 4
    assert proj.stride(1) == 1 and proj.shape[1] == channels + heads * dv + 2 * heads
    assert slots.shape[0] == tokens and norm_weight.dtype == proj.dtype
    assert arrivals.dtype == torch.int32 and arrivals.shape[1] == shape.num_key_heads
    assert tokens <= arrivals.shape[0] and arrivals.stride() == (shape.num_key_heads, 1)
    block = min(dv, launch.block)
    if block & (block - 1) or dv % block:
        raise ValueError(f"the decode block must be a power of two dividing dv={dv}, not {block}")
    out = torch.empty(tokens, heads, dv, dtype=proj.dtype, device=proj.device)
    _decode_kernel[(tokens, heads, dv // block)](
        proj, conv_weight.reshape(channels, 4), conv_states, a_log, dt_bias, norm_weight,
        states, out, slots, arrivals, proj.stride(0), channels, proj.shape[1] - heads,
        proj.shape[1] - 2 * heads, conv_states.stride(0), states.stride(0), out.stride(0),
        dk**-0.5, eps, NUM_KEY_HEADS=shape.num_key_heads, GROUP=heads // shape.num_key_heads,
        DK=dk, DV=dv, BV=block, GROUP_P2=triton.next_power_of_2(heads // shape.num_key_heads),
        num_warps=launch.num_warps,
    )  # fmt: skip
    return out


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
    # c never rises along a sequence (g <= 0): the cap only keeps rows past a chunk's end,
    # whose c is not the sequence's, from overflowing.
    gap = tl.minimum(tl.where(keep, c_rows[:, None] - c_cols[None, :], 0.0), 0.0)
    return tl.where(keep, x * tl.exp(gap), 0.0)


@triton.jit
def _split(x):
    """x (float32) as hi + mid + lo, three bf16 tiles of 8 significant bits each: together
    float32's 24 (each residual is exact in float32)."""
    hi = x.to(tl.bfloat16)
    rest = x - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    return hi, mid, (rest - mid.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _mm(a, b, SPLIT_A: tl.constexpr, SPLIT_B: tl.constexpr):
    """a @ b on bf16 tensor cores, accumulated in float32, to float32 accuracy.

    An operand whose values bf16 holds exactly (the raw q, k and v of a bf16 model, SPLIT
    False) goes in as one bf16 tile: its products are exact and only the float32
    accumulation rounds. A float32 operand (SPLIT True) goes in as its three bf16 pieces
    (`_split`); the product keeps every term down to 2^-16 of the whole (hi.hi, the two
    hi.mid, hi.lo and mid.mid when both are split), smallest first. Two pieces (16 bits) were
    not enough: on the tiny checkpoint's bf16 forward test the logprobs drifted measurably
    further from transformers than with exact float32 products."""
    if SPLIT_A:
        a_hi, a_mid, a_lo = _split(a.to(tl.float32))
    else:
        a_hi = a.to(tl.bfloat16)
    if SPLIT_B:
        b_hi, b_mid, b_lo = _split(b.to(tl.float32))
    else:
        b_hi = b.to(tl.bfloat16)
    if SPLIT_A and SPLIT_B:
        acc = tl.dot(a_mid, b_mid)
        acc = tl.dot(a_lo, b_hi, acc)
        acc = tl.dot(a_hi, b_lo, acc)
        acc = tl.dot(a_mid, b_hi, acc)
        acc = tl.dot(a_hi, b_mid, acc)
    elif SPLIT_A:
        acc = tl.dot(a_lo, b_hi)
        acc = tl.dot(a_mid, b_hi, acc)
    elif SPLIT_B:
        acc = tl.dot(a_hi, b_lo)
        acc = tl.dot(a_hi, b_mid, acc)
    else:
        acc = tl.zeros((a.shape[0], b.shape[1]), dtype=tl.float32)
    return tl.dot(a_hi, b_hi, acc)


@triton.jit
def _fdot(a, b):
    """A float32 product of two small tiles of the chunk's triangular inverse, in plain FMAs:
    the inverse is where the chunked form is least well conditioned."""
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _key_block(
    qkv_ptr, ab_ptr, a_log_ptr, dt_bias_ptr, start, end, offset, hk, hv, stride_qkv, stride_ab,
    a_col, b_col, KEY_DIM: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """Rows offset..offset+BC of a chunk: raw k and v (the input dtype), k's inverse norm,
    the gates."""
    rows = start + offset + tl.arange(0, BC)
    mask = rows < end
    ks, vs = tl.arange(0, DK), tl.arange(0, DV)
    k = tl.load(qkv_ptr + rows[:, None] * stride_qkv + KEY_DIM + hk * DK + ks[None, :],
                mask=mask[:, None], other=0.0)  # fmt: skip
    v = tl.load(qkv_ptr + rows[:, None] * stride_qkv + 2 * KEY_DIM + hv * DV + vs[None, :],
                mask=mask[:, None], other=0.0)  # fmt: skip
    kf = k.to(tl.float32)
    rk = tl.rsqrt(tl.sum(kf * kf, axis=1) + 1e-6)
    g, beta = _gates(ab_ptr + rows * stride_ab, a_col, b_col, hv, a_log_ptr, dt_bias_ptr, mask)
    return rows, mask, k, v, rk, g, beta


@triton.jit
def _system_block(ki, kj, scale_i, scale_j, ci, cj, DIAG: tl.constexpr, SPLIT: tl.constexpr,
                  BC: tl.constexpr):  # fmt: skip
    """Block (i, j) of the chunk's system A[t, s] = beta_t exp(c_t - c_s) k_t.k_s (k
    normalised: the norms come in as the row and column scales)."""
    kk = _mm(ki, tl.trans(kj), SPLIT, SPLIT) * scale_i[:, None] * scale_j[None, :]
    return _decayed(kk, ci, cj, DIAG, BC)


@triton.jit(do_not_specialize_on_alignment=["chunk_start_ptr", "chunk_end_ptr"])
def _chunk_intra_kernel(
    qkv_ptr,
    ab_ptr,
    a_log_ptr,
    dt_bias_ptr,
    chunk_start_ptr,
    chunk_end_ptr,
    w_ptr,
    u_ptr,
    c_ptr,
    stride_qkv,
    stride_ab,
    a_col,
    b_col,
    HV: tl.constexpr,
    KEY_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BC: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Per (chunk, value head), the chunk as four blocks of BC=16 rows: the cumulative
    log-decay c, the system A (strictly lower), T = (I + A)^-1 by blocks in float32 (each
    diagonal block by substitution, those below from them), and the WY factors
    W = T diag(beta exp(c)) K and U = T diag(beta) V that the state kernel consumes."""
    chunk = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // GROUP
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    end = tl.load(chunk_end_ptr + chunk).to(tl.int64)
    r0, m0, k0, v0, n0, g0, b0 = _key_block(
        qkv_ptr, ab_ptr, a_log_ptr, dt_bias_ptr, start, end, 0, hk, hv, stride_qkv, stride_ab,
        a_col, b_col, KEY_DIM, DK, DV, BC,
    )  # fmt: skip
    r1, m1, k1, v1, n1, g1, b1 = _key_block(
        qkv_ptr, ab_ptr, a_log_ptr, dt_bias_ptr, start, end, BC, hk, hv, stride_qkv,
        stride_ab, a_col, b_col, KEY_DIM, DK, DV, BC,
    )  # fmt: skip
    r2, m2, k2, v2, n2, g2, b2 = _key_block(
        qkv_ptr, ab_ptr, a_log_ptr, dt_bias_ptr, start, end, 2 * BC, hk, hv, stride_qkv,
        stride_ab, a_col, b_col, KEY_DIM, DK, DV, BC,
    )  # fmt: skip
    r3, m3, k3, v3, n3, g3, b3 = _key_block(
        qkv_ptr, ab_ptr, a_log_ptr, dt_bias_ptr, start, end, 3 * BC, hk, hv, stride_qkv,
        stride_ab, a_col, b_col, KEY_DIM, DK, DV, BC,
    )  # fmt: skip
    c0 = tl.cumsum(g0, axis=0)
    c1 = tl.cumsum(g1, axis=0) + tl.sum(g0, axis=0)
    c2 = tl.cumsum(g2, axis=0) + tl.sum(g0, axis=0) + tl.sum(g1, axis=0)
    c3 = tl.cumsum(g3, axis=0) + tl.sum(g0, axis=0) + tl.sum(g1, axis=0) + tl.sum(g2, axis=0)
    tl.store(c_ptr + r0 * HV + hv, c0, mask=m0)
    tl.store(c_ptr + r1 * HV + hv, c1, mask=m1)
    tl.store(c_ptr + r2 * HV + hv, c2, mask=m2)
    tl.store(c_ptr + r3 * HV + hv, c3, mask=m3)
    # The system by blocks: row scale beta_t / |k_t|, column scale 1 / |k_s|.
    s0, s1, s2, s3 = b0 * n0, b1 * n1, b2 * n2, b3 * n3
    t00 = _inverse_unit_lower(_system_block(k0, k0, s0, n0, c0, c0, 1, SPLIT, BC), BC)
    t11 = _inverse_unit_lower(_system_block(k1, k1, s1, n1, c1, c1, 1, SPLIT, BC), BC)
    t22 = _inverse_unit_lower(_system_block(k2, k2, s2, n2, c2, c2, 1, SPLIT, BC), BC)
    t33 = _inverse_unit_lower(_system_block(k3, k3, s3, n3, c3, c3, 1, SPLIT, BC), BC)
    a10 = _system_block(k1, k0, s1, n0, c1, c0, 0, SPLIT, BC)
    a20 = _system_block(k2, k0, s2, n0, c2, c0, 0, SPLIT, BC)
    a21 = _system_block(k2, k1, s2, n1, c2, c1, 0, SPLIT, BC)
    a30 = _system_block(k3, k0, s3, n0, c3, c0, 0, SPLIT, BC)
    a31 = _system_block(k3, k1, s3, n1, c3, c1, 0, SPLIT, BC)
    a32 = _system_block(k3, k2, s3, n2, c3, c2, 0, SPLIT, BC)
    t10 = -_fdot(t11, _fdot(a10, t00))
    t21 = -_fdot(t22, _fdot(a21, t11))
    t20 = -_fdot(t22, _fdot(a20, t00) + _fdot(a21, t10))
    t32 = -_fdot(t33, _fdot(a32, t22))
    t31 = -_fdot(t33, _fdot(a31, t11) + _fdot(a32, t21))
    t30 = -_fdot(t33, _fdot(a30, t00) + _fdot(a31, t10) + _fdot(a32, t20))
    # W = T diag(beta exp(c) / |k|) K and U = T diag(beta) V: the column scales go into T's
    # columns, so K and V enter the products raw.
    w0, w1 = b0 * tl.exp(c0) * n0, b1 * tl.exp(c1) * n1
    w2, w3 = b2 * tl.exp(c2) * n2, b3 * tl.exp(c3) * n3
    ks, vs = tl.arange(0, DK), tl.arange(0, DV)
    w_at = w_ptr + hv * DK + ks[None, :]
    u_at = u_ptr + hv * DV + vs[None, :]
    tl.store(w_at + (r0 * HV * DK)[:, None], _mm(t00 * w0[None, :], k0, True, SPLIT),
             mask=m0[:, None])  # fmt: skip
    tl.store(u_at + (r0 * HV * DV)[:, None], _mm(t00 * b0[None, :], v0, True, SPLIT),
             mask=m0[:, None])  # fmt: skip
    w = _mm(t10 * w0[None, :], k0, True, SPLIT) + _mm(t11 * w1[None, :], k1, True, SPLIT)
    tl.store(w_at + (r1 * HV * DK)[:, None], w, mask=m1[:, None])
    u = _mm(t10 * b0[None, :], v0, True, SPLIT) + _mm(t11 * b1[None, :], v1, True, SPLIT)
    tl.store(u_at + (r1 * HV * DV)[:, None], u, mask=m1[:, None])
    w = _mm(t20 * w0[None, :], k0, True, SPLIT) + _mm(t21 * w1[None, :], k1, True, SPLIT)
    w += _mm(t22 * w2[None, :], k2, True, SPLIT)
    tl.store(w_at + (r2 * HV * DK)[:, None], w, mask=m2[:, None])
    u = _mm(t20 * b0[None, :], v0, True, SPLIT) + _mm(t21 * b1[None, :], v1, True, SPLIT)
    u += _mm(t22 * b2[None, :], v2, True, SPLIT)
    tl.store(u_at + (r2 * HV * DV)[:, None], u, mask=m2[:, None])
    w = _mm(t30 * w0[None, :], k0, True, SPLIT) + _mm(t31 * w1[None, :], k1, True, SPLIT)
    w += _mm(t32 * w2[None, :], k2, True, SPLIT) + _mm(t33 * w3[None, :], k3, True, SPLIT)
    tl.store(w_at + (r3 * HV * DK)[:, None], w, mask=m3[:, None])
    u = _mm(t30 * b0[None, :], v0, True, SPLIT) + _mm(t31 * b1[None, :], v1, True, SPLIT)
    u += _mm(t32 * b2[None, :], v2, True, SPLIT) + _mm(t33 * b3[None, :], v3, True, SPLIT)
    tl.store(u_at + (r3 * HV * DV)[:, None], u, mask=m3[:, None])


@triton.jit
def _chunk_keys(qkv_ptr, rows, rmask, stride_qkv, col, DK: tl.constexpr):
    """Raw rows of one key (or query) head, and their inverse norms."""
    ks = tl.arange(0, DK)
    x = tl.load(qkv_ptr + rows[:, None] * stride_qkv + col + ks[None, :], mask=rmask[:, None],
                other=0.0)  # fmt: skip
    xf = x.to(tl.float32)
    return x, tl.rsqrt(tl.sum(xf * xf, axis=1) + 1e-6)


@triton.jit(
    do_not_specialize_on_alignment=[
        "slots_ptr",
        "seq_chunks_ptr",
        "chunk_start_ptr",
        "chunk_end_ptr",
        "chunk_snapshot_ptr",
    ]
)
def _chunk_state_kernel(
    qkv_ptr,
    w_ptr,
    u_ptr,
    c_ptr,
    h_ptr,
    v_new_ptr,
    state_ptr,
    slots_ptr,
    seq_chunks_ptr,
    chunk_start_ptr,
    chunk_end_ptr,
    chunk_snapshot_ptr,
    stride_qkv,
    stride_state_slot,
    HV: tl.constexpr,
    KEY_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Per (sequence, value head, value block), the only sequential part: the state across
    the sequence's chunks. For each chunk it keeps the incoming state S (h, for the output
    kernel) and the updates given it, v_new = U - W S; the chunk leaves
    S' = exp(c_last) S + (K exp(c_last - c))^T v_new."""
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
        h_at = (chunk * HV + hv).to(tl.int64) * DK * DV + ks[:, None] * DV + vs[None, :]
        tl.store(h_ptr + h_at, s)
        k, nk = _chunk_keys(qkv_ptr, rows, rmask, stride_qkv, KEY_DIM + hk * DK, DK)
        c = tl.load(c_ptr + rows * HV + hv, mask=rmask, other=0.0)
        c_last = tl.sum(tl.where(rows == end - 1, c, 0.0), axis=0)
        w_rows = (rows * HV + hv)[:, None]
        w = tl.load(w_ptr + w_rows * DK + ks[None, :], mask=rmask[:, None], other=0.0)
        u = tl.load(u_ptr + w_rows * DV + vs[None, :], mask=rmask[:, None], other=0.0)
        v_new = u - _mm(w, s, True, True)
        tl.store(v_new_ptr + w_rows * DV + vs[None, :], v_new, mask=rmask[:, None])
        tail = v_new * tl.where(rmask, nk * tl.exp(c_last - c), 0.0)[:, None]
        s = tl.exp(c_last) * s + _mm(tl.trans(k), tail, SPLIT, True)
        snapshot = tl.load(chunk_snapshot_ptr + chunk)
        if snapshot >= 0:  # a checkpoint after this chunk
            tl.store(state_ptr + snapshot.to(tl.int64) * stride_state_slot + offsets, s)
    tl.store(state_ptr + slot * stride_state_slot + offsets, s)


@triton.jit(do_not_specialize_on_alignment=["chunk_start_ptr", "chunk_end_ptr"])
def _chunk_output_kernel(
    qkv_ptr,
    c_ptr,
    h_ptr,
    v_new_ptr,
    out_ptr,
    chunk_start_ptr,
    chunk_end_ptr,
    stride_qkv,
    stride_out,
    scale,
    HV: tl.constexpr,
    KEY_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Per (chunk, value head, value block), independently: the chunk's outputs
    o = exp(c) (q S) + (causal exp(c_t - c_s) q_t.k_s) v_new, S the state it starts from."""
    chunk = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // GROUP
    ks = tl.arange(0, DK)
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    ts = tl.arange(0, BT)
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    end = tl.load(chunk_end_ptr + chunk).to(tl.int64)
    rows = start + ts
    rmask = rows < end
    q, nq = _chunk_keys(qkv_ptr, rows, rmask, stride_qkv, hk * DK, DK)
    k, nk = _chunk_keys(qkv_ptr, rows, rmask, stride_qkv, KEY_DIM + hk * DK, DK)
    c = tl.load(c_ptr + rows * HV + hv, mask=rmask, other=0.0)
    s = tl.load(h_ptr + (chunk * HV + hv).to(tl.int64) * DK * DV + ks[:, None] * DV + vs[None, :])
    v_new = tl.load(v_new_ptr + (rows * HV + hv)[:, None] * DV + vs[None, :],
                    mask=rmask[:, None], other=0.0)  # fmt: skip
    nq = nq * scale
    qk = _mm(q, tl.trans(k), SPLIT, SPLIT) * nq[:, None] * nk[None, :]
    o = (nq * tl.exp(c))[:, None] * _mm(q, s, SPLIT, True)
    o += _mm(_decayed(qk, c, c, 2, BT), v_new, True, True)
    tl.store(out_ptr + rows[:, None] * stride_out + hv * DV + vs[None, :],
             o.to(out_ptr.dtype.element_ty), mask=rmask[:, None])  # fmt: skip


@dataclass(frozen=True)
class ChunkPlan:
    """The sequences of a step that run the chunked rule, cut into chunks of at most CHUNK
    tokens (int32, on the device).

    Sequence i of the plan keeps its state in slots[i] and owns chunks
    seq_chunks[i]:seq_chunks[i+1]; chunk n covers token rows start[n]:end[n], and snapshot[n]
    is the slot that takes the state after chunk n, or -1.
    """

    slots: torch.Tensor
    seq_chunks: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    snapshot: torch.Tensor

    @property
    def num_chunks(self) -> int:
        return self.start.shape[0]

    @staticmethod
    def host_lists(
        pieces: list[tuple[int, int, tuple[int, int] | None]],
    ) -> tuple[list[int], list[int], list[int], list[int]]:
        """seq_chunks, start, end and snapshot for sequences of rows lo:hi, each with its
        checkpoint (offset into its rows, slot) or None: chunks break every CHUNK tokens and at
        each checkpoint."""
        seq_chunks, starts, ends, snaps = [0], [], [], []
        for lo, hi, snap in pieces:
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


@dataclass(frozen=True)
class ChunkLaunch:
    """Launch parameters of the chunk kernels: the value columns per program of the state and
    output kernels, and the warps of each kernel (`benchmarks/qwen35_delta_rule.py` sweeps
    them)."""

    state_block: int = 32
    output_block: int = 64
    intra_warps: int = 4
    state_warps: int = 4
    output_warps: int = 4


def chunked_gated_delta_rule(
    qkv: torch.Tensor,
    proj: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    plan: ChunkPlan,
    shape: DeltaNetShape,
    out: torch.Tensor,
    launch: ChunkLaunch = ChunkLaunch(),
) -> None:
    """The delta rule over the plan's sequences, chunk by chunk, from and into their state
    slots; writes their rows of out [T, Hv, dv] (other rows are left alone).

    qkv [T, C] and proj as `recurrent_gated_delta_rule`. Three launches, as
    flash-linear-attention splits the work: the WY factors of every chunk (independent),
    the state across each sequence's chunks (sequential), the outputs of every chunk
    (independent). The products run on bf16 tensor cores in float32 accumulation (`_mm`):
    a bf16 model's q, k and v enter them exactly, float32 operands as three bf16 pieces; the
    state and every intermediate stay float32.
    """
    heads, dk, dv = shape.num_value_heads, shape.key_dim, shape.value_dim
    assert states.shape[1:] == (heads, dk, dv) and qkv.stride(1) == 1 and proj.stride(1) == 1
    assert out.shape == (qkv.shape[0], heads, dv) and out.is_contiguous()
    tokens, device, chunks = qkv.shape[0], qkv.device, plan.num_chunks
    w = torch.empty(tokens, heads, dk, dtype=torch.float32, device=device)
    u = torch.empty(tokens, heads, dv, dtype=torch.float32, device=device)
    v_new = torch.empty(tokens, heads, dv, dtype=torch.float32, device=device)
    c = torch.empty(tokens, heads, dtype=torch.float32, device=device)
    h = torch.empty(chunks, heads, dk, dv, dtype=torch.float32, device=device)
    key_dim, group = shape.num_key_heads * dk, heads // shape.num_key_heads
    a_col, b_col = proj.shape[1] - heads, proj.shape[1] - 2 * heads
    split = qkv.dtype != torch.bfloat16  # only bf16 inputs are exact as bf16 operands
    _chunk_intra_kernel[(chunks, heads)](
        qkv, proj, a_log, dt_bias, plan.start, plan.end, w, u, c, qkv.stride(0),
        proj.stride(0), a_col, b_col, HV=heads, KEY_DIM=key_dim, GROUP=group, DK=dk, DV=dv,
        BC=CHUNK // 4, SPLIT=split, num_warps=launch.intra_warps,
    )  # fmt: skip
    bv = min(dv, launch.state_block)
    _chunk_state_kernel[(plan.slots.shape[0], heads, dv // bv)](
        qkv, w, u, c, h, v_new, states, plan.slots, plan.seq_chunks, plan.start, plan.end,
        plan.snapshot, qkv.stride(0), states.stride(0), HV=heads, KEY_DIM=key_dim,
        GROUP=group, DK=dk, DV=dv, BV=bv, BT=CHUNK, SPLIT=split, num_warps=launch.state_warps,
    )  # fmt: skip
    bv = min(dv, launch.output_block)
    _chunk_output_kernel[(chunks, heads, dv // bv)](
        qkv, c, h, v_new, out, plan.start, plan.end, qkv.stride(0), out.stride(0), dk**-0.5,
        HV=heads, KEY_DIM=key_dim, GROUP=group, DK=dk, DV=dv, BV=bv, BT=CHUNK, SPLIT=split,
        num_warps=launch.output_warps,
    )  # fmt: skip


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
    out = _gated_norm(x, z, tl.load(w_ptr + cols), eps, D)
    tl.store(out_ptr + r[:, None] * D + cols[None, :], out, mask=m)


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
