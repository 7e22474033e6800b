"""Many streams at once, and clients that go away: their requests are aborted and freed."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlparse

import httpx
import pytest
from openai import AsyncOpenAI

from tests.server.conftest import Server, start_server, stop_server
from tests.server.helpers import PROMPT, Snapshot, metric, metrics, tokenize, wait_until

NUM_STREAMS = 64
MAX_TOKENS = 12
LONG = 480  # with a 7-token prompt, close to the 512-token context: never done in time


def aborts(url: str) -> float:
    return _aborts(metrics(url))


def _aborts(snapshot: Snapshot) -> float:
    return metric(snapshot, "vllm:request_success_total", finished_reason="abort")


def _wait_while_generating(url: str, done: Callable[[Snapshot], bool], what: str,
                           stalled_s: float = 60.0) -> None:  # fmt: skip
    """Wait until `done`, however slowly the machine generates: fail only if no token was
    generated for `stalled_s` seconds, or if a request ran to its length instead."""
    lengths_before = metric(metrics(url), "vllm:request_success_total", finished_reason="length")
    tokens, progressed = -1.0, time.monotonic()
    while True:
        snapshot = metrics(url)
        if done(snapshot):
            return
        lengths = metric(snapshot, "vllm:request_success_total", finished_reason="length")
        assert lengths == lengths_before, f"a request ran to its length before {what}"
        now_tokens = metric(snapshot, "vllm:generation_tokens_total")
        if now_tokens != tokens:
            tokens, progressed = now_tokens, time.monotonic()
        assert time.monotonic() - progressed < stalled_s, f"no progress waiting for {what}"
        time.sleep(0.2)


def idle_after_aborts(url: str, expected_aborts: float) -> bool:
    """Nothing running, no KV blocks held, and the abort counted."""
    snapshot = metrics(url)
    return (
        metric(snapshot, "vllm:num_requests_running") == 0
        and metric(snapshot, "vllm:num_requests_waiting") == 0
        and metric(snapshot, "vllm:kv_cache_usage_perc") == 0.0
        and metric(snapshot, "vllm:request_success_total", finished_reason="abort")
        == expected_aborts
    )


async def cancel_after_chunks(url: str, chunks: int) -> int:
    """Start a long stream, read `chunks` events, then drop the connection."""
    body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
    seen = 0
    async with (
        httpx.AsyncClient(timeout=60) as client,
        client.stream("POST", url + "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen == chunks:
                    break
    return seen


def test_64_concurrent_streams_complete_with_exact_usage(server):
    prompts = [f"Request {i}: {PROMPT}" for i in range(NUM_STREAMS)]
    prompt_tokens = [len(tokenize(server, prompt=p)) for p in prompts]
    aborts_before = aborts(server.url)

    async def one(client: AsyncOpenAI, prompt: str):
        stream = await client.completions.create(
            model=server.model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [chunk async for chunk in stream]
        return chunks

    async def run():
        client = AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        try:
            # One more client hangs up mid-stream while the 64 run.
            return await asyncio.gather(
                *(one(client, p) for p in prompts), cancel_after_chunks(server.url, 2)
            )
        finally:
            await client.close()

    *results, cancelled_after = asyncio.run(asyncio.wait_for(run(), timeout=60))
    assert cancelled_after == 2
    ids = set()
    for chunks, expected_prompt in zip(results, prompt_tokens, strict=True):
        *content, last = chunks
        assert 1 <= len(content) <= MAX_TOKENS  # a reader behind gets several tokens at once
        assert content[-1].choices[0].finish_reason == "length"
        assert last.choices == []
        assert last.usage.completion_tokens == MAX_TOKENS
        assert last.usage.prompt_tokens == expected_prompt
        assert last.usage.total_tokens == expected_prompt + MAX_TOKENS
        ids |= {chunk.id for chunk in chunks}
    assert len(ids) == NUM_STREAMS
    wait_until(lambda: idle_after_aborts(server.url, aborts_before + 1), what="idle engine")


def test_cancelled_stream_frees_its_blocks(server):
    aborts_before = aborts(server.url)

    async def run() -> None:
        body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
        async with (
            httpx.AsyncClient(timeout=60) as client,
            client.stream("POST", server.url + "/v1/completions", json=body) as response,
        ):
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: {")
                if seen == 3:
                    break
            # While the stream is open it runs and holds KV blocks.
            snapshot = metrics(server.url)
            assert metric(snapshot, "vllm:num_requests_running") == 1
            assert metric(snapshot, "vllm:kv_cache_usage_perc") > 0.0
        # Leaving the block closes the connection mid-stream.

    asyncio.run(run())
    wait_until(lambda: idle_after_aborts(server.url, aborts_before + 1), what="abort to free")
    assert aborts(server.url) == aborts_before + 1


def test_disconnected_non_streaming_request_is_aborted(server):
    aborts_before = aborts(server.url)
    address = urlparse(server.url)
    body = json.dumps({"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {address.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        sock.sendall(request)
        wait_until(
            lambda: metric(metrics(server.url), "vllm:num_requests_running") == 1,
            what="the request to start running",
        )
    wait_until(lambda: idle_after_aborts(server.url, aborts_before + 1), what="abort to free")


UNSENT_LIMIT = 512  # --max-unsent-tokens of the slow-reader test's server


@pytest.fixture(scope="module")
def slow_reader_server(tiny_model, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("slow-reader") / "server.log"
    running = start_server(tiny_model, log, "--max-model-len", "512", "--max-num-seqs", "64",
                           "--max-unsent-tokens", str(UNSENT_LIMIT))  # fmt: skip
    yield running
    stop_server(running)


def test_a_client_that_stops_reading_has_its_stream_ended(slow_reader_server):
    """Nothing bounded what the server buffered for a client that does not read its stream
    (one n=64, logprobs=20 stream grew the server by 216 MB): past a limit the answer ends.

    The limit counts tokens, however the server groups them into events, so the answer's
    tokens exceed it whatever the machine's speed, by more than the sockets hold for a
    client with a 4 KB window (a few hundred events). A small limit is reached in a few steps
    even on a busy machine; the wait fails only if generation stops or a request runs to its
    length."""
    server = slow_reader_server
    assert NUM_STREAMS * LONG > 20 * UNSENT_LIMIT
    aborts_before = aborts(server.url)
    body = json.dumps({"prompt": "x", "max_tokens": LONG, "ignore_eos": True, "n": NUM_STREAMS,
                       "logprobs": 20, "stream": True}).encode()  # fmt: skip
    url = urlparse(server.url)
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # read nothing, hold little
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        # Every choice is aborted long before its 480 tokens, while the client holds on.
        _wait_while_generating(server.url, lambda s: _aborts(s) >= aborts_before + NUM_STREAMS,
                               "the unread stream's requests aborted")  # fmt: skip
    wait_until(lambda: idle_after_aborts(server.url, aborts_before + NUM_STREAMS),
               what="idle engine")  # fmt: skip
