"""Decode-step time of one Qwen3 shape with and without the engine flags that change a decode
step's kernels, in one run, each engine over the same checkpoint:

    python benchmarks/decode_flags.py --shape qwen3-4b --out decode_flags.json

Variants: the default engine, `--small-batch-gemv`, `--decode-attention-tensor-cores never`.
Each row is `model_step.decode_step_time` (median step as served, and its graph replay alone)
for B requests of a 1k context; each variant's engine runs in a process of its own.
`benchmarks/decode_kernels.py` times the kernels one by one.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch
from model_step import decode_budget, decode_step_time

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.server.bench.make_checkpoint import SHAPES, write_weights
from pegainfer.server.bench.report import git_revision

VARIANTS = {
    "default": {},
    "small_batch_gemv": {"small_batch_gemv": True},
    "cuda_core_decode": {"decode_attention_tensor_cores": "never"},
}


def time_variant(
    name: str, model_dir: str, batches: list[int], context: int, steps: int
) -> list[dict]:
    """One engine with the variant's flags (in a process of its own: the next engine then
    sizes its cache from a GPU this one has left)."""
    engine = EngineCore(EngineArgs(
        model=model_dir, device="cuda", dtype="bfloat16", max_num_seqs=max(batches),
        max_model_len=64 + context + decode_budget(max(batches), steps), **VARIANTS[name],
    ))  # fmt: skip
    rows = []
    for batch in batches:
        step, replay, _ = decode_step_time(engine, batch, context, steps, None)
        rows.append({"variant": name, "batch": batch, "step_ms": step * 1e3,
                     "replay_ms": replay * 1e3})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--revision", default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_weights(args.shape, Path(tmp), device="cuda")
        torch.cuda.empty_cache()
        for name in args.variants.split(","):
            with ProcessPoolExecutor(1, get_context("spawn"), max_tasks_per_child=1) as pool:
                rows += pool.submit(time_variant, name, tmp, batches, args.context,
                                    args.steps).result()  # fmt: skip
    args.out.write_text(json.dumps({
        "shape": args.shape, "revision": args.revision or git_revision(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": torch.cuda.get_device_name(), "context": args.context, "rows": rows,
    }, indent=1))  # fmt: skip
    print(f"\nstep / replay ms\n{'batch':>5} "
          + " ".join(f"{name:>18}" for name in args.variants.split(",")))  # fmt: skip
    for batch in batches:
        cells = [r for r in rows if r["batch"] == batch]
        print(f"{batch:>5} " + " ".join(f"{r['step_ms']:8.3f} / {r['replay_ms']:6.3f}"
                                        for r in cells))  # fmt: skip


if __name__ == "__main__":
    main()
