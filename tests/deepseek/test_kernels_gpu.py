"""DeepSeek's Triton kernels (MLA's attention input, routing, dispatch, the fused MoE)
against the reference ops (CUDA; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.models.deepseek import ops
from pegainfer.models.deepseek.config import Rope

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
@pytest.mark.parametrize("tokens", [1, 7, 64, 300, 1000])
@pytest.mark.parametrize("shape", [LITE, SMALL], ids=["v2-lite", "small"])
def test_fused_moe_equals_the_reference(dtype, tokens, shape):
    from pegainfer.models.deepseek.moe_kernels import fused_moe

    x, weights, experts, gate_up, down = routed(tokens, shape, dtype, seed=tokens)
    ours = fused_moe(x, weights, experts.int(), gate_up, down)  # int32: as `route` gives
    ref = ops.moe(x.float(), weights, experts, gate_up.float(), down.float())
    assert ours.dtype == dtype
    assert rel_err(ours, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("first", [0, 32])
def test_fused_moe_over_a_range_of_experts(first):
    """Expert parallelism: this rank holds experts first..first+31 of 64; pairs routed to the
    others contribute nothing here."""
    from pegainfer.models.deepseek.moe_kernels import fused_moe

    x, weights, experts, gate_up, down = routed(50, LITE, torch.float32, seed=first)
    mine = slice(first, first + 32)
    ours = fused_moe(x, weights, experts, gate_up[mine], down[mine], first)
    ref = ops.moe(x, weights, experts, gate_up[mine], down[mine], first)
    assert ((experts >= first) & (experts < first + 32)).any(dim=1).sum() > 10
    assert rel_err(ours, ref) < 1e-5


def test_dispatch_groups_each_experts_pairs_in_whole_blocks():
    from pegainfer.models.deepseek.moe_kernels import dispatch

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


@pytest.mark.parametrize("tokens", [1, 300])
def test_fused_moe_adds_the_shared_output_as_a_separate_bf16_add_would(tokens):
    from pegainfer.models.deepseek.moe_kernels import fused_moe

    x, weights, experts, gate_up, down = routed(tokens, LITE, torch.bfloat16, seed=7)
    shared = torch.randn_like(x)
    ours = fused_moe(x, weights, experts, gate_up, down, shared=shared)
    ref = fused_moe(x, weights, experts, gate_up, down) + shared
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("pairs_per_token", [2, 6])
@pytest.mark.parametrize("tokens", [1, 5, 64, 682])
@pytest.mark.parametrize(("first", "held"), [(0, 64), (16, 16)])
def test_dispatch_in_one_program_equals_torchs_sort(monkeypatch, pairs_per_token, tokens, first,
                                                    held):  # fmt: skip
    from pegainfer.models.deepseek import moe_kernels

    g = torch.Generator("cuda").manual_seed(tokens)
    experts = torch.rand(tokens, 64, device="cuda", generator=g).topk(pairs_per_token).indices
    block_m = 16 if tokens * pairs_per_token <= 4 * held else 64
    ours = moe_kernels.dispatch(experts.int(), first, held, block_m)
    monkeypatch.setattr(moe_kernels, "_ONE_PROGRAM_PAIRS", 0)
    ref = moe_kernels.dispatch(experts.int(), first, held, block_m)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 16, 333])
@pytest.mark.parametrize(("experts", "top_k"), [(64, 6), (160, 6), (8, 2)])
def test_routing_picks_the_references_experts_and_weights(dtype, tokens, experts, top_k):
    from pegainfer.models.deepseek.moe_kernels import route

    g = torch.Generator("cuda").manual_seed(tokens + experts)
    x = torch.randn(tokens, 2048, device="cuda", generator=g).to(dtype)
    gate = (torch.randn(experts, 2048, device="cuda", generator=g) * 0.05).to(dtype)
    ref_w, _ = ops.route(x, gate, top_k, "greedy", 1, 1, 1.5)
    ours_w, ours_e = route(x, gate, top_k, 1.5)
    # Every expert's reference weight: ours must be a top-k set of them (a near-tie may pick
    # the other of two experts), distinct, and carry those weights.
    scores = torch.nn.functional.linear(x.float(), gate.float()).softmax(dim=-1) * 1.5
    chosen = scores.gather(1, ours_e.long())
    assert (ours_e.sort(dim=1).values.diff(dim=1) > 0).all()
    torch.testing.assert_close(chosen.sort(dim=1, descending=True).values,
                               ref_w.sort(dim=1, descending=True).values)  # fmt: skip
    torch.testing.assert_close(ours_w, chosen, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("tokens", "heads", "nope", "rope", "latent"),
    [(1, 16, 128, 64, 512), (77, 16, 128, 64, 512), (5, 4, 16, 8, 32)],
)
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused-projection"])
def test_latent_input_equals_the_reference(dtype, tokens, heads, nope, rope, latent, fused):
    """`fused`: q and kv_a are column slices of one projection's output (strided rows), as
    the model passes them."""
    from pegainfer.models.deepseek.latent_kernels import latent_input

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
    tables = ops.InterleavedRope(yarn, 8192, torch.device("cuda"))
    positions = torch.randint(0, 8192, (tokens,), device="cuda", generator=g)
    slots = torch.randperm(64 * 16, device="cuda", generator=g)[:tokens]
    results = []
    for fn in (latent_input, ops.latent_input):
        ckv = torch.zeros(64, 16, latent, dtype=dtype, device="cuda")
        kpe = torch.zeros(64, 16, rope, dtype=dtype, device="cuda")
        q_pe = fn(q, kv_a, norm, tables.cos, tables.sin, positions, slots, ckv, kpe, heads,
                  nope, 1e-6)  # fmt: skip
        results.append((q_pe, ckv, kpe))
    for ours, ref in zip(*results, strict=True):
        # bf16: a rounding step apart at most (float32 sums in another order)
        torch.testing.assert_close(ours, ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-5)  # fmt: skip
