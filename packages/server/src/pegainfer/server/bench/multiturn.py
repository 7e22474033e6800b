"""`pegainfer-bench multiturn`: chat conversations that grow turn by turn, for the prefix cache.

--concurrency workers each carry one conversation at a time, --conversations in all. Turn 1
sends --first-turn-len tokens of random user text; each later turn sends the whole history
(the earlier user turns and the assistant's replies as they came back) plus --turn-len new
random user tokens, so a server with a prefix cache recomputes little more than the new part.
Replies are --output-len tokens. A failed turn ends its conversation. TTFT and TPOT are
reported per turn index and overall.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pegainfer.server.bench import server_side
from pegainfer.server.bench.client import BenchClient, Generation, RequestResult
from pegainfer.server.bench.datasets import RandomTokens
from pegainfer.server.bench.options import add_common_args, positive_int, subcommand
from pegainfer.server.bench.report import (
    block,
    markdown_table,
    print_failures,
    start_run,
    write_json,
)
from pegainfer.server.bench.stats import latency_summary, mean, token_totals

_TURN_COLUMNS = (
    ("turn", "turn"),
    ("completed", "completed"),
    ("failed", "failed"),
    ("prompt tokens", "mean_prompt_tokens"),
    ("cached tokens", "mean_cached_tokens"),
    ("mean TTFT (ms)", "mean_ttft_ms"),
    ("p50 TTFT (ms)", "median_ttft_ms"),
    ("p99 TTFT (ms)", "p99_ttft_ms"),
    ("mean TPOT (ms)", "mean_tpot_ms"),
    ("p50 TPOT (ms)", "median_tpot_ms"),
    ("p99 TPOT (ms)", "p99_tpot_ms"),
)


@dataclass
class Turn:
    conversation: int
    turn: int  # from 1
    result: RequestResult


def add_parser(subparsers: Any) -> None:
    parser = subcommand(subparsers, "multiturn", __doc__)
    add_common_args(parser)
    load = parser.add_argument_group("conversations")
    load.add_argument("--conversations", type=positive_int, default=20, help="in all (default: 20)")
    load.add_argument(
        "--turns", type=positive_int, default=5, help="user turns per conversation (default: 5)"
    )
    load.add_argument(
        "--concurrency",
        type=positive_int,
        default=10,
        help="conversations in flight at once (default: 10)",
    )
    load.add_argument(
        "--first-turn-len",
        type=positive_int,
        default=4096,
        help="user tokens of turn 1 (default: 4096)",
    )
    load.add_argument(
        "--turn-len",
        type=positive_int,
        default=1024,
        help="new user tokens of each later turn (default: 1024)",
    )
    load.add_argument(
        "--output-len", type=positive_int, default=128, help="tokens per reply (default: 128)"
    )
    parser.set_defaults(run=main)


def main(args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_main(args))


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    async with BenchClient(args.base_url, args.api_key) as client:
        generation, metadata = await start_run(client, args, args.output_len)
        user_turns = await _user_turns(await RandomTokens.create(client), args)
        turns: list[Turn] = []

        async def converse(conversation: int) -> None:
            history: list[dict[str, str]] = []
            for index, text in enumerate(user_turns[conversation], start=1):
                history.append({"role": "user", "content": text})
                result = await client.chat(list(history), generation)
                turns.append(Turn(conversation, index, result))
                if not result.success:
                    return
                history.append({"role": "assistant", "content": result.generated_text})

        pending = iter(range(args.conversations))

        async def worker() -> None:
            for conversation in pending:  # shared: each worker takes the next one
                await converse(conversation)

        server_before = await server_side.scrape(client)
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(args.concurrency, args.conversations))))
        duration = time.perf_counter() - start
        server = server_side.breakdown(server_before, await server_side.scrape(client))
    print_failures("conversation", [t.result for t in turns])
    result = metadata | _record(args, generation, turns, start, duration) | {"server": server}
    print(_report(result))
    if args.result_json:
        write_json(args.result_json, result)
    return result


async def _user_turns(tokens: RandomTokens, args: argparse.Namespace) -> list[list[str]]:
    """Every conversation's user texts, made before the clock starts."""
    lengths = [args.first_turn_len] + [args.turn_len] * (args.turns - 1)
    keys = [f"{args.seed}:{c}:{t}" for c in range(args.conversations) for t in range(args.turns)]
    texts = await tokens.texts(lengths * args.conversations, keys)
    return [texts[c * args.turns : (c + 1) * args.turns] for c in range(args.conversations)]


def _record(
    args: argparse.Namespace,
    generation: Generation,
    turns: Sequence[Turn],
    start: float,
    duration: float,
) -> dict[str, Any]:
    results = [t.result for t in turns]
    per_turn = []
    for index in range(1, args.turns + 1):
        these = [t.result for t in turns if t.turn == index]
        done = [r for r in these if r.success]
        per_turn.append(
            {
                "turn": index,
                "completed": len(done),
                "failed": len(these) - len(done),
                "mean_prompt_tokens": mean([r.prompt_len for r in done]),
                "mean_cached_tokens": mean([r.cached_tokens or 0 for r in done]),
                **latency_summary(these),
            }
        )
    return {
        "benchmark": "multiturn",
        "base_url": args.base_url,
        "model_id": generation.model,
        "conversations": args.conversations,
        "turns": args.turns,
        "concurrency": args.concurrency,
        "first_turn_len": args.first_turn_len,
        "turn_len": args.turn_len,
        "output_len": args.output_len,
        "seed": args.seed,
        "ignore_eos": generation.ignore_eos,
        "temperature": generation.temperature,
        "duration": duration,
        **token_totals(results, duration),
        # Turns never sent because an earlier turn of their conversation failed.
        "abandoned_turns": args.conversations * args.turns - len(turns),
        **latency_summary(results),
        "per_turn": per_turn,
        "requests": [
            {
                "conversation": t.conversation,
                "turn": t.turn,
                "success": t.result.success,
                "prompt_len": t.result.prompt_len,
                "output_len": t.result.output_len,
                "cached_tokens": t.result.cached_tokens,
                "ttft": t.result.ttft,
                "itls": t.result.itl,
                "latency": t.result.latency,
                "start_time": t.result.start_time - start,
                "error": t.result.error,
            }
            for t in turns
        ],
    }


def _report(result: dict[str, Any]) -> str:
    rows: list[tuple[str, Any]] = [
        ("Conversations x turns:", f"{result['conversations']} x {result['turns']}"),
        ("Concurrency (conversations):", result["concurrency"]),
        ("Successful requests:", result["completed"]),
        ("Failed requests:", result["failed"]),
        ("Abandoned turns:", result["abandoned_turns"]),
        ("Benchmark duration (s):", result["duration"]),
        ("Total input tokens:", result["total_input_tokens"]),
        ("Total generated tokens:", result["total_output_tokens"]),
        ("Prefix cache hit tokens:", result["total_cached_tokens"]),
        ("Output token throughput (tok/s):", result["output_throughput"]),
        ("Total token throughput (tok/s):", result["total_token_throughput"]),
        *server_side.report_rows(result.get("server", {})),
    ]
    rows_by_turn = [[row[key] for _, key in _TURN_COLUMNS] for row in result["per_turn"]]
    table = markdown_table([header for header, _ in _TURN_COLUMNS], rows_by_turn)
    return block("Multi-turn Benchmark Result", rows, result) + "\n" + table
