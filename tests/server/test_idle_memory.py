"""The tiny model's server at rest, as a user starts it (no sizing flags): under 1 GB resident
over its whole process tree (issue 21: it sat at 2.76 GB behind a 2 GiB CPU KV cache), the
checkpoint no longer mapped once loaded, and the start-up log reporting RSS by phase."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx

from pegainfer.server.bench.process_tree import descendants, rss_bytes
from tests.server.conftest import start_server, stop_server

# The bound for the CPU. Measured here: ~0.38 GB (the engine process ~320 MiB: torch
# ~210 MiB, the KV cache 64 MiB; the HTTP process, which imports no torch, ~50 MiB).
_BOUND = 1_000_000_000


def test_tiny_server_idle_rss_under_1gb(tiny_model, tmp_path):
    server = start_server(tiny_model, tmp_path / "server.log", "--device", "cpu")
    try:
        body = {"model": server.model, "prompt": "Hello there", "max_tokens": 8}
        reply = httpx.post(server.base_url + "/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        time.sleep(0.5)  # the step loop goes idle
        tree = descendants(server.process.pid)
        assert len(tree) >= 2  # the server and its engine process
        resident = rss_bytes(tree)
        assert resident < _BOUND, f"{resident / 2**20:.0f} MiB resident over {len(tree)} processes"
        for pid in tree:
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert str(tiny_model) not in maps, f"process {pid} still maps the checkpoint"
    finally:
        stop_server(server)
    logs = server.logs()
    assert "KV cache: 2048 blocks of 16 tokens (0.06 GiB)" in logs  # 64 MiB: the default floor
    phases = re.findall(r"start-up: (.+) at [\d.]+ s, RSS \d+ MiB \([+-]\d+ MiB\)", logs)
    assert phases[0] == "engine process started" and phases[-1] == "engine ready", phases
    assert "model loaded" in phases, phases
    assert re.search(r"ready: serving .* s after start \(this process: RSS \d+ MiB\)", logs)
