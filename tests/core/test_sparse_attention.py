"""DeepSeek sparse attention on the references: the indexer's scores over a paged key cache
equal the formula over each sequence's keys in order, the top-k maps back to the right cache
slots, and a step whose sequences fit in top_k keys attends the same sparse (every key
selected) as dense."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pegainfer.core.attention.latent import LatentShape
from pegainfer.core.attention.sparse import (
    IndexerShape,
    make_sparse_latent_attention,
    packed_places,
)
from pegainfer.core.model_line import RuntimeConfig
from pegainfer.core.ops import sparse_attention
from pegainfer.core.runner.forward_batch import ForwardBatch

BLOCK, NUM_BLOCKS, HEADS, DIM, SCALE = 4, 96, 8, 16, 0.25
LATENT = LatentShape(num_heads=4, latent_dim=32, rope_dim=8, nope_dim=16, value_dim=24, scale=0.2)


def paged_step(starts: list[int], lengths: list[int], seed: int = 0):
    """A batch feeding `lengths[i]` tokens from `starts[i]` over blocks scattered in the cache,
    each sequence's keys in order, and the step's rows as the indexer addresses them."""
    g = torch.Generator().manual_seed(seed)
    perm, tables = torch.randperm(NUM_BLOCKS, generator=g).tolist(), []
    for start, n in zip(starts, lengths, strict=True):
        pages = -(-(start + n) // BLOCK)
        tables.append(perm[:pages])
        perm = perm[pages:]
    batch = ForwardBatch.build([[0] * n for n in lengths], starts, tables, [True] * len(lengths),
                               BLOCK, torch.device("cpu"))  # fmt: skip
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_of_row = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return batch, tables, block_tables, seq_of_row.int(), g


def test_indexer_scores_over_pages_equal_the_formula_over_each_sequence():
    starts, lengths = [9, 30, 0], [7, 1, 5]
    batch, tables, block_tables, seq_of_row, g = paged_step(starts, lengths)
    k_layer = torch.randn(NUM_BLOCKS, BLOCK, DIM, generator=g, dtype=torch.float64)
    q = torch.randn(13, HEADS, DIM, generator=g, dtype=torch.float64)
    w = torch.randn(13, HEADS, generator=g, dtype=torch.float64)
    columns = max(batch.seq_lens_cpu) + 3  # wider than any row sees: the rest is -inf
    scores = sparse_attention.indexer_scores(q, w, k_layer, block_tables, seq_of_row,
                                             batch.positions + 1, columns, SCALE)  # fmt: skip
    for t, (seq, pos) in enumerate(zip(seq_of_row.tolist(), batch.positions.tolist(),
                                       strict=True)):  # fmt: skip
        keys = k_layer[tables[seq]].flatten(0, 1)[: pos + 1]
        expected = (w[t, :, None] * torch.relu(SCALE * q[t] @ keys.t())).sum(0)
        torch.testing.assert_close(scores[t, : pos + 1], expected.float())
        assert torch.isneginf(scores[t, pos + 1 :]).all()


def test_top_k_slots_hold_each_rows_best_keys():
    batch, tables, block_tables, seq_of_row, g = paged_step([20, 0], [3, 9])
    k_layer = torch.randn(NUM_BLOCKS, BLOCK, DIM, generator=g)
    q = torch.randn(12, HEADS, DIM, generator=g)
    w = torch.randn(12, HEADS, generator=g).abs()
    visible = batch.positions + 1
    scores = sparse_attention.indexer_scores(q, w, k_layer, block_tables, seq_of_row, visible,
                                             23, SCALE)  # fmt: skip
    slots = sparse_attention.top_k_slots(scores, 5, block_tables, seq_of_row, BLOCK)
    assert slots.shape == (12, 5) and slots.dtype == torch.int32
    for t in range(12):
        table, n = tables[seq_of_row[t]], min(5, int(visible[t]))
        best = scores[t].topk(n).indices
        expected = [table[p // BLOCK] * BLOCK + p % BLOCK for p in best.tolist()]
        assert slots[t, :n].tolist() == expected


def test_top_k_slots_over_columns_past_every_table():
    """Scores wider than any block table (a graph's fixed width), with more wanted keys than a
    row sees: the hidden columns' picks stay in the tables (they raised an out-of-range index,
    on CUDA a device-side assert), and the visible picks are unchanged."""
    batch, tables, block_tables, seq_of_row, g = paged_step([20, 0], [3, 9])
    k_layer = torch.randn(NUM_BLOCKS, BLOCK, DIM, generator=g)
    q = torch.randn(12, HEADS, DIM, generator=g)
    w = torch.randn(12, HEADS, generator=g).abs()
    visible = batch.positions + 1
    columns = block_tables.shape[1] * BLOCK + 3 * BLOCK
    scores = sparse_attention.indexer_scores(q, w, k_layer, block_tables, seq_of_row, visible,
                                             columns, SCALE)  # fmt: skip
    slots = sparse_attention.top_k_slots(scores, columns, block_tables, seq_of_row, BLOCK)
    assert slots.shape == (12, columns)
    for t in range(12):
        table, n = tables[seq_of_row[t]], int(visible[t])
        best = scores[t].topk(n).indices
        assert slots[t, :n].tolist() == [table[p // BLOCK] * BLOCK + p % BLOCK
                                         for p in best.tolist()]  # fmt: skip


def test_sparse_attention_over_every_key_equals_dense_mla():
    """Sequences no longer than top_k: an eager step attends dense MLA (no scoring), a decode
    batch planned as a graph's attends sparse over the indexer's selection of every key; both
    give the same rows, also for the graph's padding."""
    starts, lengths = [11, 5, 0], [1, 1, 1]
    batch, tables, _, _, g = paged_step(starts, lengths, seed=3)
    runtime = RuntimeConfig(block_size=BLOCK, max_model_len=64, max_num_batched_tokens=64,
                            max_num_seqs=8, graph_buckets=(4,))  # fmt: skip
    attn = make_sparse_latent_attention(LATENT, IndexerShape(HEADS, DIM, 16, SCALE),
                                        torch.float64, torch.device("cpu"), runtime)  # fmt: skip
    s = LATENT
    ckv = torch.randn(NUM_BLOCKS, BLOCK, s.latent_dim, generator=g, dtype=torch.float64)
    kpe = torch.randn(NUM_BLOCKS, BLOCK, s.rope_dim, generator=g, dtype=torch.float64)
    k_layer = torch.randn(NUM_BLOCKS, BLOCK, DIM, generator=g, dtype=torch.float64)
    kv_b = torch.randn(s.num_heads, s.nope_dim + s.value_dim, s.latent_dim, generator=g,
                       dtype=torch.float64)  # fmt: skip
    q_nope = torch.randn(4, s.num_heads, s.nope_dim, generator=g, dtype=torch.float64)
    q_pe = torch.randn(4, s.num_heads, s.rope_dim, generator=g, dtype=torch.float64)
    q_idx = torch.randn(4, HEADS, DIM, generator=g, dtype=torch.float64)
    w_idx = torch.randn(4, HEADS, generator=g, dtype=torch.float64)

    attn.plan(batch)
    assert not attn.is_sparse and attn.select(q_idx[:3], w_idx[:3], k_layer) is None
    dense = attn.run(q_nope[:3], q_pe[:3], ckv, kpe, kv_b, None)

    padded = ForwardBatch(
        input_ids=torch.zeros(4, dtype=torch.int64),
        positions=torch.tensor([*starts, 0]),
        slot_mapping=torch.zeros(4, dtype=torch.int64),
        logits_indices=torch.arange(4),
        block_size=BLOCK,
        query_lens_cpu=[1] * 4,
        seq_lens_cpu=[*batch.seq_lens_cpu, 1],
        block_tables_cpu=[*tables, [NUM_BLOCKS - 1]],
        query_start_loc_cpu=torch.arange(5, dtype=torch.int32),
    )
    attn.plan_graph(padded, 4)
    assert attn.is_sparse
    selection = attn.select(q_idx, w_idx, k_layer)
    for t, n in enumerate(padded.seq_lens_cpu):
        table = padded.block_tables_cpu[t]
        assert sorted(selection[t, :n].tolist()) == sorted(
            table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)
        )
    sparse = attn.run(q_nope, q_pe, ckv, kpe, kv_b, selection)
    torch.testing.assert_close(sparse[:3], dense, rtol=1e-10, atol=1e-10)
    # The padding row attends its one key: the value of that latent.
    c = ckv[NUM_BLOCKS - 1, 0]
    torch.testing.assert_close(sparse[3], kv_b[:, s.nope_dim :] @ c)


