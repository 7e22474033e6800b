"""`pegainfer-bench prefix`: time to first token by prompt length, with the prefix cold and warm.

For each length, one random prompt is sent once to a server that has never seen it (cold: the
whole prefill), then again and again (warm: every full block comes from the prefix cache and
only the tail is computed). Requests go one at a time and ask for one token, so TTFT is the
prefill or the cache hit and nothing else. With --chat the prompt is one user message of random
text instead of token ids, so TTFT also holds what a chat request costs before the engine sees
it (rendering the template, tokenizing the text).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
from typing import Any

from pegainfer.server.bench import report, stats
from pegainfer.server.bench.client import BenchClient
from pegainfer.server.bench.datasets import RandomTokens
from pegainfer.server.bench.options import add_common_args, positive_int, subcommand

_DEFAULT_LENGTHS = "256,512,1024,2048,4096,8192,16384"


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    async with BenchClient(args.base_url, args.api_key) as client:
        generation, metadata = await report.start_run(client, args, max_tokens=1)
        tokens = await RandomTokens.create(client)
        rows = []
        for length in args.lengths:
            key = f"{args.seed}:prefix:{length}"
            if args.chat:
                messages = [{"role": "user", "content": await tokens.text(length, key)}]
                send = functools.partial(client.chat, messages, generation)
            else:
                send = functools.partial(client.completion, tokens.ids(length, key), generation)
            cold = await send()
            warm = [await send() for _ in range(args.warm_runs)]
            ok = [r for r in warm if r.success]
            ttfts = [r.ttft * 1e3 for r in ok]
            rows.append({
                "prompt_len": length,
                "cold_ttft_ms": cold.ttft * 1e3 if cold.success else None,
                "warm_ttft_p50_ms": stats.percentile(ttfts, 50),
                "warm_ttft_p99_ms": stats.percentile(ttfts, 99),
                "warm_ttft_mean_ms": stats.mean(ttfts),
                "warm_cached_tokens": min((r.cached_tokens or 0 for r in ok), default=0),
                "failed": (not cold.success) + len(warm) - len(ok),
            })  # fmt: skip
            report.print_failures(f"prefix {length}", [cold, *warm])
        result = {
            "benchmark": "prefix",
            **metadata,
            "base_url": args.base_url,
            "model_id": generation.model,
            "warm_runs": args.warm_runs,
            "chat": args.chat,
            "seed": args.seed,
            "rows": rows,
        }
    headers = ["prompt", "cold ms", "warm p50 ms", "warm p99 ms", "cached", "failed"]
    table = [
        [r["prompt_len"], r["cold_ttft_ms"], r["warm_ttft_p50_ms"], r["warm_ttft_p99_ms"],
         r["warm_cached_tokens"], r["failed"]]
        for r in rows
    ]  # fmt: skip
    print(report.markdown_table(headers, table))
    if args.result_json:
        report.write_json(args.result_json, result)
    return result


def main(args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_main(args))


def add_parser(subparsers: Any) -> None:
    parser = subcommand(subparsers, "prefix", __doc__)
    add_common_args(parser)
    parser.add_argument(
        "--lengths",
        type=lambda text: [positive_int(v) for v in text.split(",")],
        default=[int(v) for v in _DEFAULT_LENGTHS.split(",")],
        help=f"prompt lengths in tokens (default: {_DEFAULT_LENGTHS})",
    )
    parser.add_argument(
        "--warm-runs", type=positive_int, default=20, help="warm requests per length (default: 20)"
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="send each prompt as a chat message of random text (the lengths count its tokens "
        "without the template's) instead of token ids",
    )
    parser.set_defaults(run=main)
