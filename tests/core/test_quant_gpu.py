"""The quantized-weight GEMMs (`core.kernels.quant_gemm`) against the torch reference
(`ops.quant`: dequantize, then matmul) on random inputs, at Kimi-K2's real widths and at small
odd ones (CUDA; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pegainfer.core.ops import quant as ref
from pegainfer.core.quant.linear import QuantLinear
from pegainfer.core.quant.random import random_quantized
from pegainfer.core.quant.scheme import Fp8Block, Int4Group

pytestmark = pytest.mark.gpu

# Kimi-K2 (hidden 7168): q_a 1536, kv_a 576 (a partial block), q_a|kv_a fused, q_b 64 x 192,
# kv_b 64 x (128 + 128) from the 512 latent, o_proj, the dense MLP (18432) and the shared
# expert (2048): (N, K).
KIMI = {
    "q_a": (1536, 7168), "kv_a": (576, 7168), "q_kv_a": (2112, 7168), "q_b": (12288, 1536),
    "kv_b": (16384, 512), "o_proj": (7168, 8192), "mlp_gate_up": (36864, 7168),
    "mlp_down": (7168, 18432), "shared_gate_up": (4096, 7168), "shared_down": (7168, 2048),
}  # fmt: skip
SMALL = {"odd": (200, 96), "partial": (333, 384)}


def rel_err(ours: torch.Tensor, ref_out: torch.Tensor) -> float:
    return ((ours.float() - ref_out.float()).norm() / ref_out.float().norm()).item()


def random_layer(fmt, n: int, k: int, seed: int) -> QuantLinear:
    """A layer of random stored weights (FP8: values across e4m3's range; INT4: every bit
    pattern of the packed words) with jittered scales."""
    g = torch.Generator("cuda").manual_seed(seed)
    with torch.device("meta"):
        layer = QuantLinear(n, k, fmt)
    stored = random_quantized(fmt, (n, k), k**-0.5, g, "cuda")
    for part, value in zip(fmt.parts, stored, strict=True):
        setattr(layer, part.suffix, torch.nn.Parameter(value, requires_grad=False))
    return layer


def inputs(m: int, k: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator("cuda").manual_seed(seed)
    return torch.randn(m, k, device="cuda", generator=g).to(dtype)


def dequantized_reference(x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
    """The reference in float32: x times the weight exactly as the model's dtype holds it."""
    return F.linear(x.float(), layer.dequantize(x.dtype).float())


@pytest.mark.parametrize("m", [1, 4, 16, 33, 63])
@pytest.mark.parametrize("shape", list(KIMI.values()) + list(SMALL.values()),
                         ids=list(KIMI) + list(SMALL))  # fmt: skip
@pytest.mark.parametrize("fmt", [Fp8Block((128, 128)), Int4Group(32)], ids=["fp8", "int4"])
def test_weight_only(fmt, shape, m):
    from pegainfer.core.kernels.quant_gemm import weight_only_linear

    n, k = shape
    layer = random_layer(fmt, n, k, seed=n + k)
    x = inputs(m, k, seed=m)
    out = weight_only_linear(x, layer)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert rel_err(out, dequantized_reference(x, layer)) < 5e-3


@pytest.mark.parametrize("fmt", [Fp8Block((32, 48)), Fp8Block((128, 128)), Int4Group(64)],
                         ids=["fp8-32x48", "fp8", "int4-g64"])  # fmt: skip
def test_weight_only_float32_and_other_blocks(fmt):
    from pegainfer.core.kernels.quant_gemm import weight_only_linear

    layer = random_layer(fmt, 333, 384, seed=1)
    x = inputs(5, 384, seed=2, dtype=torch.float32)
    assert rel_err(weight_only_linear(x, layer), dequantized_reference(x, layer)) < 1e-5


@pytest.mark.parametrize(("m", "k"), [(1, 7168), (7, 7168), (300, 1536), (64, 512), (5, 300)])
def test_activation_quantization_is_the_reference(m, k):
    from pegainfer.core.kernels.quant_gemm import quantize_activations

    x = inputs(m, k, seed=k)
    q, scale = quantize_activations(x, 128)
    ref_q, ref_scale = ref.quantize_activations_fp8(x, 128)
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    assert (q.float() != ref_q.float()).float().mean() < 1e-3  # a rare tie of the cast's rounding


@pytest.mark.parametrize("m", [64, 65, 300, 2048])
@pytest.mark.parametrize("shape", list(KIMI.values()) + list(SMALL.values()),
                         ids=list(KIMI) + list(SMALL))  # fmt: skip
def test_fp8_w8a8(shape, m):
    """Against the reference of the same arithmetic (activations quantized as the kernel does,
    float32 matmul): tight; against the plain dequantized matmul: the activations' FP8 error."""
    from pegainfer.core.kernels.quant_gemm import fp8_w8a8_linear

    n, k = shape
    layer = random_layer(Fp8Block((128, 128)), n, k, seed=n * k)
    x = inputs(m, k, seed=m + k)
    out = fp8_w8a8_linear(x, layer)
    q, scale = ref.quantize_activations_fp8(x, 128)
    x_fp8 = q.float() * ref.expand_blocks(scale, m, k, (1, 128))
    exact = F.linear(x_fp8, layer.dequantize(torch.float32))
    assert rel_err(out, exact) < 5e-3
    assert rel_err(out, dequantized_reference(x, layer)) < 4e-2


def test_fp8_w8a8_at_prefill_length():
    from pegainfer.core.kernels.quant_gemm import fp8_w8a8_linear

    layer = random_layer(Fp8Block((128, 128)), *KIMI["mlp_down"], seed=3)
    x = inputs(4096, KIMI["mlp_down"][1], seed=4)
    assert rel_err(fp8_w8a8_linear(x, layer), dequantized_reference(x, layer)) < 4e-2


@pytest.mark.parametrize("rows", [0, 1, 63, 64, 500])
def test_quant_linear_dispatch_and_batch_shapes(rows):
    """The layer's CUDA forward on [.., K] inputs: weight-only below W8A8_MIN_ROWS rows, FP8 x
    FP8 from there on; both close to the reference."""
    from pegainfer.core.kernels.quant_gemm import W8A8_MIN_ROWS

    layer = random_layer(Fp8Block((128, 128)), 576, 7168, seed=5)
    x = inputs(rows, 7168, seed=6).view(1, rows, 7168)
    out = layer(x)
    assert out.shape == (1, rows, 576)
    if rows == 0:
        return
    tol = 4e-2 if rows >= W8A8_MIN_ROWS else 5e-3
    assert rel_err(out[0], dequantized_reference(x[0], layer)) < tol


@pytest.mark.parametrize("fmt", [Fp8Block((128, 128)), Int4Group(32)], ids=["fp8", "int4"])
def test_cuda_graph_replay_equals_eager(fmt):
    layer = random_layer(fmt, 2112, 7168, seed=7)
    x = inputs(8, 7168, seed=8)
    eager = layer(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer(x)
    x.copy_(inputs(8, 7168, seed=9))
    graph.replay()
    assert torch.equal(captured, layer(x))
    assert not torch.equal(captured, eager)
