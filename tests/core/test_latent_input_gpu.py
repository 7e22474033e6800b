"""MLA's attention input in one Triton kernel against the reference op (CUDA; skipped
elsewhere)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.ops.interleaved_rope import InterleavedRope, Rope
from pegainfer.core.ops.latent_input import latent_input as reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("tokens", "heads", "nope", "rope", "latent"),
    [(1, 16, 128, 64, 512), (77, 16, 128, 64, 512), (5, 4, 16, 8, 32), (9, 64, 128, 64, 512)],
)
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused-projection"])
def test_latent_input_equals_the_reference(dtype, tokens, heads, nope, rope, latent, fused):
    """`fused`: q and kv_a are column slices of one projection's output (strided rows), as
    the model passes them."""
    from pegainfer.core.kernels.latent_input import latent_input

    g = torch.Generator("cuda").manual_seed(tokens)
    widths = [heads * (nope + rope), latent + rope]
    if fused:
        q, kv_a = (
            torch.randn(tokens, sum(widths), device="cuda", generator=g)
            .to(dtype)
            .split(widths, dim=-1)
        )
    else:
        q = torch.randn(tokens, widths[0], device="cuda", generator=g).to(dtype)
        kv_a = torch.randn(tokens, widths[1], device="cuda", generator=g).to(dtype)
    norm = (1 + 0.1 * torch.randn(latent, device="cuda", generator=g)).to(dtype)
    yarn = Rope(rope, 10000.0, 40.0, 4096, mscale=0.707, mscale_all_dim=0.707)
    tables = InterleavedRope(yarn, 8192, torch.device("cuda"))
    positions = torch.randint(0, 8192, (tokens,), device="cuda", generator=g)
    slots = torch.randperm(64 * 16, device="cuda", generator=g)[:tokens]
    results = []
    for fn in (latent_input, reference):
        ckv = torch.zeros(64, 16, latent, dtype=dtype, device="cuda")
        kpe = torch.zeros(64, 16, rope, dtype=dtype, device="cuda")
        q_pe = fn(q, kv_a, norm, tables.cos, tables.sin, positions, slots, ckv, kpe, heads,
                  nope, 1e-6)  # fmt: skip
        results.append((q_pe, ckv, kpe))
    for ours, ref in zip(*results, strict=True):
        # bf16: a rounding step apart at most (float32 sums in another order)
        torch.testing.assert_close(ours, ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-5)  # fmt: skip
