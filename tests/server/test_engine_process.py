"""`pegainfer-server` runs its engine in a process of its own: what that process's life means
for the server (liveness, failure, shutdown, start-up errors)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import Server, start_server, stop_server
from tests.server.helpers import PROMPT, wait_until

# Deadlines for processes to react: generous, since CI's two cores are busy.
DEADLINE_S = 60.0


def engine_pid(server: Server) -> int:
    """The engine process: the server's child running `pegainfer.core.engine.spawn`."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if parent == server.process.pid and b"pegainfer.core.engine.spawn" in cmdline:
            return int(stat.parent.name)
    raise AssertionError("the server has no engine process")


def running(pid: int) -> bool:
    """The process exists and has not ended (a zombie waiting to be reaped has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def own_server(tiny_model, tmp_path) -> Iterator[Server]:
    """A server of this test's own, for tests that stop or kill its processes."""
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    server = start_server(tiny_model, tmp_path / "server.log", "--max-model-len", "4096",
                          env=env)  # fmt: skip
    yield server
    if server.process.poll() is None:
        stop_server(server)


def test_the_server_answers_while_its_engine_process_is_stopped(own_server):
    """The step loop is not in the server's process: with the engine process stopped
    (SIGSTOP), HTTP still answers at once, and a completion waits for the engine."""
    engine = engine_pid(own_server)
    assert engine != own_server.process.pid
    body = {"model": own_server.model, "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True}
    os.kill(engine, signal.SIGSTOP)
    try:
        for path in ("/health", "/v1/models", "/metrics"):
            assert httpx.get(own_server.url + path, timeout=DEADLINE_S).status_code == 200
        tokens = httpx.post(own_server.url + "/tokenize", json={"prompt": PROMPT},
                            timeout=DEADLINE_S)  # fmt: skip
        assert tokens.status_code == 200 and tokens.json()["count"] > 0
        replies: list[httpx.Response] = []
        pending = threading.Thread(
            target=lambda: replies.append(
                httpx.post(own_server.url + "/v1/completions", json=body, timeout=DEADLINE_S)
            )
        )
        pending.start()
        pending.join(1.0)  # in the server's process, the step loop would have finished it
        assert not replies, "a completion finished while the engine process was stopped"
    finally:
        os.kill(engine, signal.SIGCONT)
    pending.join(DEADLINE_S)
    assert replies and replies[0].status_code == 200, replies
    assert replies[0].json()["usage"]["completion_tokens"] == 3


def test_killing_the_engine_process_ends_streams_with_an_error_and_health_503(own_server):
    body = {"model": own_server.model, "prompt": "Hello", "max_tokens": 3000, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    engine = engine_pid(own_server)
    events = []
    with httpx.stream("POST", own_server.url + "/v1/completions", json=body,
                      timeout=DEADLINE_S) as reply:  # fmt: skip
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line.removeprefix("data: ")))
            if len(events) == 3:
                os.kill(engine, signal.SIGKILL)
    error = events[-1]["error"]
    assert error["code"] == "engine_error"
    assert "engine process was killed by signal SIGKILL" in error["message"]
    health = httpx.get(own_server.url + "/health", timeout=DEADLINE_S)
    assert health.status_code == 503 and health.text == "engine stopped"
    again = httpx.post(own_server.url + "/v1/completions",
                       json={"prompt": "Hi", "max_tokens": 2}, timeout=DEADLINE_S)  # fmt: skip
    assert again.status_code == 503 and again.json()["error"]["code"] == "engine_dead"
    stop_server(own_server)  # the server still stops cleanly
    assert own_server.process.returncode == 0


def test_the_engine_process_ends_when_the_server_is_killed(own_server):
    engine = engine_pid(own_server)
    own_server.process.kill()
    own_server.process.wait(DEADLINE_S)
    wait_until(lambda: not running(engine), DEADLINE_S, "the engine process to end")


def test_sigterm_stops_the_engine_process_and_the_server(own_server):
    engine = engine_pid(own_server)
    stop_server(own_server)
    assert own_server.process.returncode == 0
    wait_until(lambda: not running(engine), DEADLINE_S, "the engine process to end")


def test_a_startup_error_reaches_the_user(tiny_model, tmp_path):
    """The engine process's load error is the server's message, and the server exits 1."""
    model = tmp_path / "model"
    model.mkdir()
    for item in tiny_model.iterdir():
        (model / item.name).symlink_to(item)
    (model / "config.json").unlink()
    config = json.loads((tiny_model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    cmd = [sys.executable, "-m", "pegainfer.server.cli", "--model-path", str(model),
           "--host", "127.0.0.1", "--port", "0"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=DEADLINE_S * 2)
    assert run.returncode == 1, run.stderr
    assert f"cannot serve {model}: no installed model line supports model_type 'llama'" in (
        run.stderr
    ), run.stderr


def test_a_bad_grammar_is_refused_before_a_stream_starts(server):
    """The frontend checks a grammar as the engine will (a 400, not an error event)."""
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 4, "stream": True,
            "structured_outputs": {"json": {"type": "nonsense"}}}  # fmt: skip
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=DEADLINE_S)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "structured_outputs.json"  # the field sent
