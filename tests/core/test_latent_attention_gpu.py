"""FlashInfer's MLA (absorbed) and ragged prefill (expanded) against the reference latent
attention (CUDA; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.attention.latent import (
    FlashInferPagedLatentAttention,
    FlashInferRaggedAttention,
    LatentShape,
    MultiHeadLatentAttention,
    TorchPagedLatentAttention,
    TorchRaggedAttention,
    make_latent_attention,
)
from pegainfer.core.model_line import RuntimeConfig
from pegainfer.core.runner.forward_batch import ForwardBatch

pytestmark = pytest.mark.gpu

RANK, ROPE, NOPE, V, BLOCK, NUM_BLOCKS = 512, 64, 128, 128, 16, 256


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


def caches(seed: int):
    g = torch.Generator("cuda").manual_seed(seed)
    ckv = torch.randn(NUM_BLOCKS, BLOCK, RANK, device="cuda", generator=g).bfloat16()
    kpe = torch.randn(NUM_BLOCKS, BLOCK, ROPE, device="cuda", generator=g).bfloat16()
    return g, ckv, kpe


def tables(lengths: list[int], g: torch.Generator) -> list[list[int]]:
    """Distinct random blocks for each sequence of total length `lengths[i]`."""
    perm = torch.randperm(NUM_BLOCKS, device="cuda", generator=g).tolist()
    out, used = [], 0
    for n in lengths:
        pages = -(-n // BLOCK)
        out.append(perm[used : used + pages])
        used += pages
    return out


def step(starts: list[int], chunks: list[int], g: torch.Generator) -> tuple[ForwardBatch, int]:
    """A batch feeding `chunks[i]` tokens from `starts[i]`, and its token count."""
    lengths = [s + n for s, n in zip(starts, chunks, strict=True)]
    batch = ForwardBatch.build([[0] * n for n in chunks], starts, tables(lengths, g),
                               [True] * len(chunks), BLOCK, torch.device("cuda"))  # fmt: skip
    return batch, sum(chunks)


@pytest.mark.parametrize("heads", [16, 64])
@pytest.mark.parametrize(("starts", "chunks"), [
    ([0], [300]),  # one prompt
    ([40, 999, 0, 17], [1, 1, 1, 1]),  # decodes
    ([130, 0, 511, 64], [37, 16, 1, 200]),  # mixed: chunks over cached prefixes and a decode
])  # fmt: skip
def test_flashinfer_latent_attention_equals_the_reference(heads, starts, chunks):
    g, ckv, kpe = caches(heads + len(chunks))
    batch, tokens = step(starts, chunks, g)
    q_latent = torch.randn(tokens, heads, RANK, device="cuda", generator=g).bfloat16() * 0.05
    q_pe = torch.randn(tokens, heads, ROPE, device="cuda", generator=g).bfloat16() * 0.05
    shape = LatentShape(heads, RANK, ROPE, NOPE, V, scale=192**-0.5)
    fast = FlashInferPagedLatentAttention(shape, torch.bfloat16, torch.device("cuda"), 64)
    ref = TorchPagedLatentAttention(shape)
    for attn in (fast, ref):
        attn.plan(batch)
    ours = fast.run(q_latent, q_pe, ckv, kpe)
    assert ours.shape == (tokens, heads, RANK)
    assert rel_err(ours, ref.run(q_latent, q_pe, ckv, kpe)) < 1e-2


def test_graph_plan_equals_the_eager_plan_for_a_padded_decode_batch():
    """Decodes planned into a bucket's fixed buffers (rows past the batch read one dummy
    block) give the eager plan's rows."""
    heads, bucket = 16, 8
    g, ckv, kpe = caches(7)
    starts = [40, 999, 5]
    lengths = [s + 1 for s in starts]
    real = tables(lengths, g)
    dummy = NUM_BLOCKS - 1
    pad = bucket - len(starts)
    shape = LatentShape(heads, RANK, ROPE, NOPE, V, scale=192**-0.5)
    attn = FlashInferPagedLatentAttention(shape, torch.bfloat16, torch.device("cuda"), 64,
                                          graph_buckets=(4, bucket))  # fmt: skip
    eager = ForwardBatch.build([[0]] * 3, starts, real, [True] * 3, BLOCK, torch.device("cuda"))
    padded = ForwardBatch.build([[0]] * bucket, starts + [0] * pad, real + [[dummy]] * pad,
                                [True] * bucket, BLOCK, torch.device("cuda"))  # fmt: skip
    q_latent = torch.randn(bucket, heads, RANK, device="cuda", generator=g).bfloat16() * 0.05
    q_pe = torch.randn(bucket, heads, ROPE, device="cuda", generator=g).bfloat16() * 0.05
    attn.plan(eager)
    want = attn.run(q_latent[:3], q_pe[:3], ckv, kpe)
    attn.plan_graph(padded, bucket)
    graph = torch.cuda.CUDAGraph()
    out = torch.empty(bucket, heads, RANK, dtype=torch.bfloat16, device="cuda")
    attn.run(q_latent, q_pe, ckv, kpe)  # warm-up outside capture
    with torch.cuda.graph(graph):
        out.copy_(attn.run(q_latent, q_pe, ckv, kpe))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out[:3], want) < 1e-2


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize(("starts", "chunks"), [
    ([0], [1000]),  # one prompt: all expanded
    ([130, 0, 511, 1500, 7], [300, 16, 1, 100, 171]),  # expanded, and a decode and a short chunk
    # over a long prefix absorbed
])  # fmt: skip
def test_both_forms_on_flashinfer_equal_the_references(heads, starts, chunks):
    g, ckv, kpe = caches(heads + len(chunks))
    batch, tokens = step(starts, chunks, g)
    q_nope = torch.randn(tokens, heads, NOPE, device="cuda", generator=g).bfloat16()
    q_pe = torch.randn(tokens, heads, ROPE, device="cuda", generator=g).bfloat16()
    kv_b = (torch.randn(heads, NOPE + V, RANK, device="cuda", generator=g) * 0.05).bfloat16()
    shape = LatentShape(heads, RANK, ROPE, NOPE, V, scale=192**-0.5)
    runtime = RuntimeConfig(block_size=BLOCK, max_model_len=128 * BLOCK,
                            max_num_batched_tokens=4096, max_num_seqs=16)  # fmt: skip
    fast = make_latent_attention(shape, torch.bfloat16, torch.device("cuda"), runtime)
    assert isinstance(fast.absorbed, FlashInferPagedLatentAttention)
    assert isinstance(fast.expanded, FlashInferRaggedAttention)
    references = TorchPagedLatentAttention(shape), TorchRaggedAttention(shape.scale)
    ref = MultiHeadLatentAttention(shape, *references, torch.bfloat16, torch.device("cuda"))
    for attn in (fast, ref):
        attn.plan(batch)
    assert fast._split.expanded_slots is not None
    ours = fast.run(q_nope, q_pe, ckv, kpe, kv_b)
    assert ours.shape == (tokens, heads, V)
    assert rel_err(ours, ref.run(q_nope, q_pe, ckv, kpe, kv_b)) < 1e-2
