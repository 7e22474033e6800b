"""Decode-step and prefill timings of one model shape on one GPU, beside limits measured in
the same run.

    python benchmarks/model_step.py --shape qwen3-4b --out result.json
    python benchmarks/model_step.py --shape kimi-k2-int4 --num-layers 61 --num-experts 48 \
        --load-format dummy --batches 1,64 --prefill 4096 --out kimi.json

Random weights at the real shapes (drawn on the GPU, written as a checkpoint by
`pegainfer-bench make-checkpoint`'s writer, or with `--load-format dummy` drawn in place by the
engine: shares of Kimi-K2 and GLM-5 that no disk here holds), the engine as served (CUDA graphs
on, greedy sampling, one device-to-host copy per step). Latent-MoE shapes (DeepSeek, Kimi-K2,
GLM-5) may be cut to `--num-layers` layers of `--num-experts` routed experts.

Decode: B requests with a 1k-token context, median step time over many steps, against the HBM
limit: the bytes a step must read over the measured device-copy bandwidth. Those are the
weights (not the embedding table, of which a step gathers a few rows), of a MoE's routed experts
only those its tokens choose (routing spread evenly: of E experts with k per token, a batch of B
touches E(1 - (1 - k/E)^B) in expectation, k at batch 1), plus each sequence's KV (with sparse
attention, GLM-5's, the latents of the `index_topk` keys it selects and every indexer key once a
sequence is longer than that) and, for recurrent layers, its state read and written.

Prefill: one prompt of T tokens in one step, against the matmul rates measured here: the linear
layers' FLOPs (2 per weight element, as the matmuls see them: an INT4 int32 holds eight; routed
experts k/E of them; not the LM head, which runs for one row) at the bf16 rate, those of weights
stored FP8 outside the routed experts at the FP8 rate (they run FP8 x FP8 from 64 rows on; the
fused MoE dequantizes to bf16), and causal attention at the bf16 rate: the full-attention
layers' QK and PV, or, for a sequence longer than a sparse model's `index_topk`, the indexer's
scores over every earlier key and absorbed MLA over at most `index_topk` keys per row.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine import core as engine_module
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.engine.messages import EngineRequest
from pegainfer.core.matmul_weights import MatmulWeights, is_routed
from pegainfer.core.sampling.sampler import sample_requests
from pegainfer.core.sampling.sampling_params import SamplingParams
from pegainfer.core.sampling.structured_output import StructuredOutput
from pegainfer.server.bench.make_checkpoint import (
    LATENT_MOE_SHAPES,
    QWEN35_SHAPES,
    SHAPES,
    write_weights,
)
from pegainfer.server.bench.report import git_revision
from pegainfer.server.bench.step_limits import (
    attention_flops,
    kv_read_bytes,
    measured_expert_spread,
    untouched_experts,
)

ALL_SHAPES = SHAPES | QWEN35_SHAPES | LATENT_MOE_SHAPES

# Prompt ids are drawn below this (and below the model's vocabulary).
VOCAB = 100000


def cuda_time(fn, iters: int = 20) -> float:
    """Median seconds per call, measured with CUDA events after a warm-up call."""
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes per second of a 4 GiB device-to-device copy (read + write)."""
    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / cuda_time(lambda: dst.copy_(src))


def host_to_device_bandwidth() -> float:
    """Bytes per second of a 1 GiB copy from pinned host memory to the device."""
    src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    return src.numel() / cuda_time(lambda: dst.copy_(src, non_blocking=True))


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    return 2 * 8192**3 / cuda_time(lambda: a @ b)


def fp8_matmul_rate() -> float:
    """FLOP/s of an 8192^3 FP8 e4m3 GEMM (cuBLAS through torch, per-tensor scales)."""
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")

    def gemm() -> torch.Tensor:
        return torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    return 2 * 8192**3 / cuda_time(gemm)


# A JSON object whose one string must be longer than any measured answer: the grammar never
# lets a constrained request end early, so the batch stays the same while it is timed.
LONG_STRING = StructuredOutput.json_schema({
    "type": "object", "required": ["text"], "additionalProperties": False,
    "properties": {"text": {"type": "string", "minLength": 100_000}},
})  # fmt: skip


def submit(
    engine: EngineCore, rid: str, prompt: list[int], max_tokens: int, constrained: bool = False
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=not constrained,
                            structured=LONG_STRING if constrained else None)  # fmt: skip
    engine.add_request(
        EngineRequest(
            request_id=rid, prompt_token_ids=prompt, params=params, eos_token_ids=[],
            arrival_time=time.time(),
        )
    )  # fmt: skip


