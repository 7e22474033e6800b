"""The MoE's Triton kernels (routing, dispatch, the fused MoE) against the reference ops
(CUDA; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.moe import kernels
from pegainfer.core.moe.experts import moe
from pegainfer.core.moe.routing import Routing, route

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
    weights, experts = route(x, gate.to(dtype), Routing(e, shape["top_k"]))
    gate_up = (torch.randn(e, 2 * i, h, device=device, generator=g) * h**-0.5).to(dtype)
    down = (torch.randn(e, h, i, device=device, generator=g) * i**-0.5).to(dtype)
    return x, weights, experts, gate_up, down


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 7, 64, 300, 1000])
@pytest.mark.parametrize("shape", [LITE, SMALL], ids=["v2-lite", "small"])
def test_fused_moe_equals_the_reference(dtype, tokens, shape):
    x, weights, experts, gate_up, down = routed(tokens, shape, dtype, seed=tokens)
    ours = kernels.fused_moe(x, weights, experts.int(), gate_up, down)  # int32: as `route` gives
    ref = moe(x.float(), weights, experts, gate_up.float(), down.float())
    assert ours.dtype == dtype
    assert rel_err(ours, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("first", [0, 32])
def test_fused_moe_over_a_range_of_experts(first):
    """Expert parallelism: this rank holds experts first..first+31 of 64; pairs routed to the
    others contribute nothing here."""
    x, weights, experts, gate_up, down = routed(50, LITE, torch.float32, seed=first)
    mine = slice(first, first + 32)
    ours = kernels.fused_moe(x, weights, experts, gate_up[mine], down[mine], first)
    ref = moe(x, weights, experts, gate_up[mine], down[mine], first)
    assert ((experts >= first) & (experts < first + 32)).any(dim=1).sum() > 10
    assert rel_err(ours, ref) < 1e-5


def test_dispatch_groups_each_experts_pairs_in_whole_blocks():
    experts = torch.tensor([[3, 1], [1, 0], [5, 3], [1, 7]], device="cuda")
    sorted_pairs, block_expert = kernels.dispatch(experts, first=1, num_experts=4, block_m=2)
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
    x, weights, experts, gate_up, down = routed(tokens, LITE, torch.bfloat16, seed=7)
    shared = torch.randn_like(x)
    ours = kernels.fused_moe(x, weights, experts, gate_up, down, shared=shared)
    ref = kernels.fused_moe(x, weights, experts, gate_up, down) + shared
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("pairs_per_token", [2, 6])
@pytest.mark.parametrize("tokens", [1, 5, 64, 682])
@pytest.mark.parametrize(("first", "held"), [(0, 64), (16, 16)])
def test_dispatch_in_one_program_equals_torchs_sort(monkeypatch, pairs_per_token, tokens, first,
                                                    held):  # fmt: skip
    g = torch.Generator("cuda").manual_seed(tokens)
    experts = torch.rand(tokens, 64, device="cuda", generator=g).topk(pairs_per_token).indices
    block_m = 16 if tokens * pairs_per_token <= 4 * held else 64
    ours = kernels.dispatch(experts.int(), first, held, block_m)
    monkeypatch.setattr(kernels, "_ONE_PROGRAM_PAIRS", 0)
    ref = kernels.dispatch(experts.int(), first, held, block_m)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


@pytest.fixture(params=["one-program", "logits-grid"])
def router_path(request, monkeypatch):
    """Both routing kernels on every shape: one program per token block (small routers), or
    the logits over a grid of expert blocks first (large ones, Kimi-K2's)."""
    limit = 1 << 62 if request.param == "one-program" else 0
    monkeypatch.setattr(kernels, "_ONE_PROGRAM_ROUTER", limit)
    return request.param


@pytest.mark.usefixtures("router_path")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 16, 333])
@pytest.mark.parametrize(("experts", "top_k"), [(64, 6), (160, 6), (8, 2)])
def test_routing_picks_the_references_experts_and_weights(dtype, tokens, experts, top_k):
    g = torch.Generator("cuda").manual_seed(tokens + experts)
    x = torch.randn(tokens, 2048, device="cuda", generator=g).to(dtype)
    gate = (torch.randn(experts, 2048, device="cuda", generator=g) * 0.05).to(dtype)
    routing = Routing(experts, top_k, scaling=1.5)
    ref_w, _ = route(x, gate, routing)
    ours_w, ours_e = kernels.route(x, gate, routing, None)
    # Every expert's reference weight: ours must be a top-k set of them (a near-tie may pick
    # the other of two experts), distinct, and carry those weights.
    scores = torch.nn.functional.linear(x.float(), gate.float()).softmax(dim=-1) * 1.5
    chosen = scores.gather(1, ours_e.long())
    assert (ours_e.sort(dim=1).values.diff(dim=1) > 0).all()
    torch.testing.assert_close(chosen.sort(dim=1, descending=True).values,
                               ref_w.sort(dim=1, descending=True).values)  # fmt: skip
    torch.testing.assert_close(ours_w, chosen, rtol=1e-5, atol=1e-6)


