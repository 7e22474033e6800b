"""The README's quickstart runs as written (paths and port swapped), so it cannot go stale."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import free_port, start_server, stop_server

README = Path(__file__).parents[2] / "README.md"
BIN = Path(sys.executable).parent


def block(marker: str) -> str:
    """The fenced code block right after `<!-- quickstart:MARKER -->`."""
    match = re.search(rf"<!-- quickstart:{marker} -->\s*```\w+\n(.*?)```", README.read_text(), re.S)
    assert match, f"README lost its quickstart:{marker} block"
    return match.group(1)


def commands(text: str) -> list[list[str]]:
    """Shell lines of a block, comments stripped and continuation lines joined."""
    joined = text.replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """Run the server block: `uv sync` is the environment this test already runs in."""
    tmp = tmp_path_factory.mktemp("quickstart")
    model = tmp / "tiny-qwen3"
    port = free_port()
    server_args = None
    for argv in commands(block("server").replace("/tmp/tiny-qwen3", str(model))):
        if argv[:2] == ["uv", "run"]:
            argv = argv[2:]
        if argv[:2] == ["uv", "sync"]:
            continue
        if argv[0] == "pegainfer-server":
            server_args = argv[1:]
            continue
        subprocess.run([str(BIN / argv[0]), *argv[1:]], check=True, capture_output=True)
    assert server_args is not None, "the server block no longer starts pegainfer-server"
    assert server_args[:2] == ["--model-path", str(model)]
    rest = server_args[2:]
    rest[rest.index("--port") + 1] = str(port)
    server = start_server(model, tmp / "server.log", *rest, port=port)
    yield server, model, port
    stop_server(server)


def substitute(text: str, model: Path, port: int) -> str:
    return text.replace("/tmp/tiny-qwen3", str(model)).replace(
        "localhost:8000", f"127.0.0.1:{port}"
    )


def test_curl_call(quickstart):
    _, model, port = quickstart
    (argv,) = commands(substitute(block("curl"), model, port))
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    body = json.loads(out)
    assert body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    assert 1 <= body["usage"]["completion_tokens"] <= 16


def test_openai_sdk_call(quickstart):
    _, model, port = quickstart
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(substitute(block("openai"), model, port), {})
    match = re.search(r"\[(\d+) tokens\]\s*$", printed.getvalue())
    assert match, printed.getvalue()
    assert 1 <= int(match.group(1)) <= 16
