"""The fused MoE on FP8-block and INT4-group experts (`core.moe.kernels`, each weight tile
dequantized in the kernel) against the dequantize-then-bf16 reference, at Kimi-K2's widths
(384 experts, top-8, I 2048, H 7168; one EP8 rank's 48) and at small odd ones (CUDA; skipped
elsewhere)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.moe.experts import QuantizedExpertWeights, moe_by_expert
from pegainfer.core.moe.routing import Routing, route
from pegainfer.core.quant.linear import dequantize
from pegainfer.core.quant.random import random_quantized
from pegainfer.core.quant.scheme import Fp8Block, Int4Group

pytestmark = pytest.mark.gpu

KIMI = {"experts": 384, "top_k": 8, "hidden": 7168, "inter": 2048}
SMALL = {"experts": 8, "top_k": 2, "hidden": 384, "inter": 256}
FORMATS = {"fp8": Fp8Block((128, 128)), "int4": Int4Group(32)}


def rel_err(ours: torch.Tensor, ref_out: torch.Tensor) -> float:
    return ((ours.float() - ref_out.float()).norm() / ref_out.float().norm()).item()


def random_bank(fmt, shape: dict, seed: int, first: int = 0, count: int | None = None):
    g = torch.Generator("cuda").manual_seed(seed)
    count = shape["experts"] if count is None else count
    h, i = shape["hidden"], shape["inter"]
    gate_up, gate_up_scale = random_quantized(fmt, (count, 2 * i, h), h**-0.5, g, "cuda")
    down, down_scale = random_quantized(fmt, (count, h, i), i**-0.5, g, "cuda")
    return QuantizedExpertWeights(gate_up, down, first, gate_up_scale=gate_up_scale,
                                  down_scale=down_scale, fmt=fmt)  # fmt: skip


def routed(tokens: int, shape: dict, seed: int, dtype=torch.bfloat16):
    g = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(tokens, shape["hidden"], device="cuda", generator=g).to(dtype)
    gate = torch.randn(shape["experts"], shape["hidden"], device="cuda", generator=g)
    weights, experts = route(x, gate.to(dtype), Routing(shape["experts"], shape["top_k"]))
    return x, weights, experts.int()


def reference(x, weights, experts, bank: QuantizedExpertWeights) -> torch.Tensor:
    """Each chosen expert dequantized to x's dtype (as the kernel's tiles are), float32 math."""

    def expert(local: int) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up = dequantize(bank.gate_up[local], bank.gate_up_scale[local], bank.fmt, x.dtype)
        down = dequantize(bank.down[local], bank.down_scale[local], bank.fmt, x.dtype)
        return gate_up.float(), down.float()

    return moe_by_expert(x.float(), weights, experts.long(), bank.first, bank.count, expert)


@pytest.fixture(scope="module", params=list(FORMATS))
def kimi_bank(request):
    bank = random_bank(FORMATS[request.param], KIMI, seed=0)
    yield bank
    del bank
    torch.cuda.empty_cache()


@pytest.mark.parametrize("tokens", [1, 4, 64, 512, 4096])
def test_kimi_widths(kimi_bank, tokens):
    x, weights, experts = routed(tokens, KIMI, seed=tokens)
    out = kimi_bank.apply(x, weights, experts)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert rel_err(out, reference(x, weights, experts, kimi_bank)) < 1e-2


@pytest.mark.parametrize("name", list(FORMATS))
def test_one_expert_parallel_ranks_share(name):
    """48 of 384 experts (one EP8 rank's), pairs routed elsewhere contributing nothing."""
    bank = random_bank(FORMATS[name], KIMI, seed=1, first=96, count=48)
    x, weights, experts = routed(256, KIMI, seed=2)
    mine = (experts >= 96) & (experts < 144)
    assert mine.any(dim=1).sum() > 50
    assert rel_err(bank.apply(x, weights, experts), reference(x, weights, experts, bank)) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("name", list(FORMATS))
def test_small_widths_and_float32(name, tokens, dtype):
    bank = random_bank(FORMATS[name], SMALL, seed=tokens)
    x, weights, experts = routed(tokens, SMALL, seed=tokens + 1, dtype=dtype)
    shared = torch.randn_like(x)
    out = bank.apply(x, weights, experts, shared)
    expected = reference(x, weights, experts, bank) + shared.float()
    assert rel_err(out, expected) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
