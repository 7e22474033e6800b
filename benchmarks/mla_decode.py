"""Time MLA's absorbed decode attention (`FlashInferPagedLatentAttention`) per FlashInfer
backend, batch size, context and head count, on one GPU.

    python benchmarks/mla_decode.py --backends fa2,fa3 --heads 16,128 --batches 1,8,32,64 \\
        --contexts 1024,4096 --out mla_decode.json

Random latents (512) and rope keys (64) in bf16 over scattered 16-token blocks; each row is
one layer's call, timed as 20 calls captured in a CUDA graph (no host time), median of 5
replays, beside the bytes of latents it reads. FA3's MLA kernels JIT-compile on first use
(minutes).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from pegainfer.core.attention.latent import FlashInferPagedLatentAttention, LatentShape
from pegainfer.core.runner.forward_batch import ForwardBatch

LATENT, ROPE, BLOCK, CALLS = 512, 64, 16, 20


def time_decode(backend: str, heads: int, batch: int, context: int) -> float:
    """Microseconds per call."""
    device = torch.device("cuda")
    pages = -(-(context + 1) // BLOCK)
    ckv = torch.randn(batch * pages + 1, BLOCK, LATENT, device=device, dtype=torch.bfloat16)
    kpe = torch.randn(batch * pages + 1, BLOCK, ROPE, device=device, dtype=torch.bfloat16)
    order = torch.randperm(batch * pages).tolist()
    tables = [order[i * pages : (i + 1) * pages] for i in range(batch)]
    step = ForwardBatch.build([[0]] * batch, [context] * batch, tables, [True] * batch, BLOCK,
                              device)  # fmt: skip
    shape = LatentShape(heads, LATENT, ROPE, 128, 128, scale=192**-0.5)
    attn = FlashInferPagedLatentAttention(shape, torch.bfloat16, device, pages, backend=backend)
    q_latent = torch.randn(batch, heads, LATENT, device=device, dtype=torch.bfloat16) * 0.05
    q_pe = torch.randn(batch, heads, ROPE, device=device, dtype=torch.bfloat16) * 0.05
    attn.plan(step)
    attn.run(q_latent, q_pe, ckv, kpe)  # warm-up (and JIT) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            attn.run(q_latent, q_pe, ckv, kpe)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="fa2,fa3")
    parser.add_argument("--heads", default="16,128")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for backend in args.backends.split(","):
        for heads in map(int, args.heads.split(",")):
            for batch in map(int, args.batches.split(",")):
                for context in map(int, args.contexts.split(",")):
                    us = time_decode(backend, heads, batch, context)
                    read = batch * (context + 1) * (LATENT + ROPE) * 2
                    rows.append({"backend": backend, "heads": heads, "batch": batch,
                                 "context": context, "us_per_call": us,
                                 "latent_bytes": read, "GBps": read / us / 1e3})  # fmt: skip
                    print(rows[-1], flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
