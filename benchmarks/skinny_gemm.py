"""The decode GEMMs of Qwen3-4B/8B at 1-16 rows: cuBLAS (`F.linear`) against `skinny_gemm`.

    python benchmarks/skinny_gemm.py --out skinny.json [--sweep]

Each timing replays a CUDA graph of calls that cycle through enough copies of the weight to
overflow the L2 cache, as a decode step's layers do, and reports bandwidth over the measured
device-copy bandwidth. `--sweep` also times a grid of kernel configurations and reports the
best per shape, to tune `default_config`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch
import torch.nn.functional as F

from pegainfer.core.kernels.skinny_gemm import SkinnyConfig, default_config, skinny_gemm
from pegainfer.server.bench.report import git_revision

SHAPES = {  # name: (N, K)
    "4b.qkv": (6144, 2560), "4b.o": (2560, 4096), "4b.gate_up": (19456, 2560),
    "4b.down": (2560, 9728), "8b.qkv": (6144, 4096), "8b.o": (4096, 4096),
    "8b.gate_up": (24576, 4096), "8b.down": (4096, 12288),
}  # fmt: skip
ROWS = (1, 2, 4, 8, 16)
L2_FLUSH_BYTES = 256 << 20


def graph_time(fn, copies: int, reps: int = 5) -> float:
    """Median seconds per call of `fn(i)` for i over the weight copies, replayed in a graph."""
    for i in range(copies):
        fn(i)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / copies)
    return statistics.median(times)


def copy_bandwidth() -> float:
    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / graph_time(lambda _: dst.copy_(src), 4)


def sweep_configs() -> list[SkinnyConfig]:
    return [
        SkinnyConfig(bn, bk, sk, w, st)
        for bn, bk, sk, w, st in itertools.product(
            (16, 32, 64), (128, 256, 512), (1, 2, 4, 8), (4, 8), (2, 3, 4)
        )
    ]


def measure_shape(n: int, k: int, bandwidth: float, sweep: bool) -> list[dict]:
    weight_bytes = n * k * 2
    copies = max(2, -(-L2_FLUSH_BYTES // weight_bytes))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
               for _ in range(copies)]  # fmt: skip
    rows = []
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x.float(), weights[0].float())
        rel = ((skinny_gemm(x, weights[0]).float() - ref).norm() / ref.norm()).item()
        cublas = graph_time(lambda i, x=x: F.linear(x, weights[i]), copies)
        skinny = graph_time(lambda i, x=x: skinny_gemm(x, weights[i]), copies)
        row = {
            "n": n, "k": k, "rows": m, "rel_err_vs_fp32": rel,
            "cublas_us": cublas * 1e6, "skinny_us": skinny * 1e6,
            "cublas_of_copy_bw": weight_bytes / cublas / bandwidth,
            "skinny_of_copy_bw": weight_bytes / skinny / bandwidth,
            "default_config": default_config(n, k).__dict__,
        }  # fmt: skip
        if sweep and m in (1, 8):
            best = None
            for cfg in sweep_configs():
                try:
                    t = graph_time(lambda i, x=x, cfg=cfg: skinny_gemm(x, weights[i], cfg),
                                   copies, reps=3)  # fmt: skip
                except Exception:  # a config out of shared memory or registers
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg)
            if best is not None:
                row["best_us"] = best[0] * 1e6
                row["best_of_copy_bw"] = weight_bytes / best[0] / bandwidth
                row["best_config"] = best[1].__dict__
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--revision", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    results = []
    for name, (n, k) in SHAPES.items():
        results += [{"shape": name} | row for row in measure_shape(n, k, bandwidth, args.sweep)]
        torch.cuda.empty_cache()
    out = {
        "revision": args.revision or git_revision(),
        "device": torch.cuda.get_device_name(),
        "copy_bandwidth_gbps": bandwidth / 1e9,
        "results": results,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
