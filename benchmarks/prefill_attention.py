"""Prefill attention at Qwen3 shapes on one GPU: FlashInfer's FA2 kernels (what the engine runs)
against its FA3 kernels (Hopper's), each beside the FLOPs it must do.

    python benchmarks/prefill_attention.py --shape qwen3-8b --out prefill_attention.json

Each case is `context:chunk[xN]`: N sequences (default 1) each computing `chunk` new tokens
after `context` cached ones, causal, over scattered 16-token blocks, as a step of the engine
plans them (`FlashInferPagedAttention`, its prefill rows). The defaults are the steps the
serving rows of issue 19 are made of: fresh 1k and 2k prompts, a 4k prompt's second chunk, and
a multi-turn conversation's later turn (1,152 new tokens after 8k). A row is one layer's call,
timed with CUDA events over calls of several layers (each over its own KV, so no layer's KV
is still in L2); its FLOPs are 4 x heads x head_dim x the (query, key) pairs the causal mask
keeps, beside the bf16 matmul rate measured here (`model_step.matmul_rate`). Each backend is
checked against the torch reference (`TorchPagedAttention`) first; a mismatch fails the run
after the JSON is written, and a backend that cannot run a case (FA3 off Hopper) records why.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from decode_kernels import BLOCK, TOLERANCE, layer_kv_copies, randn, rel_err
from model_step import cuda_time, matmul_rate

from pegainfer.core.attention.paged import FlashInferPagedAttention, GQAShape, TorchPagedAttention
from pegainfer.core.runner.forward_batch import ForwardBatch
from pegainfer.server.bench.make_checkpoint import SHAPES
from pegainfer.server.bench.report import git_revision

BACKENDS = ("fa2", "fa3")
DEFAULT_CASES = "0:1024,0:1024x2,0:2048,2048:2048,8192:1152"


def parse_case(text: str) -> tuple[int, int, int]:
    """`context:chunk[xN]` as (context, chunk, sequences)."""
    context, _, rest = text.partition(":")
    chunk, _, count = rest.partition("x")
    return int(context), int(chunk), int(count or 1)


def prefill_batch(context: int, chunk: int, seqs: int, g: torch.Generator) -> ForwardBatch:
    pages = -(-(context + chunk) // BLOCK)
    order = torch.randperm(seqs * pages, generator=g).tolist()
    tables = [order[i * pages : (i + 1) * pages] for i in range(seqs)]
    return ForwardBatch.build([[0] * chunk] * seqs, [context] * seqs, tables, [True] * seqs,
                              BLOCK, torch.device("cuda"))  # fmt: skip


def time_case(cfg: dict, case: str, flops_rate: float, g: torch.Generator,
              gpu: torch.Generator) -> dict:  # fmt: skip
    context, chunk, seqs = parse_case(case)
    shape = GQAShape(cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"])
    pages = -(-(context + chunk) // BLOCK)
    num_blocks = seqs * pages
    kv = layer_kv_copies(shape, num_blocks, cfg["num_hidden_layers"], gpu)
    layers = len(kv)
    batch = prefill_batch(context, chunk, seqs, g)
    q = randn(seqs * chunk, shape.num_heads, shape.head_dim, g=gpu)
    reference = TorchPagedAttention(shape)
    reference.plan(batch)
    want = reference.attend(q, kv[0])
    pairs = seqs * (chunk * context + chunk * (chunk + 1) // 2)
    flops = 4 * shape.num_heads * shape.head_dim * pairs
    row = {"case": case, "context": context, "chunk": chunk, "sequences": seqs,
           "layers_timed": layers, "flops_per_layer": flops,
           "limit_us": flops / flops_rate * 1e6}  # fmt: skip
    for backend in BACKENDS:
        try:
            attn = FlashInferPagedAttention(shape, torch.bfloat16, torch.device("cuda"), pages,
                                            prefill_backend=backend)  # fmt: skip
            attn.plan(batch)
            out = torch.empty_like(q)
            attn.attend(q, kv[0], out)
            row[f"{backend}_rel_err"] = rel_err(out, want)

            def layers_once(attn=attn, out=out) -> None:
                for kv_layer in kv:
                    attn.attend(q, kv_layer, out)

            seconds = cuda_time(layers_once, iters=10)
        except Exception as error:  # a backend this GPU or FlashInfer build lacks
            row[f"{backend}_error"] = repr(error)[:300]
            continue
        row[f"{backend}_us"] = seconds / layers * 1e6
        row[f"{backend}_tflops"] = flops / (seconds / layers) / 1e12
        row[f"{backend}_fraction_of_matmul"] = flops / (seconds / layers) / flops_rate
        del attn
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--cases", default=DEFAULT_CASES, help="context:chunk[xN], comma-separated")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--revision", default=None)
    args = parser.parse_args()
    cfg = SHAPES[args.shape]
    rate = matmul_rate()
    g, gpu = torch.Generator().manual_seed(0), torch.Generator("cuda").manual_seed(0)
    rows = [time_case(cfg, case, rate, g, gpu) for case in args.cases.split(",")]
    print(f"{'case':>14} {'limit us':>9} " + " ".join(f"{b + ' us':>9} {b + ' %':>6}"
                                                   for b in BACKENDS))  # fmt: skip
    for row in rows:
        cells = [f"{row['case']:>14} {row['limit_us']:9.1f}"]
        for b in BACKENDS:
            if f"{b}_us" in row:
                cells.append(f"{row[f'{b}_us']:9.1f} {100 * row[f'{b}_fraction_of_matmul']:5.1f}%")
            else:
                cells.append(f"{'-':>9} {'-':>6}")
        print(" ".join(cells))
    args.out.write_text(json.dumps({
        "shape": args.shape, "revision": args.revision or git_revision(),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "measured_bf16_matmul_TFLOPs": rate / 1e12, "rows": rows,
    }, indent=1))  # fmt: skip
    bad = [(row["case"], b) for row in rows for b in BACKENDS
           if row.get(f"{b}_rel_err", 0.0) > TOLERANCE]  # fmt: skip
    if bad:
        sys.exit(f"backends off the torch reference (rel err > {TOLERANCE}): {bad}")
    if any("fa2_error" in row for row in rows):  # the engine's own kernels must run
        sys.exit("FA2 failed: " + "; ".join(r["fa2_error"] for r in rows if "fa2_error" in r))


if __name__ == "__main__":
    main()
