"""Time the quantized GEMMs (`core.kernels.quant_gemm`) and the quantized fused MoE against
bf16 at Kimi-K2's and Qwen3-8B's shapes, on one GPU.

    python benchmarks/quant_gemm.py --rows 1,16,64,512,4096 --out quant_gemm.json

Random weights in each format; `triton.testing.do_bench` (L2 flushed between calls). Each row:
the time of the dispatching layer (`QuantLinear`: weight-only below 64 rows, FP8 x FP8 from
there on) and of torch's bf16 matmul on the dequantized weight, the weight bytes read per
microsecond (the decode yardstick: HBM bandwidth) and the TFLOP/s (prefill's).
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from pegainfer.core.moe.experts import QuantizedExpertWeights
from pegainfer.core.moe.routing import Routing, route
from pegainfer.core.quant.linear import QuantLinear
from pegainfer.core.quant.random import random_quantized
from pegainfer.core.quant.scheme import Fp8Block, Int4Group

# (N, K) of each linear layer; Kimi-K2's routed experts: 384 of width 2048, top-8, hidden 7168.
SHAPES = {
    "kimi-k2": {"q_kv_a": (2112, 7168), "q_b": (12288, 1536), "kv_b": (16384, 512),
                "o_proj": (7168, 8192), "mlp_gate_up": (36864, 7168), "mlp_down": (7168, 18432),
                "shared_gate_up": (4096, 7168), "shared_down": (7168, 2048)},
    "qwen3-8b": {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096),
                 "down": (4096, 12288)},
}  # fmt: skip
EXPERTS, TOP_K, HIDDEN, INTER = 384, 8, 7168, 2048
FORMATS = {"fp8": Fp8Block((128, 128)), "int4": Int4Group(32)}


def random_layer(fmt, n: int, k: int, g: torch.Generator) -> QuantLinear:
    with torch.device("meta"):
        layer = QuantLinear(n, k, fmt)
    for part, value in zip(fmt.parts, random_quantized(fmt, (n, k), k**-0.5, g, "cuda"),
                           strict=True):  # fmt: skip
        setattr(layer, part.suffix, torch.nn.Parameter(value, requires_grad=False))
    return layer


def dense_rows(rows: list[int]) -> list[dict]:
    out, g = [], torch.Generator("cuda").manual_seed(0)
    for model, shapes in SHAPES.items():
        for name, (n, k) in shapes.items():
            for fmt_name, fmt in FORMATS.items():
                layer = random_layer(fmt, n, k, g)
                weight = layer.dequantize(torch.bfloat16)
                stored = sum(t.numel() * t.element_size() for t in layer.stored())
                for m in rows:
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    ours = do_bench(lambda x=x, layer=layer: layer(x), warmup=5, rep=30) * 1e3
                    bf16 = do_bench(lambda x=x, w=weight: x @ w.T, warmup=5, rep=30) * 1e3
                    out.append({"model": model, "layer": name, "n": n, "k": k, "format": fmt_name,
                                "rows": m, "us": ours, "bf16_us": bf16,
                                "weight_gb_per_s": stored / ours / 1e3,
                                "tflops": 2 * m * n * k / ours / 1e6})  # fmt: skip
                    print(out[-1], flush=True)
                del layer, weight
    return out


def moe_rows(rows: list[int]) -> list[dict]:
    out, g = [], torch.Generator("cuda").manual_seed(1)
    for fmt_name, fmt in FORMATS.items():
        gate_up = random_quantized(fmt, (EXPERTS, 2 * INTER, HIDDEN), HIDDEN**-0.5, g, "cuda")
        down = random_quantized(fmt, (EXPERTS, HIDDEN, INTER), INTER**-0.5, g, "cuda")
        bank = QuantizedExpertWeights(gate_up[0], down[0], gate_up_scale=gate_up[1],
                                      down_scale=down[1], fmt=fmt)  # fmt: skip
        gate = torch.randn(EXPERTS, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.1
        for m in rows:
            x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
            weights, experts = route(x, gate, Routing(EXPERTS, TOP_K))
            experts = experts.int()
            us = do_bench(lambda x=x, w=weights, e=experts, b=bank: b.apply(x, w, e), warmup=5,
                          rep=30) * 1e3  # fmt: skip
            out.append({"model": "kimi-k2", "layer": "routed_experts", "format": fmt_name,
                        "rows": m, "us": us,
                        "experts_hit": int(experts.unique().numel())})  # fmt: skip
            print(out[-1], flush=True)
        del bank, gate_up, down
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,16,64,512,4096")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    with open(args.out, "w") as f:
        json.dump({"dense": dense_rows(rows), "moe": moe_rows(rows)}, f, indent=1)


if __name__ == "__main__":
    main()
