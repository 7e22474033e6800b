"""Time one layer of DeepSeek sparse attention's decode step (`core.attention.sparse`) at
GLM-5's widths on one GPU, piece by piece, as a decode CUDA graph runs it.

    python benchmarks/dsa_decode.py --batches 1,8,64 --contexts 4096,32768,131072 \\
        --max-model-len 202752 --out dsa_decode.json

Per batch and context (every row at that context; random bf16 caches over scattered 64-token
blocks): the indexer's scores (the Triton kernel, a grid over `max_model_len` columns as a
graph launches it), scores plus torch's top-k (`select`), and selection plus FlashInfer's MLA
over the selected slots (`select` then `run`). Each is timed as 20 calls captured in a CUDA
graph (no host time), median of 5 replays, beside the bytes it must read: every indexer key of
the context, and the latents and rope keys of min(context, top_k) selected slots.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch

from pegainfer.core.attention.latent import LatentShape
from pegainfer.core.attention.sparse import IndexerShape, make_sparse_latent_attention
from pegainfer.core.model_line import RuntimeConfig
from pegainfer.core.runner.forward_batch import ForwardBatch

BLOCK, CALLS = 64, 20
GLM = LatentShape(num_heads=64, latent_dim=512, rope_dim=64, nope_dim=192, value_dim=256,
                  scale=256**-0.5)  # fmt: skip
INDEX = IndexerShape(heads=32, dim=128, top_k=2048, scale=128**-0.5)


def graph_time(fn: Callable[[], object]) -> float:
    """Microseconds per call of `fn`, captured CALLS times in a CUDA graph."""
    fn()  # warm-up (and compilation) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return statistics.median(times)


def time_step(batch: int, context: int, max_model_len: int) -> dict[str, float]:
    device, dtype = torch.device("cuda"), torch.bfloat16
    pages = -(-(context + 1) // BLOCK)
    blocks = batch * pages + 1

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=device) * scale).to(dtype)

    ckv, kpe = randn(blocks, BLOCK, GLM.latent_dim), randn(blocks, BLOCK, GLM.rope_dim)
    keys = randn(blocks, BLOCK, INDEX.dim)
    kv_b = randn(GLM.num_heads, GLM.nope_dim + GLM.value_dim, GLM.latent_dim, scale=0.05)
    q_nope = randn(batch, GLM.num_heads, GLM.nope_dim, scale=0.3)
    q_pe = randn(batch, GLM.num_heads, GLM.rope_dim, scale=0.3)
    q_idx = randn(batch, INDEX.heads, INDEX.dim)
    w_idx = torch.randn(batch, INDEX.heads, device=device)
    order = torch.randperm(batch * pages).tolist()
    tables = [order[i * pages : (i + 1) * pages] for i in range(batch)]
    step = ForwardBatch.build([[0]] * batch, [context] * batch, tables, [True] * batch, BLOCK,
                              device)  # fmt: skip
    runtime = RuntimeConfig(block_size=BLOCK, max_model_len=max_model_len,
                            max_num_batched_tokens=max(batch, 256), max_num_seqs=batch,
                            graph_buckets=(batch,))  # fmt: skip
    attn = make_sparse_latent_attention(GLM, INDEX, dtype, device, runtime)
    attn.plan_graph(step, batch)
    plan = attn.step
    assert plan is not None

    def scores() -> torch.Tensor:
        return attn.scores(q_idx, w_idx, keys, plan, slice(0, batch), INDEX.scale)

    def select() -> torch.Tensor | None:
        return attn.select(q_idx, w_idx, keys)

    def both() -> torch.Tensor:
        return attn.run(q_nope, q_pe, ckv, kpe, kv_b, select())

    selected = min(context + 1, INDEX.top_k)
    return {
        "scores_us": graph_time(scores), "select_us": graph_time(select),
        "select_and_attend_us": graph_time(both),
        "index_key_bytes": batch * (context + 1) * INDEX.dim * 2,
        "selected_latent_bytes": batch * selected * (GLM.latent_dim + GLM.rope_dim) * 2,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--contexts", default="4096,32768,131072")
    parser.add_argument("--max-model-len", type=int, default=202752)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            row = {"batch": batch, "context": context, "max_model_len": args.max_model_len}
            rows.append(row | time_step(batch, context, args.max_model_len))
            print(rows[-1], flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
