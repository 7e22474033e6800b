"""The fused MoE on the GPU (reference: `ops.moe`): sorted token-to-expert dispatch and two
grouped GEMMs in Triton.

1. Dispatch: the (token, choice) pairs routed to this rank's experts are sorted by expert and
   each expert's run is padded to a multiple of BLOCK_M, so every BLOCK_M rows of the sorted
   list belong to one expert (`block_expert`); rows past an expert's pairs hold a sentinel.
   Sizes depend only on the number of pairs and experts, never on the routing, so the same
   launch shapes serve every step of a batch size.
2. Gate/up: per (row block, column block of I), the rows' tokens times the expert's gate and up
   columns, SiLU(gate) * up in float32, written to the pair's row of `hidden` [pairs, I].
3. Down: per (row block, column block of H), `hidden` times the expert's down matrix, scaled by
   the pair's routing weight, written to the pair's row of `out` [pairs, H] (float32); the
   token's output is the sum over its k pairs.

Pairs routed to experts other ranks hold are never touched: their rows stay zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _row_block(sorted_pairs, block_expert, num_pairs, BLOCK_M: tl.constexpr):
    """This program's block of sorted rows: its expert (-1: past the last run), its pairs and
    which of them are real (the rest hold the sentinel)."""
    block = tl.program_id(0)
    pairs = tl.load(sorted_pairs + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return tl.load(block_expert + block).to(tl.int64), pairs, pairs < num_pairs


@triton.jit
def _gate_up_kernel(
    x, w, hidden, sorted_pairs, block_expert,
    num_pairs, top_k, hidden_size, inter,
    stride_x, stride_we, stride_wn, stride_h,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    expert, pairs, valid = _row_block(sorted_pairs, block_expert, num_pairs, BLOCK_M)
    if expert < 0:
        return
    tokens = (pairs // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w_gate = w + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn
    w_up = w_gate + inter * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden_size
        a = tl.load(x + tokens[:, None] * stride_x + ks[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        b_mask = k_ok[:, None] & col_ok[None, :]
        gate += _dot(a, tl.load(w_gate + ks[:, None], mask=b_mask, other=0.0), IEEE)
        up += _dot(a, tl.load(w_up + ks[:, None], mask=b_mask, other=0.0), IEEE)
    out = gate * tl.sigmoid(gate) * up
    tl.store(hidden + pairs[:, None].to(tl.int64) * stride_h + cols[None, :],
             out.to(hidden.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])  # fmt: skip


@triton.jit
def _down_kernel(
    hidden, w, out, sorted_pairs, block_expert, weights,
    num_pairs, hidden_size, inter,
    stride_h, stride_we, stride_wn, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    expert, pairs, valid = _row_block(sorted_pairs, block_expert, num_pairs, BLOCK_M)
    if expert < 0:
        return
    rows = pairs.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden_size
    w_cols = w + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(hidden + rows[:, None] * stride_h + ks[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        b = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += _dot(a, b, IEEE)
    scale = tl.load(weights + rows, mask=valid, other=0.0)
    tl.store(out + rows[:, None] * stride_out + cols[None, :], acc * scale[:, None],
             mask=valid[:, None] & col_ok[None, :])  # fmt: skip


def dispatch(
    experts: torch.Tensor, first: int, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, choice) pairs, flattened token-major, sorted by local expert with each expert's
    run padded to `block_m` rows: `sorted_pairs` [blocks * block_m] (the sentinel `pairs` past
    a run's end) and `block_expert` [blocks] (-1 for blocks past the last run). Pairs routed
    outside `first`.. `first + num_experts - 1` are left out. Shapes depend on the number of
    pairs only and nothing reads device values on the host, so a CUDA graph can capture it."""
    pairs, device = experts.numel(), experts.device
    local = experts.flatten() - first
    local = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts = counts.scatter_add_(0, local, torch.ones_like(local))[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(local, stable=True)
    expert_of = local[order]
    # Position of each sorted pair within its expert's run, then in the padded list; the
    # pairs left out all go to one extra slot past the end, dropped below.
    owner = expert_of.clamp(max=num_experts - 1)
    slot = torch.arange(pairs, device=device) - (counts.cumsum(0) - counts)[owner]
    blocks = triton.cdiv(pairs, block_m) + min(num_experts, pairs)
    dest = torch.where(expert_of < num_experts, (padded_end - padded)[owner] + slot,
                       blocks * block_m)  # fmt: skip
    sorted_pairs = torch.full((blocks * block_m + 1,), pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs[:-1], block_expert


def fused_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    first: int = 0,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]) over the experts held here:
    `gate_up` [E, 2I, H] and `down` [E, H, I] are experts `first`.. `first + E - 1`'s."""
    tokens, top_k = experts.shape
    num_experts, hidden_size, inter = down.shape
    x = x.contiguous()
    if gate_up.stride(-1) != 1 or down.stride(-1) != 1:
        raise ValueError("expert weights must be row-major in their last dimension")
    pairs = tokens * top_k
    # Few rows per expert (decode) want short row blocks; prefill fills long ones.
    block_m = 16 if pairs <= 4 * num_experts else 64
    sorted_pairs, block_expert = dispatch(experts, first, num_experts, block_m)
    ieee = x.dtype == torch.float32
    hidden = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    block_n, block_k = 64, 64
    grid = (block_expert.numel(), triton.cdiv(inter, block_n))
    _gate_up_kernel[grid](
        x, gate_up, hidden, sorted_pairs, block_expert, pairs, top_k, hidden_size, inter,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), hidden.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee,
    )  # fmt: skip
    out = torch.zeros(pairs, hidden_size, dtype=torch.float32, device=x.device)
    grid = (block_expert.numel(), triton.cdiv(hidden_size, block_n))
    _down_kernel[grid](
        hidden, down, out, sorted_pairs, block_expert, weights.float().flatten(), pairs,
        hidden_size, inter, hidden.stride(0), down.stride(0), down.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee,
    )  # fmt: skip
    return out.view(tokens, top_k, hidden_size).sum(dim=1).to(x.dtype)
