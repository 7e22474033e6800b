"""DeepSeek sparse attention on CUDA against the references: the Triton indexer scores, the
top-k on the device, FlashInfer's MLA over page-size-1 selections (eager plans split by rows,
and graph plans), dense equivalence while sequences fit in top_k, and a decode step captured
in a CUDA graph (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.attention import sparse
from pegainfer.core.attention.latent import LatentShape, make_latent_attention
from pegainfer.core.attention.sparse import (
    FlashInferSparseLatent,
    IndexerShape,
    SparseLatentAttention,
    SparseStep,
    TorchSparseLatent,
    make_sparse_latent_attention,
    reference_scores,
)
from pegainfer.core.model_line import RuntimeConfig
from pegainfer.core.ops import sparse_attention
from pegainfer.core.runner.forward_batch import ForwardBatch

pytestmark = pytest.mark.gpu

# GLM-5's widths: 64 heads, latent 512 + rope 64, nope 192 and value 256; 32 index heads × 128.
GLM = LatentShape(num_heads=64, latent_dim=512, rope_dim=64, nope_dim=192, value_dim=256,
                  scale=256**-0.5)  # fmt: skip
INDEX = IndexerShape(heads=32, dim=128, top_k=2048, scale=128**-0.5)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


def paged(lengths: list[int], block: int, g: torch.Generator, spare: int = 4):
    """Random distinct blocks for sequences of `lengths` tokens: (tables, number of blocks)."""
    pages = [-(-n // block) for n in lengths]
    num_blocks = sum(pages) + spare
    perm = torch.randperm(num_blocks, device="cuda", generator=g).tolist()
    tables, used = [], 0
    for p in pages:
        tables.append(perm[used : used + p])
        used += p
    return tables, num_blocks


def step(starts: list[int], chunks: list[int], block: int, g: torch.Generator):
    lengths = [s + n for s, n in zip(starts, chunks, strict=True)]
    tables, num_blocks = paged(lengths, block, g)
    batch = ForwardBatch.build([[0] * n for n in chunks], starts, tables, [True] * len(chunks),
                               block, torch.device("cuda"))  # fmt: skip
    return batch, num_blocks


def indexer_rows(batch: ForwardBatch, pages: int):
    """block tables [sequences, pages] int32, each row's sequence, visible keys, and each
    sequence's first row."""
    tables = torch.zeros(batch.num_seqs, pages, dtype=torch.int32)
    for i, t in enumerate(batch.block_tables_cpu):
        tables[i, : len(t)] = torch.tensor(t[:pages], dtype=torch.int32)
    seq_of_row = torch.repeat_interleave(torch.arange(batch.num_seqs),
                                         torch.tensor(batch.query_lens_cpu))  # fmt: skip
    starts = batch.query_start_loc_cpu[:-1].cuda()
    return tables.cuda(), seq_of_row.int().cuda(), batch.positions + 1, starts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "dim"), [(32, 128), (16, 64), (64, 128)])
