"""The Gated DeltaNet Triton kernels against the torch reference ops (CUDA; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.models.qwen35 import ops

pytestmark = pytest.mark.gpu


def batch_of(lengths: list[int], slots: list[int], device: str) -> tuple[torch.Tensor, ...]:
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return bounds.to(device), torch.tensor(slots, dtype=torch.int32, device=device)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lengths", "channels"), [([1, 1, 1], 8192), ([5, 1, 40], 384)])
def test_causal_conv1d(dtype, lengths, channels, device="cuda"):
    from pegainfer.models.qwen35.kernels import causal_conv1d

    g = torch.Generator(device).manual_seed(channels)
    x = torch.randn(sum(lengths), channels, device=device, generator=g).to(dtype)
    weight = (torch.randn(channels, 4, device=device, generator=g) * 0.5).to(dtype)
    states = torch.randn(6, channels, 3, device=device, generator=g)
    slots = [4, 0, 2]
    bounds, slot_t = batch_of(lengths, slots, device)
    expected_states = states.clone()
    out = causal_conv1d(x, weight, states, slot_t, bounds)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for i, slot in enumerate(slots):
        rows = slice(int(bounds[i]), int(bounds[i + 1]))
        ref, expected_states[slot] = ops.causal_conv1d(x[rows], weight, expected_states[slot])
        assert rel_err(out[rows], ref) < tol
    assert rel_err(states, expected_states) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("lengths", "key_heads", "value_heads", "dim"),
    [([1, 1, 1, 1], 16, 32, 128), ([3, 1, 17], 2, 4, 64)],
)
def test_recurrent_gated_delta_rule(dtype, lengths, key_heads, value_heads, dim, device="cuda"):
    from pegainfer.models.qwen35.kernels import recurrent_gated_delta_rule

    g = torch.Generator(device).manual_seed(dim + len(lengths))
    tokens, key_dim = sum(lengths), key_heads * dim
    qkv = torch.randn(tokens, 2 * key_dim + value_heads * dim, device=device, generator=g)
    qkv = qkv.to(dtype)
    decay = -torch.rand(tokens, value_heads, device=device, generator=g)
    beta = torch.rand(tokens, value_heads, device=device, generator=g).to(dtype)
    states = torch.randn(5, value_heads, dim, dim, device=device, generator=g) * 0.1
    slots = list(range(len(lengths)))[::-1]
    bounds, slot_t = batch_of(lengths, slots, device)
    expected_states = states.clone()
    out = recurrent_gated_delta_rule(qkv, decay, beta, states, slot_t, bounds, key_heads, dim)
    group = value_heads // key_heads
    for i, slot in enumerate(slots):
        rows = slice(int(bounds[i]), int(bounds[i + 1]))
        n = rows.stop - rows.start
        q, k, v = qkv[rows].float().split([key_dim, key_dim, value_heads * dim], dim=-1)
        q = ops.l2_normalize(q.view(n, key_heads, dim)).repeat_interleave(group, dim=1)
        k = ops.l2_normalize(k.view(n, key_heads, dim)).repeat_interleave(group, dim=1)
        ref, expected_states[slot] = ops.recurrent_gated_delta_rule(
            q * dim**-0.5, k, v.view(n, value_heads, dim), decay[rows], beta[rows].float(),
            expected_states[slot],
        )  # fmt: skip
        assert rel_err(out[rows], ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel_err(states, expected_states) < 1e-5