def decode_budget(batch: int, steps: int) -> int:
    """Tokens a decode request may generate: the measured and profiled steps (pure decode and
    mixed), plus the steps it may decode while the others still prefill (one per other)."""
    return 2 * (steps + 32) + batch


def host_phases(engine: EngineCore, run_step, reps: int) -> dict[str, float]:
    """Median milliseconds per step of each host phase, timed by wrapping the engine's calls
    (no profiler overhead). `commit` starts with the copy of the sampled ids to the host, so
    it holds whatever GPU time the host work before it did not cover."""
    spans: dict[str, list[float]] = defaultdict(list)

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            spans[name].append(time.perf_counter() - start)
            return out

        return wrapper

    targets = [(engine.scheduler, "schedule", "schedule"), (engine, "_plans", "plan"),
               (engine.runner, "batch", "inputs"),
               (engine.model, "prepare", "attention plan (eager)"),
               (engine.model, "prepare_graph", "attention plan (graph)"),
               (engine.scheduler, "advance", "advance"),
               (engine, "_commit", "commit (waits for the GPU, then bookkeeping)")]  # fmt: skip
    if engine.runner.graphs is not None:
        targets.append((engine.runner.graphs, "run", "graph run (plan + copies + launch)"))
    if engine.runner.mixed_graphs is not None:
        targets.append((engine.runner.mixed_graphs, "run", "piecewise run (plan + launches)"))
    for obj, attr, name in targets:
        setattr(obj, attr, timed(name, getattr(obj, attr)))
    engine_module.sample_requests = timed("sample (launch)", sample_requests)
    try:
        for _ in range(reps):
            start = time.perf_counter()
            run_step()
            spans["whole step"].append(time.perf_counter() - start)
    finally:
        for obj, attr, _ in targets:
            delattr(obj, attr)  # back to the class's method
        engine_module.sample_requests = sample_requests
    return {name: statistics.median(v) * 1e3 for name, v in spans.items()}


