"""`pegainfer-bench serve`: online serving load, generated and reported as `vllm bench serve` does.

Prompts are random and exactly --input-len tokens long in the server's tokenizer (token ids for
completions, text for chat). They are sent at --request-rate with Poisson arrivals (seeded
exponential gaps), or all at once for `inf`, at most --max-concurrency in flight. Warm-up
requests have prompts of their own and are not counted.

--sweep runs one pass per rate, pass i with seed --seed + i so that no pass finds an earlier
pass's prompts in the prefix cache, and writes a JSON per rate, a markdown table and a plot.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from pegainfer.server.bench import server_side
from pegainfer.server.bench.client import BenchClient, Generation, RequestResult
from pegainfer.server.bench.datasets import RandomTokens
from pegainfer.server.bench.options import (
    add_common_args,
    non_negative_int,
    positive_int,
    rate,
    subcommand,
)
from pegainfer.server.bench.report import (
    block,
    markdown_table,
    plot_sweep,
    print_failures,
    rate_label,
    start_run,
    write_json,
)
from pegainfer.server.bench.stats import (
    latency_summary,
    peak_concurrency,
    peak_output_throughput,
    token_totals,
)

_SWEEP_COLUMNS = (
    ("rate (req/s)", "request_rate"),
    ("completed", "completed"),
    ("failed", "failed"),
    ("output tok/s", "output_throughput"),
    ("total tok/s", "total_token_throughput"),
    ("mean TTFT (ms)", "mean_ttft_ms"),
    ("p99 TTFT (ms)", "p99_ttft_ms"),
    ("mean TPOT (ms)", "mean_tpot_ms"),
    ("p99 TPOT (ms)", "p99_tpot_ms"),
    ("peak concurrency", "max_concurrent_requests"),
)


def sweep_rates(text: str) -> list[float]:
    rates = [rate(part) for part in text.split(",")]
    if not all(math.isfinite(r) for r in rates):
        raise argparse.ArgumentTypeError("sweep rates must be finite (they are the plot's x axis)")
    return rates


def add_parser(subparsers: Any) -> None:
    parser = subcommand(subparsers, "serve", __doc__)
    add_common_args(parser)
    load = parser.add_argument_group("load")
    load.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="/v1/completions with token-id prompts, or /v1/chat/completions with text "
        "(default: %(default)s)",
    )
    load.add_argument(
        "--input-len", type=positive_int, default=1024, help="prompt tokens (default: 1024)"
    )
    load.add_argument(
        "--output-len", type=positive_int, default=128, help="output tokens (default: 128)"
    )
    load.add_argument(
        "--shared-prefix-len",
        type=non_negative_int,
        default=0,
        help="leading prompt tokens every request shares, for the prefix cache (default: 0)",
    )
    load.add_argument(
        "--num-prompts", type=positive_int, default=1000, help="requests measured (default: 1000)"
    )
    load.add_argument(
        "--request-rate", type=rate, default=float("inf"), help="requests/s or inf (default)"
    )
    load.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=None,
        help="requests in flight at most (default: no limit)",
    )
    load.add_argument(
        "--num-warmups",
        type=non_negative_int,
        default=0,
        help="uncounted requests first (default: 0)",
    )
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument(
        "--sweep",
        type=sweep_rates,
        default=None,
        metavar="RATE,RATE,...",
        help="one pass per request rate (replaces --request-rate)",
    )
    sweep.add_argument(
        "--sweep-seconds",
        type=float,
        default=None,
        metavar="S",
        help="each pass sends ceil(rate × S) requests (at least 8) instead of --num-prompts, so "
        "slow rates end soon and fast ones still reach a steady state",
    )
    sweep.add_argument(
        "--result-dir",
        type=Path,
        default=Path("."),
        help="where --sweep writes serve-rate-RATE.json, sweep.md and sweep.png (default: .)",
    )
    parser.set_defaults(run=main)


def main(args: argparse.Namespace) -> dict[str, Any]:
    if args.shared_prefix_len > args.input_len:
        raise SystemExit("--shared-prefix-len must not exceed --input-len")
    if args.sweep is not None and args.result_json is not None:
        raise SystemExit("--sweep writes one JSON per rate into --result-dir; drop --result-json")
    return asyncio.run(_main(args))


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    async with BenchClient(args.base_url, args.api_key) as client:
        generation, metadata = await start_run(client, args, args.output_len)
        tokens = await RandomTokens.create(client)
        if args.sweep is None:
            result = await _run(client, tokens, generation, args, args.request_rate, args.seed)
            result = metadata | result
            if args.result_json:
                write_json(args.result_json, result)
            return result
        results = []
        for i, request_rate in enumerate(args.sweep):
            count = args.num_prompts
            if args.sweep_seconds is not None:
                count = max(8, math.ceil(request_rate * args.sweep_seconds))
            pass_args = argparse.Namespace(**vars(args) | {"num_prompts": count})
            result = metadata | await _run(
                client, tokens, generation, pass_args, request_rate, args.seed + i
            )
            write_json(args.result_dir / f"serve-rate-{request_rate:g}.json", result)
            results.append(result)
    return _write_sweep(results, args.result_dir, _sweep_title(generation, args))


async def _run(
    client: BenchClient,
    tokens: RandomTokens,
    generation: Generation,
    args: argparse.Namespace,
    request_rate: float,
    seed: int,
) -> dict[str, Any]:
    """One pass at one rate: send, measure, print the report; return the result record."""
    prompts = await _prompts(tokens, args, seed)
    send = _sender(client, generation, args.endpoint)
    limit = (
        asyncio.Semaphore(args.max_concurrency)
        if args.max_concurrency
        else contextlib.nullcontext()
    )

    async def limited(prompt: Any) -> RequestResult:
        async with limit:
            return await send(prompt)

    warmups = await asyncio.gather(*map(limited, prompts[: args.num_warmups]))
    print_failures("warm-up", warmups)
    server_before = await server_side.scrape(client)
    start = time.perf_counter()
    tasks = []
    arrivals = arrival_times(args.num_prompts, request_rate, seed)
    for prompt, at in zip(prompts[args.num_warmups :], arrivals, strict=True):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(limited(prompt)))
    results: list[RequestResult] = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    server = server_side.breakdown(server_before, await server_side.scrape(client))
    print_failures("benchmark", results)
    result = _record(args, generation, request_rate, seed, results, start, duration)
    result["server"] = server
    print(_report(result))
    return result


def arrival_times(count: int, request_rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: a Poisson process at `request_rate`, or all at 0."""
    if math.isinf(request_rate):
        return [0.0] * count
    gaps = random.Random(f"{seed}:arrivals")
    return list(itertools.accumulate(gaps.expovariate(request_rate) for _ in range(count)))


