"""SIGTERM with requests in flight (issue 28, item 24): they get `--shutdown-timeout` seconds
to finish; what is left then ends with a proper error (a 503 JSON body, or an error event and
[DONE] in a stream), and the server exits cleanly."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import Server, start_server
from tests.server.helpers import PROMPT, assert_error, metric, metrics, sse_payloads, wait_until

# A request that runs for seconds on the tiny model (one token per step), so that it is still
# generating when the signal comes.
LONG = 100


@dataclass
class InFlight:
    """A request running on a thread: its response, and when its first and last bytes came."""

    stream: bool
    response: httpx.Response | None = None
    body: bytes = b""
    first_byte: threading.Event = field(default_factory=threading.Event)
    finished_at: float = 0.0


def _send(server: Server, request: InFlight, max_tokens: int) -> None:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": request.stream}  # fmt: skip
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    url = server.base_url + "/completions"
    with httpx.stream("POST", url, json=body, timeout=300) as response:
        request.response = response
        for chunk in response.iter_bytes():
            request.body += chunk
            request.first_byte.set()
    request.finished_at = time.monotonic()


@pytest.fixture
def launch(tiny_model: Path, tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """Start a server of its own (the test stops it); kill it if the test did not."""
    started: list[Server] = []

    def start(*args: str) -> Server:
        env = os.environ | {"PYTHONUNBUFFERED": "1"}
        server = start_server(tiny_model, tmp_path / "server.log", "--max-model-len", "2048",
                              *args, env=env)  # fmt: skip
        started.append(server)
        return server

    yield start
    for server in started:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


def _start_requests(
    server: Server, max_tokens: int
) -> tuple[list[InFlight], list[threading.Thread]]:
    """Two streams and one plain request, all generating (the streams have sent their first
    bytes, the engine runs all three) when this returns."""
    requests = [InFlight(stream=True), InFlight(stream=True), InFlight(stream=False)]
    threads = [threading.Thread(target=_send, args=(server, r, max_tokens)) for r in requests]
    for thread in threads:
        thread.start()
    for request in requests[:2]:
        assert request.first_byte.wait(60), "a stream sent nothing"
    wait_until(lambda: metric(metrics(server.url), "vllm:num_requests_running") == 3,
               timeout=60, what="three requests running")  # fmt: skip
    return requests, threads


def _sigterm_and_wait(server: Server, threads: list[threading.Thread]) -> float:
    """Send SIGTERM; wait for the requests and the process to end. Returns when it was sent."""
    sent = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a request did not end after SIGTERM"
    assert server.process.wait(60) == 0, server.logs()
    return sent


def _answer(request: InFlight) -> dict[str, Any]:
    assert request.response is not None
    assert request.response.status_code == 200, request.body[:500]
    if request.stream:
        payloads = sse_payloads(request.body)
        text = "".join(p["choices"][0]["text"] for p in payloads if p["choices"])
        return {"usage": payloads[-1]["usage"], "text": text,
                "finish_reason": payloads[-2]["choices"][0]["finish_reason"]}  # fmt: skip
    body = httpx.Response(200, content=request.body).json()
    return {"usage": body["usage"], "finish_reason": body["choices"][0]["finish_reason"]}


def test_requests_in_flight_finish_within_the_grace_period(launch):
    server = launch("--shutdown-timeout", "120")
    requests, threads = _start_requests(server, LONG)
    sent = _sigterm_and_wait(server, threads)
    for request in requests:
        answer = _answer(request)
        assert answer["usage"]["completion_tokens"] == LONG
        assert answer["finish_reason"] == "length"
    # They were still generating when the signal came: the drain waited for them.
    assert all(request.finished_at > sent for request in requests)
    assert "requests in flight get 120s to finish" in server.logs()


def test_requests_left_after_the_grace_period_end_with_an_error(launch):
    server = launch("--shutdown-timeout", "0")
    requests, threads = _start_requests(server, 2000)
    _sigterm_and_wait(server, threads)
    for request in requests[:2]:
        assert request.response is not None and request.response.status_code == 200
        payloads = sse_payloads(request.body)  # ends in [DONE]
        error = payloads[-1]["error"]
        assert error["code"] == "shutting_down" and "shutting down" in error["message"]
        assert any(p.get("choices") for p in payloads[:-1])  # tokens came before it
    plain = requests[2]
    assert plain.response is not None
    response = httpx.Response(plain.response.status_code, content=plain.body,
                              headers=plain.response.headers)  # fmt: skip
    assert_error(response, 503, code="shutting_down", contains="shutting down")
