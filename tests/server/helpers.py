"""Small helpers the server tests share: tokenizing, metrics snapshots, SSE parsing, errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import Server

T = TypeVar("T")

# A prompt the tiny checkpoint continues with visible text under greedy decoding; 7 tokens, so
# it never fills a block of 8 and so is never served from the prefix cache.
PROMPT = "The quick brown fox"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "hi"},
]


def tokenize(server: Server, headers: dict[str, str] | None = None, **body: Any) -> list[int]:
    """The server's own token ids for a prompt (`prompt=`) or a conversation (`messages=`)."""
    response = httpx.post(server.url + "/tokenize", json=body, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    payload = response.json()
    assert payload["count"] == len(payload["tokens"])
    return payload["tokens"]


Snapshot = dict[tuple[str, frozenset[tuple[str, str]]], float]


def metrics(url: str) -> Snapshot:
    """Every sample of /metrics, keyed by (sample name, labels other than model_name)."""
    response = httpx.get(url + "/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: Snapshot = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = frozenset((k, v) for k, v in sample.labels.items() if k != "model_name")
            samples[(sample.name, labels)] = sample.value
    return samples


def metric(snapshot: Snapshot, name: str, **labels: str) -> float:
    """One sample's value; a labelled counter not created yet reads 0."""
    return snapshot.get((name, frozenset(labels.items())), 0.0)


def wait_until(check: Callable[[], T], timeout: float = 15.0, what: str = "condition") -> T:
    """Poll `check` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def sse_payloads(raw: bytes) -> list[dict[str, Any]]:
    """Check SSE framing strictly and return the JSON payloads, in order.

    Every event must be exactly `data: {json}\\n\\n` and the stream must end with exactly one
    `data: [DONE]\\n\\n`.
    """
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    assert raw.count(b"data: [DONE]") == 1
    events = raw[: -len(b"data: [DONE]\n\n")].split(b"\n\n")
    assert events[-1] == b"", "the last event before [DONE] must end with a blank line"
    payloads = []
    for event in events[:-1]:
        assert event.startswith(b"data: {"), event
        assert b"\n" not in event, f"an event spans several lines: {event!r}"
        payloads.append(json.loads(event[len(b"data: ") :]))
    return payloads


def assert_error(
    response: httpx.Response,
    status: int,
    *,
    param: str | None = None,
    code: str | None = None,
    error_type: str | None = None,
    contains: str | None = None,
) -> dict[str, Any]:
    """`response` is an OpenAI error: the status, and `{"error": {message, type, param, code}}`."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    if error_type is not None:
        assert error["type"] == error_type, error
    if contains is not None:
        assert contains.lower() in error["message"].lower(), error
    return error


def assert_serving(url: str, model: str | None = None, headers: dict[str, str] | None = None):
    """A good request still gets a complete answer."""
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}
    if model is not None:
        body["model"] = model
    response = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def listen_backlog(url: str) -> int:
    """The accept queue's length of the socket listening at `url` (`ss` shows it as Send-Q)."""
    if shutil.which("ss") is None:
        pytest.skip("needs ss (iproute2) to read a listening socket's backlog")
    port = url.rsplit(":", 1)[1]
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True)
    fields = out.stdout.split()
    assert fields and fields[0] == "LISTEN", out.stdout
    return int(fields[2])


def install_scripted_line(plugin_dir: Path) -> dict[str, str]:
    """Install the test-only scripted line (`scripted_line.py`) in `plugin_dir` as a third party
    would, a module and an entry point; returns the environment a server finds it in."""
    plugin_dir.mkdir(parents=True)
    shutil.copy(Path(__file__).parent / "scripted_line.py", plugin_dir / "scripted_line.py")
    dist_info = plugin_dir / "pegainfer_scripted-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: pegainfer-scripted\n"
                                        "Version: 0.1\n")  # fmt: skip
    (dist_info / "entry_points.txt").write_text("[pegainfer]\nscripted = scripted_line\n")
    return os.environ | {"PYTHONPATH": os.pathsep.join([str(plugin_dir), os.getcwd()])}
