"""The decode step's kernels at Qwen3 shapes on one GPU, each beside the bytes it must read.

    python benchmarks/decode_kernels.py --shape qwen3-4b --out decode_kernels.json

Attention: FlashInfer's paged decode as the engine replays it (`FlashInferPagedAttention`'s
graph-mode wrapper for one bucket, planned outside the graph), with the tensor-core kernel and
with the CUDA-core kernel, per batch size and context. Each row is one layer's call, timed as
the calls of several layers (each over its own KV, so no layer's KV is still in L2 when it is
read) captured in one CUDA graph; its limit is the layer's KV bytes over the copy rate measured
here (`model_step.copy_bandwidth`).

GEMMs: each linear layer of a decode step (qkv, o, gate_up, down and the LM head) at 1 to 16
rows, with torch.matmul (cuBLAS, what the model runs) and with the Triton GEMV of
`core.kernels.gemv` under its default and a few other tile configurations; timed as calls over
enough weight copies to defeat L2, captured in a CUDA graph; its limit is the weight's bytes
over the copy rate. `gate_up+silu` is the projection and the activation as the model runs them
(cuBLAS, then SiLU-and-mul's kernel) against the gated GEMV, whose epilogue applies it.

Every alternative is checked against its reference first (attention: `ops.paged_attention`;
GEMV: fp32 matmul); a mismatch fails the run after the JSON is written.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from model_step import copy_bandwidth
from triton.runtime.errors import OutOfResources

from pegainfer.core.attention.paged import (
    DecodeKernels,
    FlashInferPagedAttention,
    GQAShape,
    TorchPagedAttention,
)
from pegainfer.core.kernels.activation import silu_and_mul
from pegainfer.core.kernels.gemv import GemvConfig, default_config, gemv
from pegainfer.core.ops.activation import silu_and_mul as ref_silu_and_mul
from pegainfer.core.runner.forward_batch import ForwardBatch
from pegainfer.server.bench.make_checkpoint import SHAPES, VOCAB_SIZE
from pegainfer.server.bench.report import git_revision

BLOCK = 16
#: Bytes a timed graph cycles through, as a multiple of the L2 cache.
L2_MULTIPLE = 4
#: The tolerance of a bf16 kernel against its reference (one rounding is about 4e-3).
TOLERANCE = 2e-2
KERNELS = {"tensor_cores": DecodeKernels(1), "cuda_cores": DecodeKernels(None)}


def replay_time(graph: torch.cuda.CUDAGraph, reps: int = 10) -> float:
    """Median seconds per replay, after a warm-up replay."""
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def captured(calls: Callable[[], None]) -> torch.cuda.CUDAGraph:
    calls()  # compile and settle allocations outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    return graph


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


def copies_past_l2(nbytes: int, most: int) -> int:
    """How many distinct buffers of `nbytes` make a cycle of L2_MULTIPLE times the L2 (2 to
    `most`)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, min(most, math.ceil(L2_MULTIPLE * l2 / nbytes)))


def layer_kv_copies(
    shape: GQAShape, num_blocks: int, num_layers: int, gpu: torch.Generator
) -> list[torch.Tensor]:
    """Random paged KV of `num_blocks` blocks for one layer, in as many copies (at most
    `num_layers`) as a cycle through them needs to defeat L2."""
    layer_bytes = num_blocks * 2 * BLOCK * shape.num_kv_heads * shape.head_dim * 2
    copies = copies_past_l2(layer_bytes, num_layers)
    return [randn(num_blocks, 2, BLOCK, shape.num_kv_heads, shape.head_dim, g=gpu)
            for _ in range(copies)]  # fmt: skip


