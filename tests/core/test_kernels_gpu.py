"""Core Triton kernels against their torch references (CUDA; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.ops.activation import silu_and_mul as ref_silu_and_mul
from pegainfer.core.ops.rms_norm import add_rms_norm as ref_add_rms_norm

pytestmark = pytest.mark.gpu


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """‖ours − ref‖ / ‖ref‖ in float32: the bf16 yardstick (one rounding ≈ 4e-3)."""
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 2560), (7, 4096), (300, 2560), (33, 96)])
@pytest.mark.parametrize("first_layer", [True, False])
@pytest.mark.parametrize("zero_centred", [False, True])
def test_add_rms_norm(dtype, tokens, hidden, first_layer, zero_centred):
    from pegainfer.core.kernels.norm import add_rms_norm

    g = torch.Generator("cuda").manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, generator=g)
    residual = None if first_layer else torch.randn_like(x)
    weight = int(not zero_centred) + 0.1 * torch.randn(
        hidden, device="cuda", dtype=dtype, generator=g
    )
    ref_out, ref_res = ref_add_rms_norm(
        x, None if residual is None else residual.clone(), weight, 1e-6, zero_centred
    )
    out, res = add_rms_norm(
        x.clone(), None if residual is None else residual.clone(), weight, 1e-6, zero_centred
    )
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel_err(out, ref_out) < tol
    assert rel_err(res, ref_res) < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("tokens", "width"), [(1, 9728), (64, 12288), (5, 100)])
def test_silu_and_mul(dtype, tokens, width):
    from pegainfer.core.kernels.activation import silu_and_mul

    g = torch.Generator("cuda").manual_seed(width)
    x = torch.randn(tokens, 2 * width, device="cuda", dtype=dtype, generator=g)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel_err(silu_and_mul(x), ref_silu_and_mul(x)) < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize(("layers", "block_shape", "count"),
                         [(36, (16, 8, 128), 28), (3, (4, 5), 1), (2, (16, 576), 9)])  # fmt: skip
def test_copy_blocks_between_an_arena_and_a_staging_buffer(dtype, layers, block_shape, count):
    """Both directions of the host tier's copies: staging [n, layers, ...] seen as
    [layers, n, ...], and an arena [layers, blocks, ...], at shuffled block ids."""
    from pegainfer.core.kernels.block_copy import copy_blocks
    from pegainfer.core.ops.block_copy import copy_blocks as ref_copy_blocks

    g = torch.Generator("cuda").manual_seed(count)

    def random(shape):
        return torch.randint(0, 100, shape, device="cuda", generator=g).to(dtype)

    arena = random((layers, 3 * count + 2, *block_shape))
    stage = random((count, layers, *block_shape))
    blocks = torch.randperm(arena.shape[1], device="cuda", generator=g)[:count]
    positions = torch.randperm(count, device="cuda", generator=g)
    staged = stage.transpose(0, 1)
    for src, src_ids, dst, dst_ids in ((staged, positions, arena, blocks),
                                       (arena, blocks, staged, positions)):  # fmt: skip
        ours, ref = dst.clone(), dst.clone()
        copy_blocks(src, src_ids, ours, dst_ids)
        ref_copy_blocks(src, src_ids, ref, dst_ids)
        assert torch.equal(ours, ref)
        assert not torch.equal(ours, dst)  # the copy changed something
