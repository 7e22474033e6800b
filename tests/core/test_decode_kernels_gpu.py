"""FlashInfer's two decode kernels as `FlashInferPagedAttention` picks them per batch size
(`DecodeKernels`): each agrees with the torch reference at Qwen3's, Qwen3.5's and a group-8
geometry and several batch sizes; each graph bucket gets the kernel its size picks and its
replay equals the eager step of that kernel; eager steps pick by their count of decode rows,
beside prefill rows too (CUDA; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.attention.paged import (
    DecodeKernels,
    FlashInferPagedAttention,
    GQAShape,
    TorchPagedAttention,
)
from tests.core.test_plan_buffers_gpu import (
    CUDA,
    MAX_PAGES,
    NUM_BLOCKS,
    batch_of,
    decodes,
    padded,
    rel_err,
)

pytestmark = pytest.mark.gpu

BLOCK = 16
# (heads, KV heads, head_dim): Qwen3-4B/8B, Qwen3.5-4B's full attention, a group of 8.
GEOMETRIES = [(32, 8, 128), (16, 4, 256), (64, 8, 128)]
KERNELS = {"tensor_cores": DecodeKernels(1), "cuda_cores": DecodeKernels(None)}


def setup(heads: int, kv_heads: int, head_dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(NUM_BLOCKS, 2, BLOCK, kv_heads, head_dim, generator=g).bfloat16().to(CUDA)
    return g, GQAShape(heads, kv_heads, head_dim), kv


def reference(shape: GQAShape, batch, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    ref = TorchPagedAttention(shape)
    ref.plan(batch)
    return ref.attend(q, kv)


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("rows", [1, 3, 17, 60])
def test_each_kernel_equals_the_reference(geometry, kernel, rows):
    g, shape, kv = setup(*geometry, seed=rows)
    attn = FlashInferPagedAttention(shape, torch.bfloat16, CUDA, MAX_PAGES, (), KERNELS[kernel])
    # `rows` decodes of random lengths, up to 200 tokens (60 of them fit the cache).
    batch = batch_of(torch.randint(0, 200, (rows,), generator=g).tolist(), [1] * rows, g)
    q = torch.randn(rows, shape.num_heads, shape.head_dim, generator=g).bfloat16().to(CUDA)
    attn.plan(batch)
    assert attn._active[0][0].use_tensor_cores == (kernel == "tensor_cores")
    assert rel_err(attn.attend(q, kv), reference(shape, batch, q, kv)) < 1e-2


@pytest.mark.parametrize("geometry", GEOMETRIES[:2])
def test_graph_buckets_replay_their_kernel_as_eager_steps_run_it(geometry):
    """Buckets below the threshold on CUDA cores, from it on tensor cores; each replay equals
    an eager step through the same kernel, and the reference."""
    g, shape, kv = setup(*geometry, seed=7)
    kernels = DecodeKernels(8)
    buckets = (1, 4, 8, 16)
    attn = FlashInferPagedAttention(shape, torch.bfloat16, CUDA, MAX_PAGES, buckets, kernels)
    eager = {name: FlashInferPagedAttention(shape, torch.bfloat16, CUDA, MAX_PAGES, (), k)
             for name, k in KERNELS.items()}  # fmt: skip
    for bucket in buckets:
        assert attn._graph_decode[bucket].use_tensor_cores == (bucket >= 8)
    q_in = torch.zeros(max(buckets), shape.num_heads, shape.head_dim, dtype=torch.bfloat16,
                       device=CUDA)  # fmt: skip
    out = torch.empty_like(q_in)
    graphs = {}
    for bucket in reversed(buckets):  # captured as the engine does, largest first
        attn.plan_graph(padded(decodes(bucket, g), bucket), bucket)
        attn.attend(q_in[:bucket], kv, out[:bucket])  # warm-up (and JIT) outside capture
        graphs[bucket] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[bucket]):
            attn.attend(q_in[:bucket], kv, out[:bucket])
    for bucket in (16, 1, 8, 4, 16, 1):
        real = decodes(bucket, g)  # one row short of the bucket (but bucket 1)
        n = real.num_tokens
        q = torch.randn(n, shape.num_heads, shape.head_dim, generator=g).bfloat16().to(CUDA)
        attn.plan_graph(padded(real, bucket), bucket)
        q_in[:n].copy_(q)
        graphs[bucket].replay()
        same = eager["tensor_cores" if bucket >= 8 else "cuda_cores"]
        same.plan(real)
        want = same.attend(q, kv)
        torch.cuda.synchronize()
        assert rel_err(out[:n], want) < 4e-3, bucket  # the same kernel: roundings apart
        assert rel_err(out[:n], reference(shape, real, q, kv)) < 1e-2, bucket


@pytest.mark.parametrize("num_decodes", [3, 12])
def test_eager_mixed_steps_pick_the_decode_kernel_by_count(num_decodes):
    g, shape, kv = setup(32, 8, 128, seed=num_decodes)
    attn = FlashInferPagedAttention(shape, torch.bfloat16, CUDA, MAX_PAGES, (), DecodeKernels(8))
    starts = torch.randint(1, 500, (num_decodes,), generator=g).tolist()
    batch = batch_of([*starts, 40, 0], [1] * num_decodes + [33, 70], g)
    q = torch.randn(batch.num_tokens, 32, 128, generator=g).bfloat16().to(CUDA)
    attn.plan(batch)
    (decode, _, rows), (_, start, _) = attn._active
    assert rows == num_decodes and start == num_decodes
    assert decode.use_tensor_cores == (num_decodes >= 8)
    assert rel_err(attn.attend(q, kv), reference(shape, batch, q, kv)) < 1e-2