def profile_steps(engine: EngineCore, path: Path, run_step) -> None:
    """A kernel table (torch profiler, 5 steps) and the host phases (20 steps) of `run_step`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            run_step()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    phases = host_phases(engine, run_step, 20)
    lines = [f"{name:40s} {ms:8.3f} ms" for name, ms in phases.items()]
    path.write_text(table + "\nHost phases per step (median of 20):\n" + "\n".join(lines) + "\n")


def decode_step_time(
    engine: EngineCore,
    batch: int,
    context: int,
    steps: int,
    profile_dir: Path | None,
    mixed_prompt: int = 0,
    constrained: float = 0.0,
) -> tuple[float, float | None, float | None, float | None]:
    """Median wall time of a full engine step, GPU time of the step's graph replay (one GPU
    only), (with `mixed_prompt`) median wall time of a step that also prefills a new prompt
    that long, and (MoE lines, one GPU) the fraction of routed experts one step reads.
    A `constrained` fraction of the requests decode under a JSON-schema grammar."""
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(0, VOCAB, (context,), generator=g).tolist()
        constrain = i < round(constrained * batch)
        submit(engine, f"d{batch}-{i}", prompt, decode_budget(batch, steps), constrain)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.requests.values()):
        engine.step()  # prefill (and the first decodes as prefill completes)
    engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()  # ends in the device-to-host copy of the sampled ids
        times.append(time.perf_counter() - start)
    decode_median = statistics.median(times)
    # The forward alone: replay the step's graph as last planned (GPU time, no host work).
    # Not with parallel ranks: the graph's all-reduces wait for the other ranks, which
    # replay only inside engine steps.
    replay = None
    if engine.ranks is None:
        graphs = engine.runner.graphs
        bucket = min(b for b in graphs.buckets if b >= batch)
        replay = cuda_time(graphs._graphs[bucket].replay)
    spread = measured_expert_spread(engine)
    if profile_dir is not None:
        suffix = f"_constrained{constrained:g}" if constrained else ""
        profile_steps(engine, profile_dir / f"profile_b{batch}{suffix}.txt", engine.step)
    mixed = None
    if mixed_prompt:
        # A serving step under load: the same decodes plus one new prompt prefilled whole
        # (it asks for one token, so it leaves at once and the batch stays the same).
        ids = itertools.count()

        def mixed_step() -> None:
            prompt = torch.randint(0, VOCAB, (mixed_prompt,), generator=g).tolist()
            submit(engine, f"m{batch}-{next(ids)}", prompt, 1)
            engine.step()

        times = []
        for _ in range(steps):
            start = time.perf_counter()
            mixed_step()
            times.append(time.perf_counter() - start)
        mixed = statistics.median(times)
        if profile_dir is not None:
            path = profile_dir / f"profile_b{batch}_plus_prefill{mixed_prompt}.txt"
            profile_steps(engine, path, mixed_step)
    engine.abort(list(engine.requests))
    return decode_median, replay, mixed, spread


def finish_one_step(engine: EngineCore) -> None:
    """Run a request that needs one forward to the end (with async scheduling, a second call
    brings its token back)."""
    launches = 0
    while engine.has_unfinished_requests:
        launches += bool(engine.requests)
        engine.step()
    assert launches <= 1 + engine.async_scheduling, "the prompt did not finish in one step"


def prefill_time(engine: EngineCore, tokens: int, reps: int = 3) -> float:
    times = []
    for rep in range(reps + 1):
        g = torch.Generator().manual_seed(tokens + rep)
        submit(
            engine, f"p{tokens}-{rep}", torch.randint(0, VOCAB, (tokens,), generator=g).tolist(), 1
        )
        torch.cuda.synchronize()
        start = time.perf_counter()
        finish_one_step(engine)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def prefix_hit_time(engine: EngineCore, tokens: int, reps: int, profile_path: Path | None) -> float:
    """Median wall time of serving a prompt of `tokens` whose full blocks are all in the
    prefix cache (the last block's tokens are computed again), as the warm-prefix ladder of
    `pegainfer-bench prefix` sends it: one step from the device tier; with the host tier only
    (`--kv-offload-gib`), the restore's copy and then that step."""
    g = torch.Generator().manual_seed(7 * tokens)
    prompt = torch.randint(0, VOCAB, (tokens,), generator=g).tolist()
    ids = itertools.count()

    def serve_once() -> None:
        counters = engine.scheduler.counters  # a snapshot with data-parallel attention
        hits, host_hits = counters.prefix_hits, counters.prefix_hits_host
        submit(engine, f"hit{tokens}-{next(ids)}", prompt, 1)
        if engine.offload is None:
            finish_one_step(engine)
        else:
            while engine.has_unfinished_requests:  # steps that launch nothing until it lands
                engine.step()
            assert (engine.scheduler.counters.prefix_hits_host - host_hits
                    >= tokens - engine.config.block_size)  # fmt: skip
        assert engine.scheduler.counters.prefix_hits - hits >= tokens - engine.config.block_size

    submit(engine, f"fill{tokens}", prompt, 1)
    while engine.requests:
        engine.step()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        serve_once()
        times.append(time.perf_counter() - start)
    if profile_path is not None:
        profile_steps(engine, profile_path, serve_once)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(ALL_SHAPES), default="qwen3-4b")
    parser.add_argument(
        "--num-layers", type=int, default=None, help="latent-MoE shapes: layers kept"
    )
    parser.add_argument(
        "--num-experts", type=int, default=None,
        help="latent-MoE shapes: routed experts per layer kept (top-k unchanged)",
    )  # fmt: skip
    parser.add_argument(
        "--load-format", choices=("auto", "dummy"), default="auto",
        help="auto: write the random checkpoint and load it; dummy: write its config only and "
        "draw the weights in place on the GPU (latent-MoE shapes)",
    )  # fmt: skip
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9,
        help="the engine's flag: weights, activations and KV cache within this fraction",
    )  # fmt: skip
    parser.add_argument("--batches", default="1,8,32,64,128,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--prefill", default="1024,4096,16384")
    parser.add_argument(
        "--prefix-hit", default="", help="prompt lengths whose prefix-cache hit step is timed"
    )
    parser.add_argument(
        "--mixed-prompt", type=int, default=0,
        help="also time decode steps that prefill one new prompt of this many tokens",
    )  # fmt: skip
    parser.add_argument(
        "--constrained", type=lambda text: [float(f) for f in text.split(",")], default=[0.0],
        help="fraction of each decode batch generating under a JSON-schema grammar; several "
        "(e.g. 0,0.5,0,0.5) time each batch once per fraction, in that order, on one engine",
    )  # fmt: skip
    parser.add_argument(
        "--no-async-scheduling", dest="async_scheduling", action="store_false",
        help="engine with --no-async-scheduling: each step waits for the one before",
    )  # fmt: skip
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1,
        help="ranks on GPUs 0..N-1; weight and KV bytes (the HBM limit) are one rank's",
    )  # fmt: skip
    parser.add_argument(
        "--enable-expert-parallel", action="store_true",
        help="MoE lines: whole experts divided between the ranks",
    )  # fmt: skip
    parser.add_argument(
        "--data-parallel-size", type=int, default=1,
        help="MoE lines, with --enable-expert-parallel: attention ranks on GPUs 0..N-1, each "
        "with its share of a batch's sequences; the HBM limit is one rank's bytes for its share",
    )  # fmt: skip
    parser.add_argument(
        "--kv-offload-gib", type=float, default=0.0,
        help="an engine with a host tier this large and no device prefix cache: the "
        "--prefix-hit lengths are then restores from host memory",
    )  # fmt: skip
    parser.add_argument(
        "--model-dir", type=Path, default=None,
        help="a checkpoint of this shape written earlier (default: write one to a temp dir)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--profile", default="", help="batch sizes whose steps get a kernel profile beside --out"
    )
    parser.add_argument(
        "--revision", default=None, help="git revision measured (default: `git rev-parse HEAD`)"
    )
    args = parser.parse_args()
    cuts = {"num_hidden_layers": args.num_layers, "n_routed_experts": args.num_experts}
    overrides = {key: value for key, value in cuts.items() if value is not None}
    if (overrides or args.load_format == "dummy") and args.shape not in LATENT_MOE_SHAPES:
        parser.error("--num-layers, --num-experts and --load-format dummy are for latent-MoE "
                     "shapes (deepseek, kimi-k2, glm5)")  # fmt: skip
    if overrides and args.model_dir is not None:
        parser.error("--num-layers and --num-experts cut the checkpoint this run writes, not "
                     "--model-dir's")  # fmt: skip
    profiled = {int(b) for b in args.profile.split(",") if b}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    bandwidth, flops = copy_bandwidth(), matmul_rate()
    config = ALL_SHAPES[args.shape] | overrides
    quant = config.get("quantization_config", {}).get("quant_method")
    fp8_flops = fp8_matmul_rate() if quant == "fp8" else None
    host_bandwidth = host_to_device_bandwidth() if args.kv_offload_gib else None

    with tempfile.TemporaryDirectory() as tmp:
        if args.model_dir is None:
            write_weights(args.shape, Path(tmp), device="cuda", overrides=overrides,
                          weights=args.load_format == "auto")  # fmt: skip
        else:
            tmp = str(args.model_dir)
        batches = [int(b) for b in args.batches.split(",")]
        prefills = [int(t) for t in args.prefill.split(",")]
        prefix_hits = [int(t) for t in args.prefix_hit.split(",") if t]
        started = time.perf_counter()
        engine = EngineCore(EngineArgs(
            model=tmp, device="cuda", dtype="bfloat16",
            max_num_seqs=max(batches) + int(args.mixed_prompt > 0),
            max_model_len=64 + max(
                *prefills, *prefix_hits, args.context + decode_budget(max(batches), args.steps)
            ),
            max_num_batched_tokens=max(prefills),
            # As served (the timed prompts are all distinct), unless only the host tier is.
            enable_prefix_caching=not args.kv_offload_gib,
            kv_offload=bool(args.kv_offload_gib), kv_offload_gib=args.kv_offload_gib or 16.0,
            async_scheduling=args.async_scheduling, tensor_parallel_size=args.tensor_parallel_size,
            enable_expert_parallel=args.enable_expert_parallel,
            data_parallel_size=args.data_parallel_size, load_format=args.load_format,
            gpu_memory_utilization=args.gpu_memory_utilization,
        ))  # fmt: skip
        load_s = time.perf_counter() - started

    model = engine.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg, block_size = model.cfg, engine.config.block_size
    arenas = model.kv_arenas(block_size)
    top_k_keys = getattr(cfg, "index_topk", None)  # sparse attention's selection
    # Recurrent state: read and written in full by every decode step.
    state_bytes_per_seq = 2 * sum(spec.bytes_per_slot for spec in model.state_arenas())
    # The embedding is gathered (a few rows), not streamed; the LM head is. Tied: one matrix.
    # This rank's rows of the table (and of the LM head) under tensor parallelism.
    table_bytes = model.embed_tokens.numel() * model.embed_tokens.element_size()
    embed_bytes = 0 if cfg.tie_word_embeddings else table_bytes
    streamed = weight_bytes - embed_bytes
    # MoE: a step reads only the routed experts its tokens chose. Random weights route about
    # uniformly: of E experts with k per token, a batch of B touches E(1 - (1 - k/E)^B).
    routed_bytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                       if is_routed(name))  # fmt: skip
    routing = getattr(cfg, "routing", None)  # the latent-MoE lines' (DeepSeek, Kimi, GLM)
    experts, top_k = (routing.num_experts, routing.top_k) if routing is not None else (0, 0)

    def untouched(batch: int) -> float:
        return untouched_experts(experts, top_k, batch) if experts else 0.0

    def read_bytes(batch: int) -> float:
        return streamed - routed_bytes * untouched(batch)

    decode = []
    for batch, constrained in itertools.product(batches, args.constrained):
        profile_dir = args.out.parent if batch in profiled else None
        step, replay, mixed, spread = decode_step_time(
            engine, batch, args.context, args.steps, profile_dir, args.mixed_prompt, constrained,
        )  # fmt: skip
        # One rank's sequences (data-parallel attention spreads them over the ranks); its
        # routed experts serve every rank's tokens.
        seqs = -(-batch // args.data_parallel_size)
        context = args.context + args.steps // 2
        kv = seqs * (kv_read_bytes(arenas, block_size, context, top_k_keys) + state_bytes_per_seq)
        limit = (read_bytes(batch) + kv) / bandwidth
        decode.append({
            "batch": batch, "constrained_fraction": constrained, "step_ms": step * 1e3,
            "forward_replay_ms": None if replay is None else replay * 1e3,
            "hbm_limit_ms": limit * 1e3, "fraction_of_limit": limit / step,
            "tokens_per_s": batch / step,
        })  # fmt: skip
        if experts:
            decode[-1]["routed_experts_read_fraction"] = 1 - untouched(batch)
            # What the weights' routing chose in one eager step (the limit assumes even routing).
            decode[-1]["routed_experts_read_measured"] = spread
        if mixed is not None:
            decode[-1]["step_with_prefill_ms"] = mixed * 1e3
        print(decode[-1], flush=True)
    # Active weights per token (the LM head runs for one row; k of E routed experts).
    weights = MatmulWeights.of(model)
    active = weights.elements - (weights.routed * (1 - top_k / experts) if experts else 0)
    prefill = []
    for tokens in prefills:
        t = prefill_time(engine, tokens)
        attn = attention_flops(cfg, arenas, tokens)
        flop = 2 * active * tokens + attn
        fp8 = 2 * weights.fp8 * tokens if fp8_flops else 0
        limit = (flop - fp8) / flops + (fp8 / fp8_flops if fp8 else 0.0)
        prefill.append({
            "tokens": tokens, "time_ms": t * 1e3, "tflops": flop / t / 1e12,
            "fraction_of_matmul_rate": flop / t / flops, "matmul_limit_ms": limit * 1e3,
            "fraction_of_limit": limit / t,
        })  # fmt: skip
        print(prefill[-1], flush=True)

    prefix_hit = []
    for tokens in prefix_hits:
        path = args.out.parent / f"profile_prefix_hit_{tokens}.txt" if profiled else None
        t = prefix_hit_time(engine, tokens, 20, path)
        prefix_hit.append({"tokens": tokens, "step_ms": t * 1e3})
        if host_bandwidth is not None:
            # Every full block but the last token's is restored (that one is recomputed).
            restored = (tokens - 1) // block_size * sum(spec.bytes_per_block for spec in arenas)
            prefix_hit[-1] |= {"tier": "host", "bytes_restored": restored,
                               "copy_limit_ms": restored / host_bandwidth * 1e3}  # fmt: skip
        print(prefix_hit[-1], flush=True)

    revision = args.revision or git_revision()
    result = {
        "shape": args.shape,
        "config": config, "load_format": args.load_format,
        "revision": revision,
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "measured_copy_bandwidth_GBps": bandwidth / 1e9,
        "measured_bf16_matmul_TFLOPs": flops / 1e12,
        "measured_fp8_matmul_TFLOPs": fp8_flops and fp8_flops / 1e12,
        "measured_pinned_host_to_device_GBps": host_bandwidth and host_bandwidth / 1e9,
        "kv_offload_gib": args.kv_offload_gib,
        "weight_bytes": weight_bytes, "state_bytes_per_seq_step": state_bytes_per_seq,
        "engine_load_s": load_s,
        "num_kv_blocks": engine.config.num_kv_blocks, "async_scheduling": args.async_scheduling,
        "tensor_parallel_size": args.tensor_parallel_size,
        "enable_expert_parallel": args.enable_expert_parallel,
        "data_parallel_size": args.data_parallel_size,
        "constrained_fractions": args.constrained,
        "decode": decode, "prefill": prefill,
        "prefix_hit": prefix_hit,
    }  # fmt: skip
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