@pytest.mark.parametrize(("starts", "chunks", "block"), [
    ([0], [700], 16),  # a prompt
    ([6000, 20000, 31, 2100], [1, 1, 1, 1], 64),  # decodes over long contexts
    ([4000, 0, 9000], [96, 300, 1], 16),  # chunks over cached prefixes beside a decode
])  # fmt: skip
def test_triton_indexer_scores_equal_the_reference(dtype, heads, dim, starts, chunks, block):
    from pegainfer.core.kernels.indexer import indexer_scores

    g = torch.Generator("cuda").manual_seed(sum(chunks) + heads)
    batch, num_blocks = step(starts, chunks, block, g)
    rows = batch.num_tokens
    k_layer = torch.randn(num_blocks, block, dim, device="cuda", generator=g).to(dtype)
    q = torch.randn(rows, heads, dim, device="cuda", generator=g).to(dtype)
    w = torch.randn(rows, heads, device="cuda", generator=g) * heads**-0.5
    pages = max(len(t) for t in batch.block_tables_cpu)
    tables, seq_of_row, visible, starts = indexer_rows(batch, pages)
    columns = max(batch.seq_lens_cpu) + 100  # wider than every row: a graph's fixed width
    args = (q, w, k_layer, tables, seq_of_row, visible, columns, dim**-0.5)
    ours, ref = indexer_scores(*args, starts), sparse_attention.indexer_scores(*args)
    # A slice of the rows (from mid-tile to mid-tile), as a step scores its rows in chunks.
    part = slice(rows // 3, rows - rows // 4)
    sliced = indexer_scores(q[part], w[part], k_layer, tables, seq_of_row[part], visible[part],
                            columns, dim**-0.5, starts, part.start)  # fmt: skip
    torch.testing.assert_close(sliced, ours[part], rtol=1e-6, atol=1e-6)
    assert torch.equal(torch.isneginf(ours), torch.isneginf(ref))
    seen = ~torch.isneginf(ref)
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(ours[seen], ref[seen], rtol=tol, atol=tol)
    # The device top-k picks keys the reference ranks as high (ties aside: the same scores).
    k = 2048
    top_ours = sparse_attention.top_k_slots(ours, k, tables, seq_of_row, block)
    top_ref = sparse_attention.top_k_slots(ref, k, tables, seq_of_row, block)
    counts = visible.clamp(max=k)
    for t in range(0, rows, max(1, rows // 16)):
        n = int(counts[t])
        differ = set(top_ours[t, :n].tolist()) ^ set(top_ref[t, :n].tolist())
        assert len(differ) <= max(2, n // 100)  # near-ties at the cut may swap


def sparse_inputs(rows: int, num_slots: int, max_k: int, g: torch.Generator):
    """Caches of `num_slots` slots (block 1), queries, and per row a random selection of
    between 1 and max_k distinct slots, best first."""

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).bfloat16()

    ckv, kpe = randn(num_slots, 1, GLM.latent_dim), randn(num_slots, 1, GLM.rope_dim)
    q_latent = randn(rows, GLM.num_heads, GLM.latent_dim, scale=0.05)
    q_pe = randn(rows, GLM.num_heads, GLM.rope_dim, scale=0.05)
    counts = torch.randint(1, max_k + 1, (rows,), generator=torch.Generator().manual_seed(rows))
    counts[0] = max_k
    slots = torch.stack([torch.randperm(num_slots, device="cuda", generator=g)[:max_k]
                         for _ in range(rows)]).int()  # fmt: skip
    return ckv, kpe, q_latent, q_pe, slots, counts.int()


def sparse_step(slots, counts) -> SparseStep:
    rows = slots.shape[0]
    return SparseStep(
        positions=torch.zeros(rows, dtype=torch.int64, device="cuda"),
        seq_of_row=torch.arange(rows, dtype=torch.int32, device="cuda"),
        seq_starts=torch.arange(rows, dtype=torch.int32, device="cuda"),
        block_tables=torch.zeros(rows, 1, dtype=torch.int32, device="cuda"),
        block_size=1, columns=0, top_k=slots.shape[1], counts=counts.cuda(),
        counts_cpu=counts.numpy(),
    )  # fmt: skip


@pytest.mark.parametrize(("rows", "max_k", "rows_per_plan"), [
    (16, 2048, None), (300, 512, None), (300, 512, 128),  # one plan; split between three
])  # fmt: skip
def test_flashinfer_sparse_mla_equals_the_reference(monkeypatch, rows, max_k, rows_per_plan):
    g = torch.Generator("cuda").manual_seed(rows + max_k)
    ckv, kpe, q_latent, q_pe, slots, counts = sparse_inputs(rows, 40000, max_k, g)
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    if rows_per_plan is not None:
        monkeypatch.setattr(sparse, "rows_per_plan", lambda heads, sms: rows_per_plan)
    fast = FlashInferSparseLatent(GLM, torch.bfloat16, torch.device("cuda"), workspace, rows,
                                  (), max_k)  # fmt: skip
    ref = TorchSparseLatent(GLM)
    for attn in (fast, ref):
        attn.plan(sparse_step(slots, counts))
    assert len(fast._planned) == (1 if rows_per_plan is None else 3)
    ours = fast.run(q_latent, q_pe, ckv, kpe, slots)
    assert rel_err(ours, ref.run(q_latent, q_pe, ckv, kpe, slots)) < 1e-2


def test_flashinfer_sparse_graph_plan_equals_the_eager_plan():
    g = torch.Generator("cuda").manual_seed(7)
    ckv, kpe, q_latent, q_pe, slots, counts = sparse_inputs(8, 5000, 2048, g)
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    fast = FlashInferSparseLatent(GLM, torch.bfloat16, torch.device("cuda"), workspace, 8,
                                  (4, 8), 2048)  # fmt: skip
    fast.plan(sparse_step(slots, counts))
    eager = fast.run(q_latent, q_pe, ckv, kpe, slots)
    fast.plan_graph(sparse_step(slots, counts), 8)
    assert rel_err(fast.run(q_latent, q_pe, ckv, kpe, slots), eager) < 1e-3


def glm_step_inputs(batch: ForwardBatch, num_blocks: int, block: int, g: torch.Generator):
    rows, dtype = batch.num_tokens, torch.bfloat16

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

    caches = (randn(num_blocks, block, GLM.latent_dim), randn(num_blocks, block, GLM.rope_dim),
              randn(num_blocks, block, INDEX.dim))  # fmt: skip
    kv_b = randn(GLM.num_heads, GLM.nope_dim + GLM.value_dim, GLM.latent_dim, scale=0.05)
    queries = (randn(rows, GLM.num_heads, GLM.nope_dim, scale=0.3),
               randn(rows, GLM.num_heads, GLM.rope_dim, scale=0.3),
               randn(rows, INDEX.heads, INDEX.dim),
               torch.randn(rows, INDEX.heads, device="cuda", generator=g))  # fmt: skip
    return caches, kv_b, queries


def reference_attention(runtime: RuntimeConfig) -> SparseLatentAttention:
    """The torch references on CUDA tensors (what the CPU path runs)."""
    dense = make_latent_attention(GLM, torch.bfloat16, torch.device("cpu"), runtime)
    return SparseLatentAttention(INDEX, dense, TorchSparseLatent(GLM), reference_scores,
                                 runtime, torch.device("cuda"))  # fmt: skip


@pytest.mark.parametrize(("starts", "chunks"), [
    ([3000, 9000, 0, 2047], [1, 1, 1, 1]),  # decodes, some past top_k
    ([2500, 0], [64, 200]),  # a chunk past top_k beside a fresh prompt
])  # fmt: skip
def test_a_sparse_step_on_cuda_equals_the_references(starts, chunks):
    """GLM-5's widths, contexts longer than top_k (2048): selection and attention through the
    Triton scores, torch's top-k and FlashInfer equal the references."""
    block = 64
    g = torch.Generator("cuda").manual_seed(sum(starts))
    batch, num_blocks = step(starts, chunks, block, g)
    (ckv, kpe, k_idx), kv_b, (q_nope, q_pe, q_idx, w_idx) = glm_step_inputs(batch, num_blocks,
                                                                            block, g)  # fmt: skip
    runtime = RuntimeConfig(block_size=block, max_model_len=16384, max_num_batched_tokens=1024,
                            max_num_seqs=8)  # fmt: skip
    fast = make_sparse_latent_attention(GLM, INDEX, torch.bfloat16, torch.device("cuda"), runtime)
    ref = reference_attention(runtime)
    outs = []
    for attn in (fast, ref):
        attn.plan(batch)
        assert attn.is_sparse
        selection = attn.select(q_idx, w_idx, k_idx)
        outs.append(attn.run(q_nope, q_pe, ckv, kpe, kv_b, selection))
    assert rel_err(*outs) < 2e-2


def test_sparse_over_every_key_equals_dense_flashinfer_mla():
    """Sequences within top_k: the graph plan attends sparse over all their keys, the eager
    plan dense (FlashInfer's MLA over pages); the rows agree."""
    block, starts = 16, [100, 2047, 0, 900]
    g = torch.Generator("cuda").manual_seed(11)
    batch, num_blocks = step(starts, [1] * 4, block, g)
    (ckv, kpe, k_idx), kv_b, (q_nope, q_pe, q_idx, w_idx) = glm_step_inputs(batch, num_blocks,
                                                                            block, g)  # fmt: skip
    runtime = RuntimeConfig(block_size=block, max_model_len=4096, max_num_batched_tokens=512,
                            max_num_seqs=4, graph_buckets=(4,))  # fmt: skip
    attn = make_sparse_latent_attention(GLM, INDEX, torch.bfloat16, torch.device("cuda"), runtime)
    attn.plan(batch)
    assert not attn.is_sparse
    dense = attn.run(q_nope, q_pe, ckv, kpe, kv_b, attn.select(q_idx, w_idx, k_idx))
    attn.plan_graph(batch, 4)
    sparse_out = attn.run(q_nope, q_pe, ckv, kpe, kv_b, attn.select(q_idx, w_idx, k_idx))
    assert rel_err(sparse_out, dense) < 1e-2


def test_a_decode_step_replays_in_a_cuda_graph():
    """Selection and sparse attention captured once for a bucket, replayed on another batch's
    plan, equal that batch's eager step."""
    block, bucket = 64, 4
    g = torch.Generator("cuda").manual_seed(5)
    runtime = RuntimeConfig(block_size=block, max_model_len=12288, max_num_batched_tokens=512,
                            max_num_seqs=bucket, graph_buckets=(bucket,))  # fmt: skip
    attn = make_sparse_latent_attention(GLM, INDEX, torch.bfloat16, torch.device("cuda"), runtime)
    first, num_blocks = step([5000, 10, 3000, 7000], [1] * bucket, block, g)
    (ckv, kpe, k_idx), kv_b, (q_nope, q_pe, q_idx, w_idx) = glm_step_inputs(first, num_blocks,
                                                                            block, g)  # fmt: skip
    positions = first.positions.clone()
    inputs = [q_nope, q_pe, q_idx, w_idx]
    static = [t.clone() for t in inputs]
    graph_batch = ForwardBatch(**{**first.__dict__, "positions": positions})

    def forward():
        selection = attn.select(static[2], static[3], k_idx)
        return attn.run(static[0], static[1], ckv, kpe, kv_b, selection)

    attn.plan_graph(graph_batch, bucket)
    forward()  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    # Another batch over the same cache: other positions and tables, new queries.
    perm = torch.randperm(num_blocks, device="cuda", generator=g).tolist()
    lengths = [9000, 2049, 64, 4000]
    tables, used = [], 0
    for n in lengths:
        tables.append(perm[used : used + -(-n // block)])
        used += len(tables[-1])
    second = ForwardBatch.build([[0]] * bucket, [n - 1 for n in lengths], tables, [True] * bucket,
                                block, torch.device("cuda"))  # fmt: skip
    fresh = [torch.randn(t.shape, device="cuda", generator=g).to(t.dtype) for t in inputs]
    for buffer, value in zip(static, fresh, strict=True):
        buffer.copy_(value)
    positions.copy_(second.positions)
    attn.plan_graph(ForwardBatch(**{**second.__dict__, "positions": positions}), bucket)
    graph.replay()
    attn.plan(second)
    expected = attn.run(fresh[0], fresh[1], ckv, kpe, kv_b, attn.select(fresh[2], fresh[3], k_idx))
    assert rel_err(out, expected) < 1e-2
