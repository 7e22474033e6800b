"""A real `pegainfer-server` process on a tiny Qwen3 checkpoint, shared by the server tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pegainfer.models.qwen3.line import Qwen3Line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    model: str
    process: subprocess.Popen
    log: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def logs(self) -> str:
        return self.log.read_text()


def start_server(
    model: Path,
    log: Path,
    *args: str,
    env: dict | None = None,
    port: int | None = None,
    command: tuple[str, ...] = (sys.executable, "-m", "pegainfer.server.cli"),
) -> Server:
    """Start the server process; return once /health says 200 (or fail with its log).

    With `port` given, `args` must carry `--port` themselves (as the README's command does).
    `command` runs the CLI (with `args` after it).
    """
    if port is None:
        port = free_port()
        args = ("--port", str(port), *args)
    cmd = [*command, "--model-path", str(model), "--host", "127.0.0.1", *args]
    with open(log, "w") as handle:  # the child keeps its own descriptor
        process = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env)
    server = Server(f"http://127.0.0.1:{port}", str(model), process, log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited with {process.returncode}:\n{server.logs()}")
        try:
            if httpx.get(server.url + "/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    process.kill()
    raise AssertionError(f"server did not become ready:\n{server.logs()}")


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        server.process.kill()
        raise AssertionError(f"server did not stop on SIGTERM:\n{server.logs()}") from None


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("server-tiny-qwen3")
    Qwen3Line().write_tiny_checkpoint(path, seed=5)
    return path


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory) -> Iterator[Server]:
    """The shared server: 64 sequences, small context, prefix caching on."""
    log = tmp_path_factory.mktemp("server-log") / "server.log"
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    running = start_server(
        tiny_model, log, "--max-model-len", "512", "--max-num-seqs", "64", "--block-size", "8",
        env=env,
    )  # fmt: skip
    yield running
    stop_server(running)
