"""The first wave of prompts a fresh engine serves against a later wave of the same shape, step by
step, without HTTP: whether a just-started engine computes its first steps slower than it later
does (issue 19's multi-turn TTFT, where the first wave of ten 4k prompts waited ~1.4 s and the
same wave 9 s later ~0.5 s on one H100).

    python benchmarks/cold_wave.py --model-dir DIR --out cold_wave.json [--profile-steps 6]

The engine is built with the server's defaults (`--max-model-len 20480`, the default step
budget), its idle-time graph captures run to the end as a served engine's do before the first
request, then each wave submits `--prompts` distinct random prompts of `--prompt-len` tokens at
once and steps until every one has its first token, then `--decode-steps` steps more. Per step:
wall time of `EngineCore.step`, tokens scheduled, sequences; per request: time to first token.
`--profile-steps N` profiles the first N steps of each wave with the torch profiler and writes
their kernel and CPU-op tables beside `--out`.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from pathlib import Path

import torch

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.engine.messages import EngineRequest
from pegainfer.core.sampling.sampling_params import SamplingParams
from pegainfer.server.bench.report import git_revision


def run_wave(
    engine: EngineCore,
    wave: int,
    prompts: int,
    prompt_len: int,
    decode_steps: int,
    vocab: int,
    profile_steps: int,
    out: Path,
) -> dict:
    rng = random.Random(wave)
    prompts_ids = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(prompts)]
    profiler = None
    if profile_steps:
        cuda = torch.cuda.is_available()
        profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]
            + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        )
        profiler.__enter__()
    submitted: dict[str, float] = {}
    first_token: dict[str, float] = {}
    for i, ids in enumerate(prompts_ids):
        rid = f"w{wave}-{i}"
        submitted[rid] = time.perf_counter()
        engine.add_request(
            EngineRequest(
                request_id=rid,
                prompt_token_ids=ids,
                params=SamplingParams(
                    temperature=0.0, max_tokens=decode_steps + 2, ignore_eos=True
                ),
                eos_token_ids=[],
                arrival_time=time.time(),
            )
        )
    steps: list[dict] = []
    after_first = 0
    while engine.has_unfinished_requests and after_first <= decode_steps:
        started = time.perf_counter()
        outputs = engine.step()
        ended = time.perf_counter()
        stats = engine.stats()  # the tokens of the step this call launched, if it launched one
        for output in outputs:
            if output.new_token_ids and output.request_id not in first_token:
                first_token[output.request_id] = ended
        steps.append(
            {
                "ms": 1000 * (ended - started),
                "tokens": sum(stats.step_tokens),
                "running": stats.num_running,
            }
        )
        if profiler is not None and len(steps) == profile_steps:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            profiler.__exit__(None, None, None)
            tables = [("cpu", "self_cpu_time_total")]
            if torch.cuda.is_available():
                tables.append(("cuda", "self_cuda_time_total"))
            for name, key in tables:
                table = profiler.key_averages().table(sort_by=key, row_limit=40)
                (out.parent / f"{out.stem}_wave{wave}_{name}.txt").write_text(table)
            profiler = None
        if len(first_token) == prompts:
            after_first += 1
    engine.abort(list(submitted))  # the rest is not timed
    while engine.has_unfinished_requests:
        engine.step()
    ttft = sorted(1000 * (first_token[r] - submitted[r]) for r in first_token)
    return {
        "wave": wave,
        "ttft_ms": ttft,
        "mean_ttft_ms": sum(ttft) / len(ttft),
        "last_ttft_ms": ttft[-1],
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--prompt-len", type=int, default=4104)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=20480)
    parser.add_argument("--profile-steps", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--revision", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    engine = EngineCore(
        EngineArgs(
            model=str(args.model_dir),
            device=args.device,
            dtype="bfloat16",
            max_model_len=args.max_model_len,
        )
    )
    captured = 0
    while engine.capture_pending_graph():
        captured += 1
    vocab = engine.model.cfg.vocab_size
    waves = [
        run_wave(
            engine,
            wave,
            args.prompts,
            args.prompt_len,
            args.decode_steps,
            vocab,
            args.profile_steps,
            args.out,
        )
        for wave in range(args.waves)
    ]
    for wave in waves:
        head = ", ".join(f"{s['tokens']}t {s['ms']:.1f}ms" for s in wave["steps"][:8])
        print(
            f"wave {wave['wave']}: mean TTFT {wave['mean_ttft_ms']:.0f} ms, last "
            f"{wave['last_ttft_ms']:.0f} ms, {len(wave['steps'])} steps; first: {head}"
        )
    args.out.write_text(
        json.dumps(
            {
                "revision": args.revision or git_revision(),
                "model_dir": str(args.model_dir),
                "prompts": args.prompts,
                "prompt_len": args.prompt_len,
                "graphs_captured_before": captured,
                "max_num_batched_tokens": engine.scheduler.config.max_num_batched_tokens,
                "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
                "waves": waves,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
