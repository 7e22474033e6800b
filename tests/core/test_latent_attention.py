"""MLA's attention on the references: absorbed queries over a paged latent cache, and a step
split between the absorbed and expanded forms, give the expanded per-head attention (float64,
so only the algebra differs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pegainfer.core.attention import latent as latent_attention
from pegainfer.core.attention.latent import (
    MLA_PLAN_WORK_ITEMS,
    LatentShape,
    TorchPagedLatentAttention,
    check_mla_plan_fits,
    make_latent_attention,
    mla_plan_work_items,
)
from pegainfer.core.errors import ConfigError
from pegainfer.core.model_line import RuntimeConfig
from pegainfer.core.runner.forward_batch import ForwardBatch

HEADS, NOPE, ROPE, RANK, V, BLOCK, SCALE = 4, 16, 8, 32, 16, 4, 0.2
SHAPE = LatentShape(HEADS, RANK, ROPE, NOPE, V, SCALE)


def runtime(pages: int) -> RuntimeConfig:
    return RuntimeConfig(block_size=BLOCK, max_model_len=pages * BLOCK,
                         max_num_batched_tokens=pages * BLOCK, max_num_seqs=16)  # fmt: skip


def expanded(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale):
    """One sequence's last q rows, causal, with K = [W_uk c | k_pe] and V = W_uv c per head."""
    q_len, seq_len = q_nope.shape[0], c.shape[0]
    k = torch.cat((torch.einsum("sr,hnr->shn", c, w_uk), k_pe[:, None].expand(-1, HEADS, -1)), -1)
    v = torch.einsum("sr,hvr->shv", c, w_uv)
    q = torch.cat((q_nope, q_pe), dim=-1)
    q_pos = torch.arange(seq_len - q_len, seq_len)
    mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, scale=scale
    )
    return out.transpose(0, 1)


