"""FlashInfer's two prefill kernel families (`FlashInferPagedAttention(prefill_backend=...)`:
FA2, what the engine runs, and Hopper's FA3) each agree with the torch reference on prefill
chunks over cached prefixes and on a mixed step's prefill rows beside decodes, at Qwen3's and
Qwen3.5's full-attention geometries (CUDA; FA3 on compute capability 9.0 only)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.attention.paged import FlashInferPagedAttention
from tests.core.test_decode_kernels_gpu import reference, setup
from tests.core.test_plan_buffers_gpu import CUDA, MAX_PAGES, batch_of, rel_err

pytestmark = pytest.mark.gpu

# (heads, KV heads, head_dim): Qwen3-4B/8B, Qwen3.5-4B's full attention.
GEOMETRIES = [(32, 8, 128), (16, 4, 256)]
# (starts, chunks): a fresh prompt; chunks after cached prefixes of several lengths (one not
# a block multiple); decodes first, then prefill rows, as the scheduler orders a mixed step.
STEPS = {
    "fresh": ([0], [300]),
    "after_prefix": ([0, 64, 333], [90, 200, 57]),
    "mixed": ([40, 129, 7, 0, 250], [1, 1, 1, 120, 33]),
}


def fa3_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_each_prefill_backend_equals_the_reference(geometry, step, backend):
    if backend == "fa3" and not fa3_available():
        pytest.skip("FlashInfer's FA3 kernels need compute capability 9.0")
    g, shape, kv = setup(*geometry, seed=sorted(STEPS).index(step))
    starts, chunks = STEPS[step]
    batch = batch_of(starts, chunks, g)
    rows = sum(chunks)
    q = torch.randn(rows, shape.num_heads, shape.head_dim, generator=g).bfloat16().to(CUDA)
    attn = FlashInferPagedAttention(shape, torch.bfloat16, CUDA, MAX_PAGES, (),
                                    prefill_backend=backend)  # fmt: skip
    attn.plan(batch)
    out = torch.empty_like(q)
    attn.attend(q, kv, out)
    assert rel_err(out, reference(shape, batch, q, kv)) < 1e-2
