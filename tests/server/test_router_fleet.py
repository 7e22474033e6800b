"""A fleet behind an existing router (issue 27, item 3): vllm-router from PyPI in front of two
tiny pegainfer servers. Requests that share a long prefix land on the server that cached it
(cache_aware routing, seen in each server's own /metrics), and a server that dies is taken out of
rotation while requests keep succeeding on the other."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import Server, free_port, start_server, stop_server
from tests.server.helpers import metric, metrics, wait_until

ROUTER = shutil.which("vllm-router")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(ROUTER is None, reason="vllm-router (test dependency group) not installed"),
]

# Four prompt families, each a long shared prefix (many full 8-token blocks) and short
# per-request tails; three requests per family.
FAMILIES = [
    f"Family {name}: " + " ".join(f"{name}{i} lorem ipsum dolor sit amet" for i in range(12))
    for name in ("alpha", "bravo", "charlie", "delta")
]
TAILS = (" first question?", " second question?", " third question?")


@dataclass
class Fleet:
    router: str
    servers: list[Server]
    process: subprocess.Popen
    log: Path

    def logs(self) -> str:
        return self.log.read_text()


def served(server: Server) -> float:
    """Requests this server has finished."""
    return metric(metrics(server.url), "vllm:request_success_total", finished_reason="length")


def prefix_hits(server: Server) -> float:
    return metric(metrics(server.url), "vllm:prefix_cache_hits_total")


def healthy_workers(fleet: Fleet) -> int:
    try:
        response = httpx.get(fleet.router + "/readiness", timeout=5)
    except httpx.TransportError:
        return 0
    return response.json().get("healthy_workers", 0) if response.status_code == 200 else 0


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory) -> Iterator[Fleet]:
    """Two servers and the router, shared by this module's tests (the last one kills a server)."""
    tmp_path = tmp_path_factory.mktemp("fleet")
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    args = ("--max-model-len", "512", "--block-size", "8")
    servers = [
        start_server(tiny_model, tmp_path / f"server{i}.log", *args, env=env) for i in (0, 1)
    ]
    port, log = free_port(), tmp_path / "router.log"
    cmd = [
        ROUTER, "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *(s.url for s in servers),
        "--policy", "cache_aware",
        "--prometheus-port", str(free_port()),
        # Probe every second and drop a worker at its first failed probe, so the test sees
        # a dead server leave rotation quickly.
        "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
        "--worker-startup-check-interval", "1",
    ]  # fmt: skip
    with open(log, "w") as handle:
        process = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT)
    fleet = Fleet(f"http://127.0.0.1:{port}", servers, process, log)
    try:
        wait_until(lambda: process.poll() is None and healthy_workers(fleet) == 2, timeout=60,
                   what="the router to see both servers")  # fmt: skip
        yield fleet
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
        for server in servers:
            if server.process.poll() is None:
                stop_server(server)


def complete(fleet: Fleet, prompt: str) -> dict:
    body = {"model": fleet.servers[0].model, "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    response = httpx.post(fleet.router + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, (response.text, fleet.logs())
    return response.json()


def test_shared_prefixes_land_on_one_server(fleet):
    placed: dict[str, set[int]] = {family: set() for family in FAMILIES}
    cached: dict[str, list[int]] = {family: [] for family in FAMILIES}
    for tail in TAILS:
        for family in FAMILIES:
            before = [served(s) for s in fleet.servers]
            hits_before = [prefix_hits(s) for s in fleet.servers]
            usage = complete(fleet, family + tail)["usage"]
            # Requests go one at a time: the server whose count moved served this one.
            after = wait_until(
                lambda before=before: (
                    now if sum(now := [served(s) for s in fleet.servers]) > sum(before) else None
                ),
                what="the request to be counted",
            )
            (index,) = [i for i in range(2) if after[i] > before[i]]
            placed[family].add(index)
            cached[family].append(usage["prompt_tokens_details"]["cached_tokens"])
            hits = wait_until(
                lambda i=index, c=cached[family][-1], h=hits_before: (
                    prefix_hits(fleet.servers[i]) - h[i] >= c
                ),
                what="the server's prefix-cache hits to count the request",
            )
            assert hits
    for family in FAMILIES:
        assert len(placed[family]) == 1, f"{family[:14]}... went to servers {placed[family]}"
        first, *later = cached[family]
        # Only the first request of a family computes its prefix; the others find it cached.
        assert first == 0
        assert all(c >= 8 * 8 for c in later), cached[family]


def test_a_dead_server_leaves_rotation(fleet):  # last: it leaves the fleet one server short
    # The server that took the first family's request (and cached its prefix) dies.
    before = [served(s) for s in fleet.servers]
    complete(fleet, FAMILIES[0] + TAILS[0])
    after = wait_until(
        lambda: now if sum(now := [served(s) for s in fleet.servers]) > sum(before) else None,
        what="the request to be counted",
    )
    dead, alive = fleet.servers if after[0] > before[0] else fleet.servers[::-1]
    dead.process.kill()
    dead.process.wait(timeout=15)
    before = served(alive)
    # Every request succeeds: the router retries a request the dead server refuses on the
    # live one, then its health checks take the dead one out.
    prompts = [family + tail for family in FAMILIES for tail in TAILS]
    for prompt in prompts:
        assert complete(fleet, prompt)["choices"][0]["finish_reason"] == "length"
    wait_until(lambda: healthy_workers(fleet) == 1, timeout=30, what="the dead server to leave")
    wait_until(lambda: served(alive) - before == len(prompts), what="the survivor's counts")
