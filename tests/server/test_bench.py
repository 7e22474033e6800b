"""`pegainfer-bench serve` and `multiturn` against the shared tiny server, and their parts."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from typing import Any

import httpx
import numpy as np
import pytest

from pegainfer.server.bench import cli, multiturn, report, serve
from pegainfer.server.bench.client import BenchClient, Generation, RequestResult
from pegainfer.server.bench.datasets import RandomTokens
from pegainfer.server.bench.serve import arrival_times
from pegainfer.server.bench.stats import latency_summary, peak_concurrency, percentile
from tests.server.conftest import Server, free_port
from tests.server.helpers import tokenize

IN, OUT = 16, 8


def bench(server: Server, *argv: str) -> dict[str, Any]:
    """Run a subcommand in-process, as the console script would, and return its result."""
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers(required=True)
    serve.add_parser(subparsers)
    multiturn.add_parser(subparsers)
    args = parser.parse_args([argv[0], "--base-url", server.url, *argv[1:]])
    return args.run(args)


def assert_exact(result: dict[str, Any], num_prompts: int, prompt_len: int) -> None:
    """Every request succeeded with exact lengths and consistent timings."""
    assert result["completed"] == num_prompts and result["failed"] == 0, result["errors"]
    assert result["input_lens"] == [prompt_len] * num_prompts
    assert result["output_lens"] == [OUT] * num_prompts
    assert result["total_output_tokens"] == OUT * num_prompts
    for ttft, itls, latency in zip(
        result["ttfts"], result["itls"], result["latencies"], strict=True
    ):
        assert ttft > 0
        # A stream whose reader falls behind gets the tokens queued meanwhile in one event
        # (as vLLM's does): at most one gap per token after the first.
        assert len(itls) <= OUT - 1
        assert latency >= ttft
        assert latency == pytest.approx(ttft + sum(itls))
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < result[f"median_{metric}_ms"] <= result[f"p99_{metric}_ms"]
    assert result["mean_e2el_ms"] >= result["mean_ttft_ms"]
    assert result["output_throughput"] > 0 and result["request_throughput"] > 0


def test_serve_completions_at_once(server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    argv = ["serve", "--base-url", server.url, "--input-len", str(IN), "--output-len", str(OUT),
            "--num-prompts", "6", "--result-json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    result = json.loads(out.read_text())
    assert_exact(result, 6, IN)
    assert result["model_id"] == server.model
    assert result["request_rate"] == "inf" and result["max_concurrency"] is None
    assert result["total_cached_tokens"] == 0  # every prompt differs from its first token
    assert {"command", "date", "revision", "server_version"} <= set(result)
    assert result["server_version"]
    # The server's own account of the run: 6 requests' phases, and its steps' tokens cover
    # every prompt token and every fed-back output token (no other requests ran meanwhile).
    server_side = result["server"]
    assert server_side["mean_queue_ms"] >= 0 and server_side["mean_prefill_ms"] > 0
    tokens = server_side["engine_steps"] * server_side["mean_step_tokens"]
    assert round(tokens) == 6 * IN + 6 * (OUT - 1)
    report = capsys.readouterr().out
    assert "Serving Benchmark Result" in report and "Server mean queue time (ms):" in report


def test_serve_chat_poisson_with_concurrency_limit(server):
    result = bench(server, "serve", "--endpoint", "chat", "--input-len", str(IN),
                   "--output-len", str(OUT), "--num-prompts", "6", "--request-rate", "40",
                   "--max-concurrency", "2", "--num-warmups", "1")  # fmt: skip
    overhead = len(tokenize(server, messages=[{"role": "user", "content": ""}]))
    assert_exact(result, 6, IN + overhead)
    assert result["request_rate"] == 40
    assert 1 <= result["max_concurrent_requests"] <= 2
    assert max(result["start_times"]) > 0  # spread over time, not sent at once


def test_chat_texts_tokenize_to_the_exact_length(server):
    async def texts() -> list[str]:
        async with BenchClient(server.url) as client:
            tokens = await RandomTokens.create(client)
            return await tokens.texts([IN, 3, 100], ["0:a", "0:b", "0:c"])

    made = asyncio.run(texts())
    assert [len(tokenize(server, prompt=t, add_special_tokens=False)) for t in made] == [IN, 3, 100]
    assert asyncio.run(texts()) == made  # seeded


def test_shared_prefix_is_served_from_the_prefix_cache(server):
    # Blocks are 8 tokens: a 16-token shared prefix is two cached blocks for every later request.
    result = bench(server, "serve", "--input-len", "24", "--output-len", str(OUT),
                   "--num-prompts", "3", "--max-concurrency", "1", "--shared-prefix-len", "16",
                   "--seed", "11")  # fmt: skip
    assert result["failed"] == 0
    assert result["total_cached_tokens"] == 2 * 16


def test_failed_requests_are_counted_not_raised(server):
    async def attempts() -> list[RequestResult]:
        generation = Generation(server.model, OUT)
        async with BenchClient(f"http://127.0.0.1:{free_port()}") as nobody:
            refused = await nobody.completion([1, 2, 3], generation)
        async with BenchClient(server.url) as client:
            wrong_model = await client.completion([1, 2, 3], Generation("no-such-model", OUT))
            return [refused, wrong_model]

    refused, wrong_model = asyncio.run(attempts())
    assert not refused.success and "ConnectError" in refused.error
    assert not wrong_model.success and wrong_model.error.startswith("HTTP 404")

    result = bench(server, "serve", "--model", "no-such-model", "--input-len", str(IN),
                   "--output-len", str(OUT), "--num-prompts", "3")  # fmt: skip
    assert result["completed"] == 0 and result["failed"] == 3
    assert all(error.startswith("HTTP 404") for error in result["errors"])


def test_sweep_writes_a_json_per_rate_a_table_and_a_plot(server, tmp_path):
    pytest.importorskip("matplotlib")
    result = bench(server, "serve", "--input-len", str(IN), "--output-len", str(OUT),
                   "--num-prompts", "3", "--sweep", "20,50", "--seed", "3",
                   "--result-dir", str(tmp_path))  # fmt: skip
    for rate, seed in ((20, 3), (50, 4)):  # a fresh seed per pass: no prefix-cache reuse
        record = json.loads((tmp_path / f"serve-rate-{rate}.json").read_text())
        assert (record["request_rate"], record["seed"]) == (rate, seed)
        assert_exact(record, 3, IN)
    assert [r["request_rate"] for r in result["sweep"]] == [20, 50]
    table = (tmp_path / "sweep.md").read_text().splitlines()
    assert table[-2].startswith("| 20.00 |") and table[-1].startswith("| 50.00 |")
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_seconds_sizes_each_pass_by_its_rate(server, tmp_path):
    pytest.importorskip("matplotlib")
    bench(server, "serve", "--input-len", str(IN), "--output-len", str(OUT), "--sweep", "4,40",
          "--sweep-seconds", "0.5", "--result-dir", str(tmp_path))  # fmt: skip
    for rate, count in ((4, 8), (40, 20)):  # ceil(rate × 0.5), at least 8
        record = json.loads((tmp_path / f"serve-rate-{rate}.json").read_text())
        assert record["num_prompts"] == count
        assert_exact(record, count, IN)
    assert "rate × 0.5 s of prompts per rate" in (tmp_path / "sweep.md").read_text()


def test_multiturn_prompts_grow_turn_by_turn(server, tmp_path):
    out = tmp_path / "multiturn.json"
    result = bench(server, "multiturn", "--conversations", "2", "--turns", "2",
                   "--concurrency", "2", "--first-turn-len", str(IN), "--turn-len", "8",
                   "--output-len", str(OUT), "--result-json", str(out))  # fmt: skip
    assert json.loads(out.read_text()) == result
    assert (result["completed"], result["failed"], result["abandoned_turns"]) == (4, 0, 0)
    assert [row["turn"] for row in result["per_turn"]] == [1, 2]
    assert all(row["completed"] == 2 and row["mean_ttft_ms"] > 0 for row in result["per_turn"])
    prompt = {(r["conversation"], r["turn"]): r["prompt_len"] for r in result["requests"]}
    for conversation in (0, 1):
        # The second turn carries the first, the reply and 8 new tokens.
        assert prompt[conversation, 2] > prompt[conversation, 1] + 8
    assert all(r["output_len"] == OUT for r in result["requests"])
    # The second turn's prompt starts with the first turn's: the prefix cache serves it.
    assert result["per_turn"][1]["mean_cached_tokens"] > 0


def test_sse_parsing_follows_vllms_client():
    """Comments skipped, events split across reads, the role preamble not a token, usage read."""
    events = [
        b": ping\n\n",
        b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n',
        b'data: {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}\n\n',
        b'data: {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "length"}]}'
        b"\n\n",
        b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, '
        b'"prompt_tokens_details": {"cached_tokens": 4}}}\n\n',
        b"data: [DONE]\n\n",
    ]
    raw = b"".join(events)

    async def stream():
        for i in range(0, len(raw), 7):  # reads that cut events (and lines) anywhere
            yield raw[i : i + 7]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=stream())

    async def run() -> RequestResult:
        async with BenchClient("http://bench.test") as client:
            client.http = httpx.AsyncClient(
                base_url="http://bench.test", transport=httpx.MockTransport(handler)
            )
            return await client.chat([{"role": "user", "content": "hi"}], Generation("m", 2))

    result = asyncio.run(run())
    assert result.success, result.error
    assert (result.prompt_len, result.output_len, result.cached_tokens) == (5, 2, 4)
    assert result.generated_text == "Hello"
    assert len(result.itl) == 1 and result.latency >= result.ttft > 0


def test_stats_match_numpy_and_vllm_definitions():
    values = [random.Random(1).uniform(0, 10) for _ in range(37)]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([], 99) == 0.0
    one_token = RequestResult(success=True, output_len=1, ttft=0.5, latency=0.5, start_time=0)
    three = RequestResult(success=True, output_len=3, ttft=0.1, itl=[0.2, 0.4], latency=0.7,
                          start_time=0.6)  # fmt: skip
    failed = RequestResult(success=False, start_time=0.1, latency=9)
    summary = latency_summary([one_token, three, failed])
    assert summary["mean_tpot_ms"] == pytest.approx(300)  # (0.7 - 0.1) / 2; 1-token excluded
    assert summary["mean_ttft_ms"] == pytest.approx(300)
    assert summary["mean_itl_ms"] == pytest.approx(300)
    assert peak_concurrency([one_token, three, failed]) == 1  # [0, .5) and [.6, 1.3) don't meet


def test_poisson_arrivals_are_seeded_and_at_the_rate():
    times = arrival_times(4000, 50.0, seed=0)
    assert times == arrival_times(4000, 50.0, seed=0) != arrival_times(4000, 50.0, seed=1)
    assert times == sorted(times)
    assert times[-1] / len(times) == pytest.approx(1 / 50, rel=0.1)
    assert arrival_times(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]


def test_revision_comes_from_the_environment_where_the_tree_has_no_git(monkeypatch):
    from pegainfer.server.bench.report import git_revision

    monkeypatch.setenv("PEGAINFER_REVISION", "0123abcd")
    assert git_revision() == "0123abcd"
    monkeypatch.delenv("PEGAINFER_REVISION")
    assert git_revision() != "0123abcd"


def test_the_sweep_plot_without_the_bench_extra_says_what_to_install(monkeypatch, tmp_path):
    """pegainfer-bench comes with the server; its plots need the bench extra (#28 item 16)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(SystemExit, match=r"pip install 'pegainfer-server\[bench\]'"):
        report.plot_sweep([], tmp_path / "sweep.png", "sweep")
    assert not (tmp_path / "sweep.png").exists()
