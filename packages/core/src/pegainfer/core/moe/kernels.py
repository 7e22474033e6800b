"""The fused MoE on the GPU (references: `moe.routing.route`, `moe.experts.moe`): routing,
sorted token-to-expert dispatch, two grouped GEMMs and the combine, in Triton.

0. Routing: per block of tokens, the router logits (bf16 products are exact in float32,
   accumulated in float32 as the reference's float32 linear), then softmax scores (greedy) or
   sigmoid scores plus the correction bias to choose by (noaux_tc), the experts outside the
   best groups masked (group-limited or grouped noaux_tc), the k best by iterated argmax,
   their scores (renormalised for noaux_tc's `norm_topk_prob`) times the scaling factor.
1. Dispatch: the (token, choice) pairs routed to this rank's experts are sorted by expert and
   each expert's run is padded to a multiple of BLOCK_M, so every BLOCK_M rows of the sorted
   list belong to one expert (`block_expert`); rows past an expert's pairs hold a sentinel.
   Sizes depend only on the number of pairs and experts, never on the routing, so the same
   launch shapes serve every step of a batch size. Up to `_ONE_PROGRAM_PAIRS` pairs (decode
   and short prefills) one program does it (a sort of (expert, pair) keys, a histogram);
   more go through torch's sort.
2. Gate/up: per (row block, column block of I), the rows' tokens times the expert's gate and up
   columns, SiLU(gate) * up in float32, written to the pair's row of `hidden` [pairs, I].
3. Down: per (row block, column block of H), `hidden` times the expert's down matrix, scaled by
   the pair's routing weight, written to the pair's row of `out` [pairs, H] (float32).
4. Combine: each token's sum over its pairs held here, rounded to the model's dtype, plus the
   shared experts' output when given (rounded again, as the reference's bf16 add).

Pairs routed to experts other ranks hold are never touched: the combine skips their rows.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pegainfer.core.kernels.quant_gemm import fp8_weight_tile, int4_weight_tile, tile_k
from pegainfer.core.moe.routing import Routing
from pegainfer.core.quant.scheme import Fp8Block, WeightFormat

# The experts' storage, a kernel constant: plain weights, FP8 e4m3 with block scales, INT4
# groups (both dequantized tile by tile in the kernels: `core.kernels.quant_gemm`).
_PLAIN, _FP8, _INT4 = 0, 1, 2


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _weight_tile(
    w, scale, k0, ks, cols, k_ok, col_ok, stride_wn, stride_sn, K,
    QUANT: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """One expert's W^T tile [ks, cols] in DTYPE, W [N, K] at `w` (its scales at `scale`)."""
    if QUANT == 1:
        b = fp8_weight_tile(w, scale, k0, ks, cols, k_ok, col_ok, stride_wn, stride_sn, K,
                            SCALE_ROWS, SCALE_COLS, DTYPE)  # fmt: skip
    elif QUANT == 2:
        b = int4_weight_tile(w, scale, k0, cols, col_ok, stride_wn, stride_sn, K, SCALE_COLS,
                             BLOCK_K, BLOCK_N, DTYPE)  # fmt: skip
    else:
        b = tl.load(w + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
    return b


@triton.jit
def _row_block(sorted_pairs, block_expert, num_pairs, BLOCK_M: tl.constexpr):
    """This program's block of sorted rows: its expert (-1: past the last run), its pairs and
    which of them are real (the rest hold the sentinel)."""
    block = tl.program_id(0)
    pairs = tl.load(sorted_pairs + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return tl.load(block_expert + block).to(tl.int64), pairs, pairs < num_pairs


@triton.jit
def _gate_up_kernel(
    x, w, scale, hidden, sorted_pairs, block_expert,
    num_pairs, top_k, hidden_size, inter,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h,
    QUANT: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    expert, pairs, valid = _row_block(sorted_pairs, block_expert, num_pairs, BLOCK_M)
    if expert < 0:
        return
    tokens = (pairs // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    dtype = x.dtype.element_ty
    w_gate, s_gate = w + expert * stride_we, scale + expert * stride_se
    # The up rows start `inter` rows down (a whole number of scale blocks: the loader sees to it).
    w_up, s_up = w_gate + inter * stride_wn, s_gate + (inter // SCALE_ROWS) * stride_sn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden_size
        a = tl.load(x + tokens[:, None] * stride_x + ks[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        b = _weight_tile(w_gate, s_gate, k0, ks, cols, k_ok, col_ok, stride_wn, stride_sn,
                         hidden_size, QUANT, SCALE_ROWS, SCALE_COLS, BLOCK_K, BLOCK_N,
                         dtype)  # fmt: skip
        gate += _dot(a, b, IEEE)
        b = _weight_tile(w_up, s_up, k0, ks, cols, k_ok, col_ok, stride_wn, stride_sn,
                         hidden_size, QUANT, SCALE_ROWS, SCALE_COLS, BLOCK_K, BLOCK_N,
                         dtype)  # fmt: skip
        up += _dot(a, b, IEEE)
    out = gate * tl.sigmoid(gate) * up
    tl.store(hidden + pairs[:, None].to(tl.int64) * stride_h + cols[None, :],
             out.to(hidden.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])  # fmt: skip


@triton.jit
def _down_kernel(
    hidden, w, scale, out, sorted_pairs, block_expert, weights,
    num_pairs, hidden_size, inter,
    stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_out,
    QUANT: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    expert, pairs, valid = _row_block(sorted_pairs, block_expert, num_pairs, BLOCK_M)
    if expert < 0:
        return
    rows = pairs.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden_size
    dtype = hidden.dtype.element_ty
    w_expert, s_expert = w + expert * stride_we, scale + expert * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(hidden + rows[:, None] * stride_h + ks[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        b = _weight_tile(w_expert, s_expert, k0, ks, cols, k_ok, col_ok, stride_wn, stride_sn,
                         inter, QUANT, SCALE_ROWS, SCALE_COLS, BLOCK_K, BLOCK_N, dtype)  # fmt: skip
        acc += _dot(a, b, IEEE)
    scale = tl.load(weights + rows, mask=valid, other=0.0)
    tl.store(out + rows[:, None] * stride_out + cols[None, :], acc * scale[:, None],
             mask=valid[:, None] & col_ok[None, :])  # fmt: skip


@triton.jit
def _router_logits(x, gate, rows, row_ok, cols, col_ok, hidden_size, stride_x,
                   BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                   IEEE: tl.constexpr):  # fmt: skip
    """Router logits [BLOCK_T, BLOCK_E] of token rows `rows` for experts `cols`, in float32."""
    logits = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden_size
        a = tl.load(x + rows[:, None].to(tl.int64) * stride_x + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        b = tl.load(gate + cols[None, :].to(tl.int64) * hidden_size + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        logits += _dot(a, b, IEEE)
    return logits


@triton.jit
def _best_groups(choice, cols, group_size, SIGMOID: tl.constexpr, GROUPS: tl.constexpr,
                 TOPK_GROUP: tl.constexpr, BLOCK_T: tl.constexpr):  # fmt: skip
    """`choice` [BLOCK_T, experts] with the experts outside each row's `TOPK_GROUP` best of
    `GROUPS` groups masked to -inf: a group scored by the sum of its two best (noaux_tc) or by
    its best (group-limited greedy)."""
    group_ids = tl.arange(0, GROUPS)
    group_scores = tl.zeros((BLOCK_T, GROUPS), dtype=tl.float32)
    for g in tl.static_range(GROUPS):
        inside = (cols >= g * group_size) & (cols < (g + 1) * group_size)
        in_group = tl.where(inside[None, :], choice, -float("inf"))
        score = tl.max(in_group, axis=1)
        if SIGMOID:
            first = tl.argmax(in_group, axis=1)
            rest = tl.where(cols[None, :] == first[:, None], -float("inf"), in_group)
            score += tl.max(rest, axis=1)
        group_scores = tl.where(group_ids[None, :] == g, score[:, None], group_scores)
    kept = tl.zeros((BLOCK_T, GROUPS), dtype=tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.argmax(group_scores, axis=1)
        hit = group_ids[None, :] == best[:, None]
        kept = tl.where(hit, 1, kept)
        group_scores = tl.where(hit, -float("inf"), group_scores)
    keep = tl.zeros_like(choice)
    for g in tl.static_range(GROUPS):
        inside = (cols >= g * group_size) & (cols < (g + 1) * group_size)
        group_kept = tl.sum(tl.where(group_ids[None, :] == g, kept, 0), axis=1) > 0
        keep = tl.where(inside[None, :] & group_kept[:, None], 1.0, keep)
    return tl.where(keep > 0, choice, -float("inf"))


@triton.jit
def _choose(logits, rows, row_ok, cols, col_ok, bias, weights, experts, scaling, group_size,
            TOP_K: tl.constexpr, TOP_K_TILE: tl.constexpr, SIGMOID: tl.constexpr,
            NORMALIZE: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
            BLOCK_T: tl.constexpr):  # fmt: skip
    """Each row's top k experts from its logits over every expert, and their weights."""
    if SIGMOID:  # noaux_tc: choose by the corrected score, weigh by the plain one
        scores = tl.sigmoid(logits)
        correction = tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)
        choice = tl.where(col_ok[None, :], scores + correction[None, :], -float("inf"))
    else:
        logits = tl.where(col_ok[None, :], logits, -float("inf"))
        scores = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        scores = scores / tl.sum(scores, axis=1)[:, None]
        choice = tl.where(col_ok[None, :], scores, -float("inf"))
    if GROUPS > 1:
        choice = _best_groups(choice, cols, group_size, SIGMOID, GROUPS, TOPK_GROUP, BLOCK_T)
    slots = tl.arange(0, TOP_K_TILE)
    chosen_w = tl.zeros((BLOCK_T, TOP_K_TILE), dtype=tl.float32)
    chosen_e = tl.zeros((BLOCK_T, TOP_K_TILE), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=1)
        hit = cols[None, :] == best[:, None]
        w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        chosen_w = tl.where(slots[None, :] == j, w[:, None], chosen_w)
        chosen_e = tl.where(slots[None, :] == j, best[:, None].to(tl.int32), chosen_e)
        choice = tl.where(hit, -float("inf"), choice)
    if NORMALIZE:
        chosen_w = chosen_w / (tl.sum(chosen_w, axis=1)[:, None] + 1e-20)
    out = rows[:, None] * TOP_K + slots[None, :]
    keep = row_ok[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights + out, chosen_w * scaling, mask=keep)
    tl.store(experts + out, chosen_e, mask=keep)


@triton.jit
def _route_kernel(
    x, gate, bias, weights, experts, tokens, hidden_size, num_experts, scaling, stride_x,
    group_size, TOP_K: tl.constexpr, TOP_K_TILE: tl.constexpr, SIGMOID: tl.constexpr,
    NORMALIZE: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """A small router: one program per block of tokens computes its logits and chooses."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < tokens
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < num_experts
    logits = _router_logits(x, gate, rows, row_ok, cols, col_ok, hidden_size, stride_x,
                            BLOCK_T, BLOCK_E, BLOCK_K, IEEE)  # fmt: skip
    _choose(logits, rows, row_ok, cols, col_ok, bias, weights, experts, scaling, group_size,
            TOP_K, TOP_K_TILE, SIGMOID, NORMALIZE, GROUPS, TOPK_GROUP, BLOCK_T)  # fmt: skip


@triton.jit
def _logits_kernel(
    x, gate, logits, tokens, hidden_size, num_experts, stride_x,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """A large router's logits: one program per (block of tokens, block of experts)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < tokens
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    col_ok = cols < num_experts
    acc = _router_logits(x, gate, rows, row_ok, cols, col_ok, hidden_size, stride_x,
                         BLOCK_T, BLOCK_E, BLOCK_K, IEEE)  # fmt: skip
    tl.store(logits + rows[:, None].to(tl.int64) * num_experts + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


@triton.jit
def _choose_kernel(
    logits, bias, weights, experts, tokens, num_experts, scaling, group_size,
    TOP_K: tl.constexpr, TOP_K_TILE: tl.constexpr, SIGMOID: tl.constexpr,
    NORMALIZE: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < tokens
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < num_experts
    tile = tl.load(logits + rows[:, None].to(tl.int64) * num_experts + cols[None, :],
                   mask=row_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
    _choose(tile, rows, row_ok, cols, col_ok, bias, weights, experts, scaling, group_size,
            TOP_K, TOP_K_TILE, SIGMOID, NORMALIZE, GROUPS, TOPK_GROUP, BLOCK_T)  # fmt: skip


# Routers up to this many elements (V2-Lite's 64 x 2048) are read whole by one program per
# block of tokens; larger ones (Kimi-K2's 384 x 7168: one program would stream 5.5 MB per
# layer) compute their logits over a grid of expert blocks first, then choose.
_ONE_PROGRAM_ROUTER = 1 << 20


def routes_in_a_kernel(routing: Routing) -> bool:
    """Whether `route` takes `routing`: its groups tile a power of two (every published one)."""
    return routing.n_group & (routing.n_group - 1) == 0


def route(
    x: torch.Tensor, gate: torch.Tensor, routing: Routing, correction_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`routing.route` (every method: greedy and group-limited softmax, noaux_tc with or without
    groups): weights [T, k] float32 and experts [T, k] int32 (in no particular order within a
    row)."""
    if routing.corrected != (correction_bias is not None):
        raise ValueError(f"{routing.method} routing takes a correction bias iff it is noaux_tc")
    if not routes_in_a_kernel(routing):
        raise ValueError(
            f"the routing kernel takes a power of two of groups, not {routing.n_group}"
        )
    tokens, hidden_size = x.shape
    num_experts, top_k = gate.shape[0], routing.top_k
    if x.stride(1) != 1 or not gate.is_contiguous():
        raise ValueError("x rows and the router matrix must be contiguous")
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)
    experts = torch.empty(tokens, top_k, dtype=torch.int32, device=x.device)
    if tokens == 0:
        return weights, experts
    block_t, block_e = 16, max(16, triton.next_power_of_2(num_experts))
    ieee = x.dtype == torch.float32
    choice = {
        "TOP_K": top_k,
        "TOP_K_TILE": max(2, triton.next_power_of_2(top_k)),
        "SIGMOID": routing.corrected,
        "NORMALIZE": routing.normalize,
        "GROUPS": routing.n_group,
        "TOPK_GROUP": routing.topk_group,
        "BLOCK_T": block_t,
    }
    group_size = num_experts // routing.n_group
    token_blocks = triton.cdiv(tokens, block_t)
    if num_experts * hidden_size <= _ONE_PROGRAM_ROUTER:
        # A decode step's one program walks all of `hidden_size`: long steps along k keep it
        # short (64 wide took 15 us per layer at V2-Lite's shapes on the H200); the router
        # tile stays at 16k elements.
        block_k = max(32, min(256, 16384 // block_e))
        _route_kernel[(token_blocks,)](
            x, gate, correction_bias, weights, experts, tokens, hidden_size, num_experts,
            routing.scaling, x.stride(0), group_size, BLOCK_E=block_e, BLOCK_K=block_k,
            IEEE=ieee, **choice,
        )  # fmt: skip
        return weights, experts
    logits = torch.empty(tokens, num_experts, dtype=torch.float32, device=x.device)
    logit_block_e = 32
    _logits_kernel[(token_blocks, triton.cdiv(num_experts, logit_block_e))](
        x, gate, logits, tokens, hidden_size, num_experts, x.stride(0),
        BLOCK_T=block_t, BLOCK_E=logit_block_e, BLOCK_K=256, IEEE=ieee,
    )  # fmt: skip
    _choose_kernel[(token_blocks,)](
        logits, correction_bias, weights, experts, tokens, num_experts, routing.scaling,
        group_size, BLOCK_E=block_e, **choice,
    )  # fmt: skip
    return weights, experts


# One program sorts up to this many pairs (decode batches, short prefills).
_ONE_PROGRAM_PAIRS = 4096


@triton.jit
def _dispatch_kernel(
    experts, sorted_pairs, block_expert, pairs, first, num_experts, num_blocks,
    BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, EXPERTS: tl.constexpr,
    SLOTS: tl.constexpr, BLOCKS: tl.constexpr,
):  # fmt: skip
    idx = tl.arange(0, PAIRS)
    local = tl.load(experts + idx, mask=idx < pairs, other=-1).to(tl.int32) - first
    inside = (idx < pairs) & (local >= 0) & (local < num_experts)
    bucket = tl.where(inside, local, num_experts)  # num_experts: not held here
    # Sorted (expert, pair) keys: pair order kept within an expert's run.
    keys = tl.sort(bucket * PAIRS + idx)
    sorted_expert, sorted_pair = keys // PAIRS, keys % PAIRS
    counts = tl.histogram(bucket, EXPERTS)
    e = tl.arange(0, EXPERTS)
    counts = tl.where(e < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    run_start = tl.gather(padded_end - padded, tl.minimum(sorted_expert, EXPERTS - 1), 0)
    rank_start = tl.gather(tl.cumsum(counts, axis=0) - counts,
                           tl.minimum(sorted_expert, EXPERTS - 1), 0)  # fmt: skip
    slots = tl.arange(0, SLOTS)
    tl.store(sorted_pairs + slots, pairs, mask=slots < num_blocks * BLOCK_M)
    tl.debug_barrier()  # the sentinel first, then the pairs over it
    dest = run_start + idx - rank_start
    tl.store(sorted_pairs + dest, sorted_pair, mask=sorted_expert < num_experts)
    # A block's expert: the first run ending after the block's first row.
    b = tl.arange(0, BLOCKS)
    ended = tl.sum((padded_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
    owner = tl.where(ended < num_experts, ended, -1)
    tl.store(block_expert + b, owner, mask=b < num_blocks)


def _dispatch_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """Row blocks of the sorted pairs: each expert's run padded to `block_m` rows."""
    return triton.cdiv(pairs, block_m) + min(num_experts, pairs)


def _dispatch_sizes(pairs: int, num_experts: int, block_m: int) -> dict[str, int]:
    """The one-program dispatch's compile-time sizes for `pairs` pairs."""
    blocks = _dispatch_blocks(pairs, num_experts, block_m)
    return {
        "BLOCK_M": block_m,
        "PAIRS": max(16, triton.next_power_of_2(pairs)),
        "EXPERTS": max(16, triton.next_power_of_2(num_experts + 1)),
        "SLOTS": triton.next_power_of_2(blocks * block_m),
        "BLOCKS": max(16, triton.next_power_of_2(blocks)),
    }


def _tiles(pairs: int, num_experts: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K) of the grouped GEMMs. Few rows per expert (decode) want short row
    blocks and long steps along k; prefill fills long row blocks (a tile sweep at V2-Lite's
    shapes on the H200: docs/benchmarks/2026-11-30-deepseek-h200/)."""
    return (16, 128) if pairs <= 8 * num_experts else (64, 64)


@functools.cache
def specializing_token_counts(max_tokens: int, top_k: int, num_experts: int) -> frozenset[int]:
    """The fewest token counts up to `max_tokens` that launch every specialization of
    `fused_moe` a step can: its tiles, the dispatch's compile-time sizes (powers of two of the
    step's pairs and blocks) and the classes Triton specializes the integer arguments that
    vary with the step on (pairs, blocks: equal to 1, divisible by 16, neither). The engine's
    warm-up runs a step of each (`runner.warmup`)."""

    def kind(value: int) -> int:
        return 1 if value == 1 else 16 if value % 16 == 0 else 0

    first_of: dict[tuple, int] = {}
    for tokens in range(1, max_tokens + 1):
        pairs = tokens * top_k
        block_m, _ = _tiles(pairs, num_experts)
        blocks = _dispatch_blocks(pairs, num_experts, block_m)
        sizes = ()
        if pairs <= _ONE_PROGRAM_PAIRS:
            sizes = tuple(_dispatch_sizes(pairs, num_experts, block_m).values())
        first_of.setdefault((block_m, sizes, kind(pairs), kind(blocks), kind(tokens)), tokens)
    return frozenset(first_of.values())


def dispatch(
    experts: torch.Tensor, first: int, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, choice) pairs, flattened token-major, sorted by local expert with each expert's
    run padded to `block_m` rows: `sorted_pairs` [blocks * block_m] int32 (the sentinel
    `pairs` past a run's end) and `block_expert` [blocks] int32 (-1 for blocks past the last
    run). Pairs routed outside `first`.. `first + num_experts - 1` are left out. Shapes depend
    on the number of pairs only and nothing reads device values on the host, so a CUDA graph
    can capture it."""
    pairs, device = experts.numel(), experts.device
    blocks = _dispatch_blocks(pairs, num_experts, block_m)
    sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    if pairs <= _ONE_PROGRAM_PAIRS:
        _dispatch_kernel[(1,)](
            experts, sorted_pairs, block_expert, pairs, first, num_experts, blocks,
            **_dispatch_sizes(pairs, num_experts, block_m), num_warps=8,
        )  # fmt: skip
        return sorted_pairs, block_expert
    local = experts.flatten().long() - first
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
    dest = torch.where(expert_of < num_experts, (padded_end - padded)[owner] + slot,
                       blocks * block_m)  # fmt: skip
    with_spill = torch.full((blocks * block_m + 1,), pairs, dtype=torch.int32, device=device)
    with_spill.scatter_(0, dest, order.to(torch.int32))
    sorted_pairs.copy_(with_spill[:-1])
    block_start = torch.arange(blocks, device=device) * block_m
    owner = torch.searchsorted(padded_end, block_start, right=True)
    block_expert.copy_(torch.where(owner < num_experts, owner, -1))
    return sorted_pairs, block_expert


@triton.jit
def _combine_kernel(
    out, experts, shared, result, first, num_experts, hidden_size,
    TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < hidden_size
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        local = tl.load(experts + token * TOP_K + j).to(tl.int32) - first
        if (local >= 0) & (local < num_experts):
            row = out + (token * TOP_K + j) * hidden_size
            acc += tl.load(row + cols, mask=col_ok, other=0.0)
    dtype = result.dtype.element_ty
    acc = acc.to(dtype)
    if HAS_SHARED:
        acc = (acc.to(tl.float32) + tl.load(shared + token * hidden_size + cols, mask=col_ok,
                                            other=0.0).to(tl.float32)).to(dtype)  # fmt: skip
    tl.store(result + token * hidden_size + cols, acc, mask=col_ok)


def fused_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    first: int = 0,
    shared: torch.Tensor | None = None,
    *,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    fmt: WeightFormat | None = None,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]) over the experts held here, plus
    `shared` [T, H] (the shared experts' output) when given: `gate_up` [E, 2I, H] and `down`
    [E, H, I] are experts `first`.. `first + E - 1`'s; stored as `fmt` says with their
    `scales` (gate_up's, down's) when quantized (`moe.experts.QuantizedExpertWeights`)."""
    tokens, top_k = experts.shape
    num_experts, hidden_size, inter = down.shape[0], x.shape[1], gate_up.shape[1] // 2
    x, experts, weights = x.contiguous(), experts.contiguous(), weights.float().contiguous()
    if gate_up.stride(-1) != 1 or down.stride(-1) != 1:
        raise ValueError("expert weights must be row-major in their last dimension")
    if (fmt is None) != (scales is None):
        raise ValueError("quantized experts come with their scales, plain ones without")
    result = torch.empty(tokens, hidden_size, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return result
    pairs = tokens * top_k
    block_m, block_k = _tiles(pairs, num_experts)
    quant, scale_rows, scale_cols = _storage(fmt)
    if quant == _FP8:
        block_k = tile_k(scale_cols, cap=block_k)  # a K tile inside one block of scales
    elif quant == _INT4:
        block_k = max(block_k, scale_cols)  # whole groups per K tile
    # Plain weights: the scale arguments are never read.
    gate_up_scale, down_scale = scales if scales is not None else (gate_up, down)
    sorted_pairs, block_expert = dispatch(experts, first, num_experts, block_m)
    ieee = x.dtype == torch.float32
    hidden = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    block_n = 64
    grid = (block_expert.numel(), triton.cdiv(inter, block_n))
    _gate_up_kernel[grid](
        x, gate_up, gate_up_scale, hidden, sorted_pairs, block_expert, pairs, top_k,
        hidden_size, inter, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        gate_up_scale.stride(0), gate_up_scale.stride(1), hidden.stride(0),
        QUANT=quant, SCALE_ROWS=scale_rows, SCALE_COLS=scale_cols,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee,
    )  # fmt: skip
    out = torch.empty(pairs, hidden_size, dtype=torch.float32, device=x.device)
    grid = (block_expert.numel(), triton.cdiv(hidden_size, block_n))
    _down_kernel[grid](
        hidden, down, down_scale, out, sorted_pairs, block_expert, weights, pairs,
        hidden_size, inter, hidden.stride(0), down.stride(0), down.stride(1),
        down_scale.stride(0), down_scale.stride(1), out.stride(0),
        QUANT=quant, SCALE_ROWS=scale_rows, SCALE_COLS=scale_cols,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee,
    )  # fmt: skip
    if shared is not None:
        shared = shared.contiguous()
    block = min(1024, triton.next_power_of_2(hidden_size))
    _combine_kernel[(tokens, triton.cdiv(hidden_size, block))](
        out, experts, shared, result, first, num_experts, hidden_size,
        TOP_K=top_k, HAS_SHARED=shared is not None, BLOCK=block,
    )  # fmt: skip
    return result


def _storage(fmt: WeightFormat | None) -> tuple[int, int, int]:
    """(the kernels' QUANT constant, the weight rows and columns one scale covers)."""
    if fmt is None:
        return _PLAIN, 1, 1
    if isinstance(fmt, Fp8Block):
        return _FP8, *fmt.block
    if fmt.group_size & (fmt.group_size - 1) or fmt.group_size < 8:
        raise ValueError(
            f"the fused MoE needs a power-of-two INT4 group size, not {fmt.group_size}"
        )
    return _INT4, 1, fmt.group_size
