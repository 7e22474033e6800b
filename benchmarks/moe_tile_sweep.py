"""Time the fused MoE's two GEMM kernels over tile configurations at one shape, on one GPU.

    python benchmarks/moe_tile_sweep.py --tokens 1,8,64 --out sweep.json

Random routing and weights at the shape of `--experts/--top-k/--hidden/--inter` (default:
DeepSeek-V2-Lite); `triton.testing.do_bench` (L2 flushed between calls). Prints the best
configuration per token count and row-block height; the JSON has every row.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
from triton.testing import do_bench

from pegainfer.core.moe import kernels as moe_kernels

CONFIGS = list(itertools.product((32, 64, 128), (64, 128), (4, 8), (3, 4)))


def sweep(tokens: int, block_m: int, args: argparse.Namespace) -> list[dict]:
    e, h, i, k = args.experts, args.hidden, args.inter, args.top_k
    dev, dtype = "cuda", torch.bfloat16
    gate_up = torch.randn(e, 2 * i, h, device=dev, dtype=dtype) * h**-0.5
    down = torch.randn(e, h, i, device=dev, dtype=dtype) * i**-0.5
    x = torch.randn(tokens, h, device=dev, dtype=dtype)
    experts = torch.rand(tokens, e, device=dev).topk(k).indices.int()
    weights = torch.rand(tokens, k, device=dev)
    pairs = tokens * k
    sorted_pairs, block_expert = moe_kernels.dispatch(experts, 0, e, block_m)
    hidden = torch.empty(pairs, i, device=dev, dtype=dtype)
    out = torch.empty(pairs, h, device=dev, dtype=torch.float32)
    rows = []
    for bn, bk, warps, stages in CONFIGS:
        # Plain bf16 experts: the scale arguments are never read.
        tiles = dict(QUANT=0, SCALE_ROWS=1, SCALE_COLS=1, BLOCK_M=block_m, BLOCK_N=bn,
                     BLOCK_K=bk, IEEE=False, num_warps=warps, num_stages=stages)  # fmt: skip

        def gate_up_call(bn=bn, tiles=tiles):
            moe_kernels._gate_up_kernel[(block_expert.numel(), triton.cdiv(i, bn))](
                x, gate_up, gate_up, hidden, sorted_pairs, block_expert, pairs, k, h, i,
                x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up.stride(0),
                gate_up.stride(1), hidden.stride(0), **tiles,
            )  # fmt: skip

        def down_call(bn=bn, tiles=tiles):
            moe_kernels._down_kernel[(block_expert.numel(), triton.cdiv(h, bn))](
                hidden, down, down, out, sorted_pairs, block_expert, weights, pairs, h, i,
                hidden.stride(0), down.stride(0), down.stride(1), down.stride(0), down.stride(1),
                out.stride(0), **tiles,
            )  # fmt: skip

        rows.append({"tokens": tokens, "block_m": block_m, "block_n": bn, "block_k": bk,
                     "warps": warps, "stages": stages,
                     "gate_up_us": do_bench(gate_up_call, warmup=5, rep=30) * 1e3,
                     "down_us": do_bench(down_call, warmup=5, rep=30) * 1e3})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1,8,64")
    parser.add_argument("--block-m", default="16,64", help="row-block heights to try")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=1408)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for tokens in map(int, args.tokens.split(",")):
        for block_m in map(int, args.block_m.split(",")):
            mine = sweep(tokens, block_m, args)
            rows += mine
            best = min(mine, key=lambda r: r["gate_up_us"] + r["down_us"])
            print({"tokens": tokens, "best": best}, flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
