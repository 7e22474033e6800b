"""Decode-graph wrappers sharing one set of FlashInfer plan buffers (`share_plan_buffers`):
each bucket's captured graph, replayed in any order between other buckets' and eager steps'
plans, still equals the torch reference (CUDA; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.attention.latent import (
    FlashInferPagedLatentAttention,
    LatentShape,
    TorchPagedLatentAttention,
)
from pegainfer.core.attention.paged import (
    FlashInferPagedAttention,
    GQAShape,
    TorchPagedAttention,
)
from pegainfer.core.runner.forward_batch import ForwardBatch

pytestmark = pytest.mark.gpu

BLOCK, MAX_PAGES = 16, 64
BUCKETS = (1, 4, 8, 16)
NUM_BLOCKS = max(BUCKETS) * MAX_PAGES + 1  # every row at its longest, and a dummy block
# Replays out of order, with eager steps between (None: an eager mixed step).
ORDER = (16, 1, None, 8, 4, 16, None, 1, 8)
CUDA = torch.device("cuda")


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


def batch_of(starts: list[int], chunks: list[int], g: torch.Generator) -> ForwardBatch:
    """Sequence i feeds `chunks[i]` tokens from `starts[i]`, over distinct random blocks; the
    last block is left to padding rows."""
    perm = torch.randperm(NUM_BLOCKS - 1, generator=g).tolist()
    tables, used = [], 0
    for start, n in zip(starts, chunks, strict=True):
        pages = -(-(start + n) // BLOCK)
        tables.append(perm[used : used + pages])
        used += pages
    return ForwardBatch.build([[0] * n for n in chunks], starts, tables, [True] * len(chunks),
                              BLOCK, CUDA)  # fmt: skip


def padded(real: ForwardBatch, bucket: int) -> ForwardBatch:
    """`real`'s decodes padded to `bucket` rows that read the dummy (last) block."""
    pad = bucket - real.num_seqs
    starts = [length - 1 for length in real.seq_lens_cpu]
    return ForwardBatch.build([[0]] * bucket, starts + [0] * pad,
                              real.block_tables_cpu + [[NUM_BLOCKS - 1]] * pad,
                              [True] * bucket, BLOCK, CUDA)  # fmt: skip


def decodes(bucket: int, g: torch.Generator) -> ForwardBatch:
    """A decode batch that fills its bucket less the last row, of random lengths."""
    rows = max(1, bucket - 1)
    starts = torch.randint(0, MAX_PAGES * BLOCK - 1, (rows,), generator=g).tolist()
    return batch_of(starts, [1] * rows, g)


def mixed(g: torch.Generator) -> ForwardBatch:
    return batch_of([90, 7, 0, 300], [1, 1, 40, 17], g)


def shared(wrappers: list) -> bool:
    first = wrappers[0]
    return all(
        w._int_workspace_buffer.data_ptr() == first._int_workspace_buffer.data_ptr()
        and w._pin_memory_int_workspace_buffer.data_ptr()
        == first._pin_memory_int_workspace_buffer.data_ptr()
        for w in wrappers
    )


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(32, 8, 128), (16, 4, 256)],  # Qwen3-4B's attention, Qwen3.5-4B's
)
def test_gqa_decode_graphs_on_shared_plan_buffers_equal_the_reference(heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(heads + head_dim)
    shape = GQAShape(heads, kv_heads, head_dim)
    fast = FlashInferPagedAttention(shape, torch.bfloat16, CUDA, MAX_PAGES, BUCKETS)
    assert shared(list(fast._graph_decode.values()))
    ref = TorchPagedAttention(shape)
    kv = torch.randn(NUM_BLOCKS, 2, BLOCK, kv_heads, head_dim, generator=g).bfloat16().to(CUDA)
    largest = max(BUCKETS)
    q_in = torch.empty(largest, heads, head_dim, dtype=torch.bfloat16, device=CUDA)
    out = torch.empty_like(q_in)
    graphs = {}
    for bucket in reversed(BUCKETS):  # captured as the engine does, largest first
        fast.plan_graph(padded(decodes(bucket, g), bucket), bucket)
        fast.attend(q_in[:bucket], kv, out[:bucket])  # warm-up outside capture
        graphs[bucket] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[bucket]):
            fast.attend(q_in[:bucket], kv, out[:bucket])
    for bucket in ORDER:
        real = mixed(g) if bucket is None else decodes(bucket, g)
        q = torch.randn(real.num_tokens, heads, head_dim, generator=g).bfloat16().to(CUDA)
        ref.plan(real)
        want = ref.attend(q, kv)
        if bucket is None:
            fast.plan(real)
            got = fast.attend(q, kv)
        else:
            fast.plan_graph(padded(real, bucket), bucket)
            q_in[: real.num_tokens].copy_(q)
            graphs[bucket].replay()
            got = out[: real.num_tokens]
        torch.cuda.synchronize()
        assert rel_err(got, want) < 1e-2, bucket


RANK, ROPE = 512, 64


@pytest.mark.parametrize("heads", [16, 128])  # DeepSeek-V2-Lite, V2/V3
def test_mla_graphs_and_eager_on_shared_plan_buffers_equal_the_reference(heads):
    g = torch.Generator().manual_seed(heads)
    shape = LatentShape(heads, RANK, ROPE, 128, 128, scale=192**-0.5)
    fast = FlashInferPagedLatentAttention(shape, torch.bfloat16, CUDA, MAX_PAGES, BUCKETS)
    assert shared([fast._eager, *fast._graph.values()])
    ref = TorchPagedLatentAttention(shape)
    ckv = torch.randn(NUM_BLOCKS, BLOCK, RANK, generator=g).bfloat16().to(CUDA)
    kpe = torch.randn(NUM_BLOCKS, BLOCK, ROPE, generator=g).bfloat16().to(CUDA)
    largest = max(BUCKETS)
    q_latent = torch.empty(largest, heads, RANK, dtype=torch.bfloat16, device=CUDA)
    q_pe = torch.empty(largest, heads, ROPE, dtype=torch.bfloat16, device=CUDA)
    out = torch.empty_like(q_latent)
    graphs = {}
    for bucket in reversed(BUCKETS):
        fast.plan_graph(padded(decodes(bucket, g), bucket), bucket)
        fast.run(q_latent[:bucket], q_pe[:bucket], ckv, kpe)  # warm-up outside capture
        graphs[bucket] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[bucket]):
            out[:bucket].copy_(fast.run(q_latent[:bucket], q_pe[:bucket], ckv, kpe))
    for bucket in ORDER:
        real = mixed(g) if bucket is None else decodes(bucket, g)
        n = real.num_tokens
        ql = (torch.randn(n, heads, RANK, generator=g) * 0.05).bfloat16().to(CUDA)
        qp = (torch.randn(n, heads, ROPE, generator=g) * 0.05).bfloat16().to(CUDA)
        ref.plan(real)
        want = ref.run(ql, qp, ckv, kpe)
        if bucket is None:
            fast.plan(real)
            got = fast.run(ql, qp, ckv, kpe)
        else:
            fast.plan_graph(padded(real, bucket), bucket)
            q_latent[:n].copy_(ql)
            q_pe[:n].copy_(qp)
            graphs[bucket].replay()
            got = out[:n]
        torch.cuda.synchronize()
        assert rel_err(got, want) < 1e-2, bucket