def decode_batch(batch: int, context: int, num_blocks: int, g: torch.Generator) -> ForwardBatch:
    """`batch` decodes of `context` tokens each (the new one included) over scattered blocks."""
    pages = -(-context // BLOCK)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = [order[i * pages : (i + 1) * pages] for i in range(batch)]
    return ForwardBatch.build([[0]] * batch, [context - 1] * batch, tables, [True] * batch,
                              BLOCK, torch.device("cuda"))  # fmt: skip


def randn(*size: int, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """bf16 normal values drawn on the GPU (`g` is a CUDA generator)."""
    return (torch.randn(*size, generator=g, device="cuda") * scale).bfloat16()


def time_attention(
    cfg: dict, batch: int, context: int, bandwidth: float, g: torch.Generator,
    gpu: torch.Generator,
) -> dict:  # fmt: skip
    shape = GQAShape(cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"])
    device, dtype = torch.device("cuda"), torch.bfloat16
    pages = -(-context // BLOCK)
    num_blocks = batch * pages
    kv = layer_kv_copies(shape, num_blocks, cfg["num_hidden_layers"], gpu)
    layers = len(kv)
    step = decode_batch(batch, context, num_blocks, g)
    q = randn(batch, shape.num_heads, shape.head_dim, g=gpu)
    reference = TorchPagedAttention(shape)
    reference.plan(step)
    want = reference.attend(q, kv[0])
    # The useful bytes: each sequence's `context` tokens of K and V (its last page is partial).
    read = batch * context * 2 * shape.num_kv_heads * shape.head_dim * 2
    row = {"part": "attention", "batch": batch, "context": context, "layers_timed": layers,
           "kv_bytes_per_layer": read, "limit_us": read / bandwidth * 1e6}  # fmt: skip
    for name, kernels in KERNELS.items():
        attn = FlashInferPagedAttention(shape, dtype, device, pages, (batch,), kernels)
        attn.plan_graph(step, batch)
        out = torch.empty_like(q)
        attn.attend(q, kv[0], out)
        row[f"{name}_rel_err"] = rel_err(out, want)
        graph = captured(lambda attn=attn, out=out: [attn.attend(q, kv[i], out)
                                                      for i in range(layers)])  # fmt: skip
        row[f"{name}_us"] = replay_time(graph) / layers * 1e6
        del graph, attn  # before the next kernel's wrapper and graph
    return row


def gemm_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear layer of a decode step (`gate_up+silu`: gate_up with the
    activation after it)."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    inter = cfg["intermediate_size"]
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h),
            "gate_up+silu": (2 * inter, h), "down": (h, inter),
            "lm_head": (VOCAB_SIZE, h)}  # fmt: skip


def parse_config(text: str) -> GemvConfig:
    """BLOCK_NxBLOCK_KxSTAGESxWARPS, e.g. 32x256x4x4."""
    block_n, block_k, stages, warps = (int(v) for v in text.split("x"))
    return GemvConfig(block_n, block_k, stages, warps)


def time_gemm(
    name: str, weights: list[torch.Tensor], rows: int, configs: list[GemvConfig],
    bandwidth: float, gpu: torch.Generator,
) -> dict:  # fmt: skip
    """One layer's GEMM at `rows` rows, over `weights` (copies of one shape)."""
    (n, k), copies = weights[0].shape, len(weights)
    weight_bytes = n * k * 2
    gated = name.endswith("+silu")
    x = randn(rows, k, g=gpu)

    def cublas(w: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, w.T)
        return silu_and_mul(y) if gated else y

    exact = x.float() @ weights[0].float().T
    exact = ref_silu_and_mul(exact) if gated else exact
    row = {"part": "gemm", "layer": name, "n": n, "k": k, "rows": rows,
           "weight_bytes": weight_bytes, "copies_timed": copies,
           "limit_us": weight_bytes / bandwidth * 1e6}  # fmt: skip
    graph = captured(lambda: [cublas(w) for w in weights])
    row["cublas_us"] = replay_time(graph) / copies * 1e6
    row["cublas_rel_err"] = rel_err(cublas(weights[0]), exact)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default = default_config(n // 2 if gated else n, sms, gated)
    row["gemv_default_config"] = "x".join(
        str(v) for v in (default.block_n, default.block_k, default.num_stages, default.num_warps)
    )
    row["gemv"] = {}
    for config in dict.fromkeys([default, *configs]):  # the default first, once
        key = "x".join(str(v) for v in (config.block_n, config.block_k, config.num_stages,
                                          config.num_warps))  # fmt: skip
        try:
            err = rel_err(gemv(x, weights[0], config, gated=gated), exact)
        except OutOfResources as e:  # a tile too large for shared memory: not a candidate
            row["gemv"][key] = {"error": str(e)}
            continue
        graph = captured(lambda config=config: [gemv(x, w, config, gated=gated)
                                                for w in weights])  # fmt: skip
        row["gemv"][key] = {"us": replay_time(graph) / copies * 1e6, "rel_err": err}
        del graph
    return row


def best_gemv(row: dict) -> tuple[str, float]:
    timed = {key: v["us"] for key, v in row["gemv"].items() if "us" in v}
    key = min(timed, key=timed.__getitem__)
    return key, timed[key]


def step_gemms(rows: list[dict], num_layers: int) -> list[dict]:
    """Per row count: a decode step's GEMM time (every layer's four, gate_up with the
    SiLU-and-mul after it, and the LM head once) with cuBLAS, with the GEMV's default
    configuration and with its best per layer, beside the weights' byte limit."""
    totals = []
    gemms = [r for r in rows if r["part"] == "gemm"]
    for count in sorted({r["rows"] for r in gemms}):
        of = [r for r in gemms if r["rows"] == count]
        if not {"qkv", "o", "gate_up+silu", "down", "lm_head"} <= {r["layer"] for r in of}:
            continue
        of = [r for r in of if r["layer"] != "gate_up"]  # counted with its activation
        times = {"cublas": 0.0, "gemv_default": 0.0, "gemv_best": 0.0, "limit": 0.0}
        for r in of:
            layers = 1 if r["layer"] == "lm_head" else num_layers
            times["cublas"] += layers * r["cublas_us"]
            default = r["gemv"][r["gemv_default_config"]]
            times["gemv_default"] += layers * default.get("us", math.nan)
            times["gemv_best"] += layers * best_gemv(r)[1]
            times["limit"] += layers * r["limit_us"]
        totals.append({"rows": count} | {f"{k}_ms": v / 1e3 for k, v in times.items()})
    return totals


def tensor_cores_from(rows: list[dict]) -> dict[int, int | None]:
    """Per context: the smallest batch timed from which the tensor-core kernel is as fast as
    the CUDA-core one at every larger batch timed (None: at none), the measured counterpart of
    `DECODE_TENSOR_CORES_FROM`."""
    crossover = {}
    for context in sorted({r["context"] for r in rows if r["part"] == "attention"}):
        timed = sorted((r["batch"], r["tensor_cores_us"] <= r["cuda_cores_us"]) for r in rows
                       if r["part"] == "attention" and r["context"] == context)  # fmt: skip
        crossover[context] = None
        for batch, faster in reversed(timed):
            if not faster:
                break
            crossover[context] = batch
    return crossover


def print_tables(rows: list[dict], totals: list[dict], num_layers: int) -> None:
    print("\nAttention, one layer (us; limit = the layer's KV bytes at the copy rate)")
    print(f"{'context':>7} {'batch':>5} {'tensor':>8} {'cuda':>8} {'limit':>8} "
          f"{'tc/limit':>8} {'cc/limit':>8}  step ms tc / cc")  # fmt: skip
    for r in rows:
        if r["part"] == "attention":
            tc, cc, lim = r["tensor_cores_us"], r["cuda_cores_us"], r["limit_us"]
            print(f"{r['context']:>7} {r['batch']:>5} {tc:8.1f} {cc:8.1f} {lim:8.1f} "
                  f"{lim / tc:8.0%} {lim / cc:8.0%}  "
                  f"{tc * num_layers / 1e3:.3f} / {cc * num_layers / 1e3:.3f}")  # fmt: skip
    for context, batch in tensor_cores_from(rows).items():
        print(f"context {context}: tensor cores as fast from batch {batch} on")
    print("\nGEMMs (us; limit = the weight's bytes at the copy rate)")
    print(f"{'layer':>12} {'rows':>4} {'cuBLAS':>8} {'gemv':>8} {'best':>8} {'config':>12} "
          f"{'limit':>8} {'cuBLAS/lim':>10} {'best/lim':>8}")  # fmt: skip
    for r in rows:
        if r["part"] == "gemm":
            default = r["gemv"][r["gemv_default_config"]].get("us", math.nan)
            best_key, best = best_gemv(r)
            lim = r["limit_us"]
            print(f"{r['layer']:>12} {r['rows']:>4} {r['cublas_us']:8.1f} {default:8.1f} "
                  f"{best:8.1f} {best_key:>12} {lim:8.1f} {lim / r['cublas_us']:10.0%} "
                  f"{lim / best:8.0%}")  # fmt: skip
    print(
        "\nA decode step's GEMMs (ms; each layer's four, gate_up with its activation, the LM head "
        "once)"
    )
    print(f"{'rows':>4} {'cuBLAS':>8} {'gemv':>8} {'best':>8} {'limit':>8}")
    for t in totals:
        print(f"{t['rows']:>4} {t['cublas_ms']:8.3f} {t['gemv_default_ms']:8.3f} "
              f"{t['gemv_best_ms']:8.3f} {t['limit_ms']:8.3f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--gemm-rows", default="1,2,4,8,16")
    parser.add_argument(
        "--gemv-configs",
        default="16x128x4x4,16x256x4x4,16x512x3x4,32x256x4x4,32x512x3x4,64x256x3x4,64x128x4x4",
        help="Triton GEMV tile configurations timed beside the default, "
        "BLOCK_NxBLOCK_KxSTAGESxWARPS each",
    )  # fmt: skip
    parser.add_argument("--parts", default="attention,gemm", help="attention, gemm or both")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--revision", default=None, help="git revision measured (default: `git rev-parse HEAD`)"
    )
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not parts <= {"attention", "gemm"}:
        parser.error(f"--parts takes attention and gemm, got {args.parts}")
    cfg = SHAPES[args.shape]
    bandwidth = copy_bandwidth()
    torch.cuda.empty_cache()  # the copy's 8 GiB
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    g = torch.Generator().manual_seed(0)  # block tables
    gpu = torch.Generator("cuda").manual_seed(0)  # values
    rows = []
    if "attention" in parts:
        for context in (int(c) for c in args.contexts.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                rows.append(time_attention(cfg, batch, context, bandwidth, g, gpu))
                print(rows[-1], flush=True)
                torch.cuda.empty_cache()
    if "gemm" in parts:
        configs = [parse_config(c) for c in args.gemv_configs.split(",") if c]
        for name, (n, k) in gemm_shapes(cfg).items():
            weights = [randn(n, k, g=gpu, scale=k**-0.5)
                       for _ in range(copies_past_l2(n * k * 2, 64))]  # fmt: skip
            for count in (int(r) for r in args.gemm_rows.split(",")):
                rows.append(time_gemm(name, weights, count, configs, bandwidth, gpu))
                print(rows[-1], flush=True)
            del weights
            torch.cuda.empty_cache()
    import flashinfer
    import triton

    totals = step_gemms(rows, cfg["num_hidden_layers"])
    result = {
        "shape": args.shape, "config": cfg, "revision": args.revision or git_revision(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "flashinfer": flashinfer.__version__,
        "measured_copy_bandwidth_GBps": bandwidth / 1e9, "rows": rows,
        "step_gemms": totals, "tensor_cores_from": tensor_cores_from(rows),
    }  # fmt: skip
    args.out.write_text(json.dumps(result, indent=1))
    print_tables(rows, totals, cfg["num_hidden_layers"])
    errors = [[v for key, v in r.items() if key.endswith("rel_err")]
              + [v["rel_err"] for v in r.get("gemv", {}).values() if "rel_err" in v]
              for r in rows]  # fmt: skip
    bad = [r for r, errs in zip(rows, errors, strict=True) if max(errs) > TOLERANCE]
    if bad:
        sys.exit(f"{len(bad)} rows disagree with their reference (tolerance {TOLERANCE}): {bad}")


if __name__ == "__main__":
    main()