def random_step(starts: list[int], lengths: list[int], seed: int = 0):
    """Caches with blocks scattered over them, one batch feeding `lengths[i]` tokens from
    `starts[i]`, queries and an up-projection (float64, so only the algebra differs)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    num_blocks = 128
    ckv, kpe = randn(num_blocks, BLOCK, RANK), randn(num_blocks, BLOCK, ROPE)
    perm, tables = torch.randperm(num_blocks, generator=g).tolist(), []
    for start, n in zip(starts, lengths, strict=True):
        pages = -(-(start + n) // BLOCK)
        tables.append(perm[:pages])
        perm = perm[pages:]
    batch = ForwardBatch.build(
        [[0] * n for n in lengths], starts, tables, [True] * len(lengths), BLOCK,
        torch.device("cpu"),
    )  # fmt: skip
    tokens = sum(lengths)
    q_nope, q_pe = randn(tokens, HEADS, NOPE), randn(tokens, HEADS, ROPE)
    return batch, tables, ckv, kpe, q_nope, q_pe, randn(HEADS, NOPE + V, RANK, scale=0.3)


def assert_equals_the_expanded_form(out, starts, lengths, tables, ckv, kpe, q_nope, q_pe, w):
    row = 0
    for start, n, table in zip(starts, lengths, tables, strict=True):
        seq_len = start + n
        c = ckv[table].flatten(0, 1)[:seq_len]
        k_pe = kpe[table].flatten(0, 1)[:seq_len]
        rows = slice(row, row + n)
        ref = expanded(q_nope[rows], q_pe[rows], c, k_pe, w[:, :NOPE], w[:, NOPE:], SCALE)
        assert torch.allclose(out[rows], ref, atol=1e-12)
        row += n


def test_absorbed_paged_attention_equals_the_expanded_form():
    """A step with a prefill chunk over a cached prefix (7 new rows at 9..15), a decode (row
    at 22) and a first chunk (5 rows from 0), blocks scattered over the cache."""
    starts, lengths = [9, 22, 0], [7, 1, 5]
    batch, tables, ckv, kpe, q_nope, q_pe, w = random_step(starts, lengths)
    attn = TorchPagedLatentAttention(SHAPE)
    attn.plan(batch)
    q_latent = torch.einsum("thn,hnr->thr", q_nope, w[:, :NOPE])
    ours = torch.einsum("thr,hvr->thv", attn.run(q_latent, q_pe, ckv, kpe), w[:, NOPE:])
    assert_equals_the_expanded_form(ours, starts, lengths, tables, ckv, kpe, q_nope, q_pe, w)


def test_chunks_split_between_the_forms_by_cost_with_one_result():
    """Prompts from position 0 and chunks long for their prefix attend expanded, decodes and
    chunks short for theirs absorbed, in one step; every row equals the expanded reference."""
    starts, lengths = [9, 22, 0, 3, 200], [40, 1, 5, 32, 20]
    assert [SHAPE.expands(n, s + n) for s, n in zip(starts, lengths, strict=True)] == [
        True, False, True, True, False,
    ]  # fmt: skip
    batch, tables, ckv, kpe, q_nope, q_pe, w = random_step(starts, lengths, seed=1)
    attn = make_latent_attention(SHAPE, torch.float64, torch.device("cpu"), runtime(64))
    attn.plan(batch)
    ours = attn.run(q_nope, q_pe, ckv, kpe, w)
    assert attn._split.expanded_rows.tolist() == [*range(0, 40), *range(41, 78)]
    assert_equals_the_expanded_form(ours, starts, lengths, tables, ckv, kpe, q_nope, q_pe, w)


def test_the_cost_rule_at_deepseeks_sizes():
    """Latent 512, rope 64, nope and value 128: after a long prefix a chunk expands from ~171
    rows; a prompt from position 0 always does, a decode never."""
    shape = LatentShape(16, 512, 64, 128, 128, 0.1)
    assert shape.expands(300, 300) and shape.expands(1, 1)
    assert not shape.expands(1, 5000)
    assert shape.expands(175, 100_000) and not shape.expands(170, 100_000)


@pytest.mark.parametrize("lengths", [[40, 33], [50]], ids=["second-chunk", "one-prompt"])
def test_a_step_over_the_expansion_budget_attends_the_rest_absorbed(monkeypatch, lengths):
    """At most `_EXPANDED_TOKEN_HEADS` cached tokens x heads (45 tokens here) are up-projected
    per step: the chunk that would pass it attends absorbed."""
    monkeypatch.setattr(latent_attention, "_EXPANDED_TOKEN_HEADS", 45 * HEADS)
    starts = [0, 12][: len(lengths)]
    batch, tables, ckv, kpe, q_nope, q_pe, w = random_step(starts, lengths, seed=2)
    attn = make_latent_attention(SHAPE, torch.float64, torch.device("cpu"), runtime(32))
    attn.plan(batch)
    ours = attn.run(q_nope, q_pe, ckv, kpe, w)
    split = attn._split
    assert (split.expanded_slots is not None, split.absorbed_batch is not None) == (
        (True, True) if len(lengths) == 2 else (False, True)
    )
    assert_equals_the_expanded_form(ours, starts, lengths, tables, ckv, kpe, q_nope, q_pe, w)


def planner_work_items(q_lens: list[int], kv_lens: list[int], num_heads: int, num_sms: int) -> int:
    """The work items FlashInfer 0.6's `MLAPlan` (attention/scheduler.cuh) makes for a causal
    step, counted the way it schedules them."""

    def causal_end(q_len, kv_len, tile, tile_q, tiles):  # packed_causal_kv_end
        if tile + 1 == tiles:
            return kv_len
        return max(min(kv_len - q_len + -(-(tile + 1) * tile_q // num_heads), kv_len), 0)

    packed = [q * num_heads for q in q_lens]
    cluster = 2 if sum(packed) // len(packed) > 64 else 1
    clusters, tile_q = num_sms // cluster, 64 * cluster
    ends = [causal_end(q, kv, t, tile_q, -(-p // tile_q))
            for q, kv, p in zip(q_lens, kv_lens, packed, strict=True)
            for t in range(-(-p // tile_q))]  # fmt: skip
    total = sum(ends)
    x = max(-(-total // clusters), 1)
    limit = 32 if x <= 8 else 64 if x <= 16 else 128 if x <= 32 else 192 if x <= 64 else (
        -(-x // 256) * 256)  # fmt: skip
    return sum(max(-(-end // limit), 1) for end in ends)


@pytest.mark.parametrize("num_heads", [16, 64, 128])
def test_the_mla_planner_bound_holds_for_its_schedule(num_heads):
    """`mla_plan_work_items` bounds what FlashInfer's planner makes, over random steps of
    decodes only (few packed rows: the planner's one-CTA clusters) and of decodes, chunks after
    prefixes and whole prompts, within the step budgets."""
    g = torch.Generator().manual_seed(num_heads)
    max_tokens, max_seqs, sms = 2048, 64, 132
    for trial in range(400):
        seqs = int(torch.randint(1, max_seqs + 1, (1,), generator=g))
        if trial % 2:
            q = [1] * seqs
        else:
            q = torch.randint(1, 3 * max_tokens // seqs + 2, (seqs,), generator=g)
            q = (q * max_tokens // max(int(q.sum()), max_tokens)).clamp(min=1).tolist()
        kv = [n + int(torch.randint(0, 100_000, (1,), generator=g)) for n in q]
        made = planner_work_items(q, kv, num_heads, sms)
        assert made <= mla_plan_work_items(num_heads, sum(q), seqs, sms)


@pytest.mark.parametrize(("q_lens", "kv_len", "num_heads", "made"), [
    ([1], 10**6, 16, 131),  # one decode over a long cache: cut into a piece per SM
    ([1] * 2000, 50, 16, 2000),  # many short decodes: a work item each
    ([1] * 1000, 50, 64, 1000),  # the same at 64 heads (tiles of 64 packed rows)
    ([1] * 256, 50, 128, 256),  # 128 heads: tiles of 128 packed rows
    ([16318], 16318, 128, 16318),  # one long prompt at 128 heads
])  # fmt: skip
def test_the_mla_planner_bound_at_its_tight_cases(q_lens, kv_len, num_heads, made):
    """Steps where each of the bound's terms (SMs, packed rows, sequences) is what the planner
    needs: dropping any of them would break it."""
    sms = 132
    assert planner_work_items(q_lens, [kv_len] * len(q_lens), num_heads, sms) == made
    assert made <= mla_plan_work_items(num_heads, sum(q_lens), len(q_lens), sms)


def test_step_budgets_the_mla_planner_cannot_hold_are_refused():
    """Kimi-K2's 128 heads on one GPU: up to 16,062 tokens a step fit beside 256 sequences;
    the error names that budget, or says to lower the sequence count when no token budget
    would do."""
    check_mla_plan_fits(128, 16062, 256, 132)
    with pytest.raises(ConfigError, match="at most 16062") as refused:
        check_mla_plan_fits(128, 16063, 256, 132)
    assert str(MLA_PLAN_WORK_ITEMS) in str(refused.value)
    check_mla_plan_fits(16, 60_000, 256, 132)
    with pytest.raises(ConfigError, match="lower --max-num-seqs"):
        check_mla_plan_fits(16, 1, 16400, 132)
