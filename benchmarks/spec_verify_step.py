"""Speculative decoding's verify step against a plain decode step, on one GPU, at one model
shape with random weights: for each batch B and draft count k, the wall time of a step that
feeds B sequences 1 + k tokens each (their last token and k drafts) after a context of C
tokens, samples all B (1 + k) rows greedily and accepts (issue 26's "time per verify step at
k = 1..4 and batch 1..64"), beside the plain decode step of B tokens and the HBM floor of one
token (weights plus the context's KV, over the measured copy bandwidth). A line with an MTP
drafter (Qwen3.5) also gets the drafter's time for the k drafts after a fully accepted step,
and its verify steps keep each sequence's state before the drafts, as served.

    python benchmarks/spec_verify_step.py --shape qwen35-4b --out verify.json

The steps go through the model runner as the engine runs them (decode graphs for the plain
step; a verify step replays the piecewise graphs where the line has them, else runs eagerly)
with the drafts' KV written where the engine writes it. What follows for tokens per second at
an accepted length a (0..k): B (1 + a) tokens per verify step plus, where measured, the
drafter's time (`tpot_ms`: per token of one stream; `--speculative-method self` on a real
engine gives full acceptance for greedy requests, the upper bound).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch
from model_step import copy_bandwidth

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.engine.messages import EngineRequest
from pegainfer.core.engine.request import Request
from pegainfer.core.engine.step_plan import StepPlan
from pegainfer.core.sampling.sampling_params import SamplingParams
from pegainfer.core.speculative.acceptance import greedy_accept
from pegainfer.core.speculative.drafter import DraftInputs
from pegainfer.server.bench.make_checkpoint import QWEN35_SHAPES, SHAPES, write_weights
from pegainfer.server.bench.report import git_revision


def step_time(engine: EngineCore, plan: StepPlan, k: int, iters: int) -> tuple[float, str]:
    """Median wall seconds of one step of `plan` (inputs, forward, greedy acceptance of every
    sequence's k drafts, the tokens' copy to the host), and how its forward ran."""
    runner, count = engine.runner, len(plan.token_chunks)
    drafts = torch.zeros(count, k, dtype=torch.long, device=runner.device)
    num_drafts = torch.full((count,), k, device=runner.device)

    def once() -> str:
        batch = runner.batch(plan)
        path = "eager"
        if runner.graphs is not None and runner.graphs.can_run(batch):
            path = "decode graph"
        elif runner.mixed_graphs is not None and runner.mixed_graphs.can_run(batch):
            path = "piecewise graphs"
        logits = runner.forward(batch)
        target = logits.argmax(dim=-1).view(count, k + 1)
        greedy_accept(target, drafts, num_drafts).runs()
        return path

    path = once()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return statistics.median(times), path


def plan_for(
    engine: EngineCore, batch: int, k: int, context: int, tables: list[list[int]]
) -> StepPlan:
    g = torch.Generator().manual_seed(batch * 10 + k)
    vocab = engine.model.vocab_size
    chunks = torch.randint(0, vocab, (batch, k + 1), generator=g).tolist()
    recurrent = bool(engine.model.state_arenas())
    # Speculating with recurrent state, a verify chunk keeps the state before its drafts in
    # the sequence's rollback slot (after the sequence and checkpoint slots; no checkpoints).
    rollback = engine.scheduler.config.rollback_slots
    snapshots = [None] * batch
    if k and rollback is not None:
        snapshots = [(1, rollback + i) for i in range(batch)]
    return StepPlan(
        token_chunks=chunks, start_positions=[context] * batch, block_tables=tables[:batch],
        sample_mask=[True] * batch, every_row=[False] * batch,
        state_slots=list(range(batch)) if recurrent else [],
        state_restore=[None] * batch if recurrent else [],
        state_snapshot=snapshots if recurrent else [],
        num_drafts=[k] * batch if k else [],
    )  # fmt: skip


def draft_time(
    engine: EngineCore, plan: StepPlan, k: int, context: int, tables: list[list[int]], iters: int
) -> float:
    """Median wall seconds of the line's drafter proposing k drafts for every sequence of
    `plan` after its verify forward accepted them all (the first draft over the 1 + k rows
    that stand, then k - 1 more)."""
    runner, batch = engine.runner, len(plan.token_chunks)
    vocab = engine.model.vocab_size
    requests = []
    for i, chunk in enumerate(plan.token_chunks):
        message = EngineRequest(request_id=str(i), prompt_token_ids=[0] * context + chunk + [0],
                                params=SamplingParams(temperature=0.0), eos_token_ids=[],
                                arrival_time=0.0)  # fmt: skip
        request = Request(message, 1, None)
        request.token_ids = [t % vocab for t in request.token_ids]
        request.block_ids = tables[i]
        requests.append(request)
    inputs = DraftInputs(requests, [context] * batch, [i * (k + 1) for i in range(batch)],
                         [k + 1] * batch, [True] * batch)  # fmt: skip
    drafter = engine.speculative.drafter
    drafter.num_tokens = k
    runner.forward(runner.batch(plan))  # the target's hidden states the first draft reads
    drafter.propose(inputs)
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        drafter.propose(inputs)  # ends in the drafts' copy to the host
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES) + sorted(QWEN35_SHAPES),
                        default="qwen35-4b")  # fmt: skip
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--ks", default="1,2,3,4")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument(
        "--no-mtp", dest="mtp", action="store_false",
        help="Qwen3.5 shapes: leave the MTP drafter out (verify steps alone, no rollback)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--revision", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    bandwidth = copy_bandwidth()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            model_dir = Path(tmp)
            write_weights(args.shape, model_dir, device="cuda")
        engine = EngineCore(EngineArgs(
            model=str(model_dir), device="cuda", dtype="bfloat16", max_num_seqs=max(batches),
            max_model_len=args.context + 64, enable_prefix_caching=False,
            max_num_batched_tokens=max(2048, max(batches) * (1 + max(ks))),
            speculative_tokens=max(ks) if args.mtp and args.shape in QWEN35_SHAPES else 0,
        ))  # fmt: skip
    model, block_size = engine.model, engine.config.block_size
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.cfg.tie_word_embeddings:
        weight_bytes -= model.embed_tokens.numel() * model.embed_tokens.element_size()
    kv_per_token = sum(s.bytes_per_block for s in model.kv_arenas(block_size)) // block_size
    state_bytes = 2 * sum(s.bytes_per_slot for s in model.state_arenas())
    # The context, the verify chunk and the drafter's k positions past it.
    per_seq = -(-(args.context + 2 + 2 * max(ks)) // block_size)
    tables = [engine.block_manager.allocate(per_seq) for _ in range(max(batches))]
    rows = []
    for batch in batches:
        floor = (weight_bytes + batch * (args.context * kv_per_token + state_bytes)) / bandwidth
        decode, decode_path = step_time(engine, plan_for(engine, batch, 0, args.context, tables),
                                        0, args.iters)  # fmt: skip
        row = {"batch": batch, "decode_step_ms": decode * 1e3, "decode_path": decode_path,
               "hbm_floor_one_token_ms": floor * 1e3, "verify": []}  # fmt: skip
        for k in ks:
            plan = plan_for(engine, batch, k, args.context, tables)
            verify, path = step_time(engine, plan, k, args.iters)
            draft = 0.0
            if engine.speculative is not None:
                draft = draft_time(engine, plan, k, args.context, tables, args.iters)
            step = verify + draft
            row["verify"].append({
                "k": k, "step_ms": verify * 1e3, "path": path, "draft_ms": draft * 1e3,
                "vs_decode": verify / decode,
                # Per accepted length a = 0..k, verify and draft together: output tokens per
                # second, and ms per token of one stream.
                "tokens_per_s": [batch * (1 + a) / step for a in range(k + 1)],
                "tpot_ms": [step * 1e3 / (1 + a) for a in range(k + 1)],
            })  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {
        "revision": args.revision or git_revision(), "shape": args.shape,
        "gpu": torch.cuda.get_device_name(), "context": args.context,
        "copy_bandwidth_gb_s": bandwidth / 1e9, "weight_bytes": weight_bytes,
        "command": "python benchmarks/spec_verify_step.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "rows": rows,
    }  # fmt: skip
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
