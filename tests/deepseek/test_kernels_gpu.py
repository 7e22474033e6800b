"""DeepSeek's fused MoE against the reference MoE (CUDA; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.models.deepseek import ops

pytestmark = pytest.mark.gpu

# DeepSeek-V2-Lite: 64 routed experts of width 1408, 6 per token, hidden 2048.
LITE = {"experts": 64, "top_k": 6, "hidden": 2048, "inter": 1408}
SMALL = {"experts": 8, "top_k": 2, "hidden": 96, "inter": 80}


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


def routed(tokens: int, shape: dict, dtype: torch.dtype, seed: int, device: str = "cuda"):
    """x, routing (softmax top-k over random router logits) and random expert weights."""
    g = torch.Generator(device).manual_seed(seed)
    e, h, i = shape["experts"], shape["hidden"], shape["inter"]
    x = torch.randn(tokens, h, device=device, generator=g).to(dtype)
    gate = torch.randn(e, h, device=device, generator=g) * h**-0.5
    weights, experts = ops.route(x, gate.to(dtype), shape["top_k"], "greedy", 1, 1, 1.0)
    gate_up = (torch.randn(e, 2 * i, h, device=device, generator=g) * h**-0.5).to(dtype)
    down = (torch.randn(e, h, i, device=device, generator=g) * i**-0.5).to(dtype)
    return x, weights, experts, gate_up, down


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
@pytest.mark.parametrize("shape", [LITE, SMALL], ids=["v2-lite", "small"])
def test_fused_moe_equals_the_reference(dtype, tokens, shape):
    from pegainfer.models.deepseek.kernels import fused_moe

    x, weights, experts, gate_up, down = routed(tokens, shape, dtype, seed=tokens)
    ours = fused_moe(x, weights, experts, gate_up, down)
    ref = ops.moe(x.float(), weights, experts, gate_up.float(), down.float())
    assert ours.dtype == dtype
    assert rel_err(ours, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("first", [0, 32])
def test_fused_moe_over_a_range_of_experts(first):
    """Expert parallelism: this rank holds experts first..first+31 of 64; pairs routed to the
    others contribute nothing here."""
    from pegainfer.models.deepseek.kernels import fused_moe

    x, weights, experts, gate_up, down = routed(50, LITE, torch.float32, seed=first)
    mine = slice(first, first + 32)
    ours = fused_moe(x, weights, experts, gate_up[mine], down[mine], first)
    ref = ops.moe(x, weights, experts, gate_up[mine], down[mine], first)
    assert ((experts >= first) & (experts < first + 32)).any(dim=1).sum() > 10
    assert rel_err(ours, ref) < 1e-5


def test_dispatch_groups_each_experts_pairs_in_whole_blocks():
    from pegainfer.models.deepseek.kernels import dispatch

    experts = torch.tensor([[3, 1], [1, 0], [5, 3], [1, 7]], device="cuda")
    sorted_pairs, block_expert = dispatch(experts, first=1, num_experts=4, block_m=2)
    pairs = experts.numel()
    blocks = sorted_pairs.view(-1, 2).tolist()
    got = {}
    for expert, block in zip(block_expert.tolist(), blocks, strict=True):
        if expert >= 0:
            got.setdefault(expert, []).extend(p for p in block if p < pairs)
        else:
            assert block == [pairs, pairs]
    # local experts 0..3 are global 1..4: pairs (flattened token-major) routed to 1 and 3
    assert got == {0: [1, 2, 6], 2: [0, 5]}