async def _prompts(
    tokens: RandomTokens, args: argparse.Namespace, seed: int
) -> list[str] | list[list[int]]:
    """The warm-up prompts, then the measured ones: texts for chat, token ids otherwise."""
    keys = [f"{seed}:{i}" for i in range(args.num_warmups + args.num_prompts)]
    prefix = tokens.ids(args.shared_prefix_len, f"{seed}:prefix")
    if args.endpoint == "chat":
        return await tokens.texts([args.input_len] * len(keys), keys, prefix)
    return [prefix + tokens.ids(args.input_len - len(prefix), key) for key in keys]


def _sender(
    client: BenchClient, generation: Generation, endpoint: str
) -> Callable[[Any], Awaitable[RequestResult]]:
    if endpoint == "chat":
        return lambda text: client.chat([{"role": "user", "content": text}], generation)
    return lambda prompt: client.completion(prompt, generation)


def _record(
    args: argparse.Namespace,
    generation: Generation,
    request_rate: float,
    seed: int,
    results: Sequence[RequestResult],
    start: float,
    duration: float,
) -> dict[str, Any]:
    return {
        "benchmark": "serve",
        "base_url": args.base_url,
        "model_id": generation.model,
        "endpoint": args.endpoint,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "shared_prefix_len": args.shared_prefix_len,
        "num_prompts": args.num_prompts,
        "request_rate": rate_label(request_rate),
        "max_concurrency": args.max_concurrency,
        "num_warmups": args.num_warmups,
        "seed": seed,
        "ignore_eos": generation.ignore_eos,
        "temperature": generation.temperature,
        "duration": duration,
        **token_totals(results, duration),
        "max_output_tokens_per_s": peak_output_throughput(results),
        "max_concurrent_requests": peak_concurrency(results),
        **latency_summary(results),
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "start_times": [r.start_time - start for r in results],
        "errors": [r.error for r in results],
    }


def _report(result: dict[str, Any]) -> str:
    rows: list[tuple[str, Any]] = [
        ("Successful requests:", result["completed"]),
        ("Failed requests:", result["failed"]),
    ]
    if result["max_concurrency"] is not None:
        rows.append(("Maximum request concurrency:", result["max_concurrency"]))
    if result["request_rate"] != "inf":
        rows.append(("Request rate configured (RPS):", result["request_rate"]))
    rows += [
        ("Benchmark duration (s):", result["duration"]),
        ("Total input tokens:", result["total_input_tokens"]),
        ("Total generated tokens:", result["total_output_tokens"]),
        ("Prefix cache hit tokens:", result["total_cached_tokens"]),
        ("Request throughput (req/s):", result["request_throughput"]),
        ("Output token throughput (tok/s):", result["output_throughput"]),
        ("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"]),
        ("Peak concurrent requests:", result["max_concurrent_requests"]),
        ("Total token throughput (tok/s):", result["total_token_throughput"]),
        *server_side.report_rows(result.get("server", {})),
    ]
    return block("Serving Benchmark Result", rows, result)


def _sweep_title(generation: Generation, args: argparse.Namespace) -> str:
    title = (
        f"{generation.model}: {args.endpoint}, {args.input_len} in / {args.output_len} out, "
        + (f"{args.num_prompts} prompts per rate" if args.sweep_seconds is None
           else f"rate × {args.sweep_seconds:g} s of prompts per rate")
    )  # fmt: skip
    if args.max_concurrency is not None:
        title += f", concurrency ≤ {args.max_concurrency}"
    return title


def _write_sweep(results: list[dict[str, Any]], out_dir: Path, title: str) -> dict[str, Any]:
    """The sweep's markdown table (printed too) and plot; returns what was written where."""
    headers = [header for header, _ in _SWEEP_COLUMNS]
    table = markdown_table(headers, [[r[key] for _, key in _SWEEP_COLUMNS] for r in results])
    (out_dir / "sweep.md").write_text(f"# {title}\n\n{table}\n")
    print(table)
    plot_sweep(results, out_dir / "sweep.png", title)
    return {
        "sweep": results,
        "table": str(out_dir / "sweep.md"),
        "plot": str(out_dir / "sweep.png"),
    }
