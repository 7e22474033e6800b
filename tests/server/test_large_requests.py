"""One large request does not freeze the server (issue 28, item 18): a prompt that cannot fit
the context is refused before it is tokenized, one that must be tokenized is tokenized off the
event loop while `/health` and other streams keep answering, and the memory it took is given
back."""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import Server, start_server, stop_server
from tests.server.helpers import PROMPT, assert_error, sse_payloads

# Tokenizing this takes seconds on the tiny tokenizer (2.4 M tokens), a stall anyone notices.
HUGE = "hello world " * 200_000


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory) -> Iterator[Server]:
    """A server of its own: its peak memory is this module's."""
    log = tmp_path_factory.mktemp("large-requests") / "server.log"
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    running = start_server(tiny_model, log, "--max-model-len", "512", env=env)
    yield running
    stop_server(running)


def _memory_mb(server: Server, field: str) -> float:
    """VmRSS (resident now) or VmHWM (the peak) of the server's own process, in MB."""
    with open(f"/proc/{server.process.pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/{server.process.pid}/status")


def test_a_prompt_longer_than_the_context_is_refused_before_tokenizing(server: Server):
    """Refused on a lower bound of its tokens ("at least"), known from its length alone."""
    response = httpx.post(server.base_url + "/completions",
                          json={"prompt": HUGE * 4, "max_tokens": 1}, timeout=120)  # fmt: skip
    error = assert_error(response, 400, param="prompt", contains="at least")
    assert "context is 512 tokens" in error["message"]
    # Chat: the bound applies to the rendered conversation.
    messages = [{"role": "user", "content": HUGE * 4}]
    response = httpx.post(server.base_url + "/chat/completions",
                          json={"messages": messages, "max_tokens": 1}, timeout=120)  # fmt: skip
    assert_error(response, 400, param="prompt", contains="at least")


def _latency(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def _health(server: Server) -> None:
    assert httpx.get(server.url + "/health", timeout=120).status_code == 200


def _short_stream(server: Server) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True, "stream": True}
    response = httpx.post(server.base_url + "/completions", json=body, timeout=120)
    assert response.status_code == 200
    assert "".join(p["choices"][0]["text"] for p in sse_payloads(response.content))


def test_a_large_prompt_does_not_stall_health_or_other_streams(server: Server):
    """A prompt tokenized in full (truncate_prompt_tokens keeps its last tokens, so it must
    be) takes seconds; meanwhile `/health` and short streams answer about as fast as they did
    before it, never after a wait as long as its own."""
    baseline = [_latency(lambda: _health(server)) for _ in range(10)]
    baseline += [_latency(lambda: _short_stream(server)) for _ in range(5)]
    rss_before = _memory_mb(server, "VmRSS")

    result: dict[str, object] = {}

    def large() -> None:
        body = {"prompt": HUGE, "max_tokens": 2, "truncate_prompt_tokens": 16}
        started = time.perf_counter()
        result["response"] = httpx.post(server.base_url + "/completions", json=body, timeout=300)
        result["seconds"] = time.perf_counter() - started

    thread = threading.Thread(target=large)
    thread.start()
    during: list[float] = []
    while thread.is_alive():
        during.append(_latency(lambda: _health(server)))
        during.append(_latency(lambda: _short_stream(server)))
    thread.join()

    response = result["response"]
    assert isinstance(response, httpx.Response) and response.status_code == 200, response
    assert response.json()["usage"]["prompt_tokens"] == 16
    took = result["seconds"]
    assert isinstance(took, float)
    # The large request is long beside a normal one (else this test proves nothing) ...
    assert took > 10 * statistics.median(baseline), (took, baseline)
    # ... and nothing waited for it: a stalled event loop makes one call as long as it.
    assert len(during) >= 4, during
    assert max(during) < took / 3, (max(during), took, during)

    # The memory it took (hundreds of MB of encodings) is given back.
    peak = _memory_mb(server, "VmHWM")
    assert peak - rss_before > 100, (peak, rss_before)
    grown = _memory_mb(server, "VmRSS") - rss_before
    assert grown < (peak - rss_before) / 4, (grown, peak, rss_before)