# Kimi-K2: 384 experts, 8 per token, hidden 7168; DeepSeek-V3/GLM-5: 256.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 16, 333])
@pytest.mark.parametrize(("experts", "top_k", "hidden"), [(384, 8, 7168), (256, 8, 6144),
                                                          (8, 2, 96)])  # fmt: skip
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.usefixtures("router_path")
def test_noaux_tc_routing_equals_the_reference(dtype, tokens, experts, top_k, hidden,
                                              normalize):  # fmt: skip
    """Sigmoid scores chosen by score + correction bias, weighed by the plain score."""
    g = torch.Generator("cuda").manual_seed(tokens + experts)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype)
    gate = (torch.randn(experts, hidden, device="cuda", generator=g) * 0.05).to(dtype)
    bias = torch.randn(experts, device="cuda", generator=g) * 0.1
    routing = Routing(experts, top_k, "sigmoid", "noaux_tc", normalize=normalize, scaling=2.827)
    ref_w, ref_e = route(x, gate, routing, bias)
    ours_w, ours_e = kernels.route(x, gate, routing, bias)
    scores = torch.nn.functional.linear(x.float(), gate.float()).sigmoid()
    choice = scores + bias
    # Ours must be a top-k set by the biased score (a near-tie may swap two experts) ...
    assert (ours_e.sort(dim=1).values.diff(dim=1) > 0).all()
    torch.testing.assert_close(choice.gather(1, ours_e.long()).sort(dim=1).values,
                               choice.gather(1, ref_e).sort(dim=1).values)  # fmt: skip
    # ... weighed by the unbiased scores, renormalised over the chosen set when asked.
    chosen = scores.gather(1, ours_e.long())
    if normalize:
        chosen = chosen / chosen.sum(dim=1, keepdim=True)
    torch.testing.assert_close(ours_w, chosen * 2.827, rtol=1e-5, atol=1e-6)
    agree = (ours_e.long().sort(dim=1).values == ref_e.sort(dim=1).values).all(dim=1)
    assert agree.float().mean() > 0.9
    torch.testing.assert_close(ours_w.sort(dim=1).values[agree], ref_w.sort(dim=1).values[agree],
                               rtol=1e-5, atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_fused_moe_at_kimis_widths(tokens):
    """Kimi-K2's routed experts (hidden 7168, width 2048), 48 of them held (one EP8 rank's)."""
    shape = {"experts": 48, "top_k": 8, "hidden": 7168, "inter": 2048}
    x, weights, experts, gate_up, down = routed(tokens, shape, torch.bfloat16, seed=tokens)
    ours = kernels.fused_moe(x, weights, experts.int(), gate_up, down)
    ref = moe(x.float(), weights, experts, gate_up.float(), down.float())
    assert rel_err(ours, ref) < 1e-2


# DeepSeek-V3's grouped noaux_tc (256 experts in 8 groups, the best 4 kept) and DeepSeek-V2's
# group-limited greedy (160 experts in 8 groups, the best 3 kept).
@pytest.mark.usefixtures("router_path")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 16, 333])
@pytest.mark.parametrize(("scoring", "method", "experts", "top_k", "hidden", "topk_group"), [
    ("sigmoid", "noaux_tc", 256, 8, 7168, 4), ("softmax", "group_limited_greedy", 160, 6, 5120, 3),
])  # fmt: skip
def test_grouped_routing_equals_the_reference(dtype, tokens, scoring, method, experts, top_k,
                                              hidden, topk_group):  # fmt: skip
    g = torch.Generator("cuda").manual_seed(tokens + experts)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype)
    gate = (torch.randn(experts, hidden, device="cuda", generator=g) * 0.05).to(dtype)
    bias = torch.randn(experts, device="cuda", generator=g) * 0.1 if scoring == "sigmoid" else None
    routing = Routing(experts, top_k, scoring, method, 8, topk_group,
                      normalize=scoring == "sigmoid", scaling=2.5)  # fmt: skip
    ref_w, ref_e = route(x, gate, routing, bias)
    ours_w, ours_e = kernels.route(x, gate, routing, bias)
    assert (ours_e.sort(dim=1).values.diff(dim=1) > 0).all()
    agree = (ours_e.long().sort(dim=1).values == ref_e.sort(dim=1).values).all(dim=1)
    assert agree.float().mean() > 0.9  # a near-tie may swap an expert or a group
    torch.testing.assert_close(ours_w.sort(dim=1).values[agree], ref_w.sort(dim=1).values[agree],
                               rtol=1e-5, atol=1e-6)  # fmt: skip