@pytest.mark.parametrize(("top_k", "scored"), [(3, 10), (8, 4)])
def test_a_longer_step_attends_each_rows_selection(top_k, scored):
    """A chunk of 4 rows ending at 13 keys beside a prompt of 6: every row attends the
    reference's softmax over its top_k keys. With top_k 8 the prompt fits: only the chunk's
    rows are scored (and attend sparsely), the prompt's attend dense MLA."""
    starts, lengths = [9, 0], [4, 6]
    batch, tables, block_tables, seq_of_row, g = paged_step(starts, lengths, seed=5)
    runtime = RuntimeConfig(block_size=BLOCK, max_model_len=64, max_num_batched_tokens=64,
                            max_num_seqs=8)  # fmt: skip
    attn = make_sparse_latent_attention(LATENT, IndexerShape(HEADS, DIM, top_k, SCALE),
                                        torch.float64, torch.device("cpu"), runtime)  # fmt: skip
    s, rows = LATENT, 10
    ckv = torch.randn(NUM_BLOCKS, BLOCK, s.latent_dim, generator=g, dtype=torch.float64)
    kpe = torch.randn(NUM_BLOCKS, BLOCK, s.rope_dim, generator=g, dtype=torch.float64)
    k_layer = torch.randn(NUM_BLOCKS, BLOCK, DIM, generator=g, dtype=torch.float64)
    kv_b = torch.randn(s.num_heads, s.nope_dim + s.value_dim, s.latent_dim, generator=g,
                       dtype=torch.float64)  # fmt: skip
    q_nope = torch.randn(rows, s.num_heads, s.nope_dim, generator=g, dtype=torch.float64)
    q_pe = torch.randn(rows, s.num_heads, s.rope_dim, generator=g, dtype=torch.float64)
    q_idx = torch.randn(rows, HEADS, DIM, generator=g, dtype=torch.float64)
    w_idx = torch.randn(rows, HEADS, generator=g, dtype=torch.float64)
    attn.plan(batch)
    assert attn.is_sparse
    selection = attn.select(q_idx, w_idx, k_layer)
    assert selection.shape == (scored, top_k)
    out = attn.run(q_nope, q_pe, ckv, kpe, kv_b, selection)
    visible = batch.positions + 1
    scores = sparse_attention.indexer_scores(q_idx, w_idx, k_layer, block_tables, seq_of_row,
                                             visible, 13, SCALE)  # fmt: skip
    for t in range(rows):
        n = min(top_k, int(visible[t]))
        table = tables[seq_of_row[t]]
        chosen = scores[t].topk(n).indices.tolist()
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in chosen])
        c, k_pe = ckv.flatten(0, 1)[slots], kpe.flatten(0, 1)[slots]
        k = torch.cat((torch.einsum("sr,hnr->hsn", c, kv_b[:, : s.nope_dim]),
                       k_pe[None].expand(s.num_heads, -1, -1)), -1)  # fmt: skip
        v = torch.einsum("sr,hvr->hsv", c, kv_b[:, s.nope_dim :])
        q = torch.cat((q_nope[t], q_pe[t]), -1)
        probs = (torch.einsum("hd,hsd->hs", q, k) * s.scale).softmax(-1)
        torch.testing.assert_close(out[t], torch.einsum("hs,hsv->hv", probs, v))


def test_packed_places_list_each_rows_valid_slots_in_order():
    """FlashInfer reads each row's valid selected slots packed: their places in the
    [rows, top_k] selection, and the packed offsets; the buffer's tail is zeroed."""
    counts = np.array([3, 1, 0, 4], dtype=np.int32)
    out = torch.full((20,), -1, dtype=torch.int64)
    indptr = packed_places(counts, torch.from_numpy(counts), 4, out)
    assert indptr.tolist() == [0, 3, 4, 4, 8]
    assert out.tolist() == [0, 1, 2, 4, 12, 13, 14, 15] + [0] * 12
