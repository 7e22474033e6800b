"""A fleet behind an existing router (issue 27, items 3 and 4): vllm-router from PyPI in front of
two tiny pegainfer servers that publish KV events.

- cache_aware (the router's default): requests that share a long prefix land on the server the
  router sent the first one to, and find it cached there (each server's own /metrics);
- kv_aware: the router discovers each server's event stream (/kv_event_sources) and routes a
  prompt to the server whose cache holds its prefix, even one warmed behind its back;
- a server that dies is taken out of rotation by the router's health checks, and requests keep
  succeeding on the other."""

from __future__ import annotations

import contextlib
import json
import os
import re
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
        """The router's log without its terminal colours (which split `key=value` fields)."""
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text())


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
def servers(tiny_model, tmp_path_factory) -> Iterator[list[Server]]:
    """Two servers publishing KV events, shared by this module's tests (the last one kills
    one of them)."""
    tmp_path = tmp_path_factory.mktemp("fleet")
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    started = []
    try:
        for i in (0, 1):
            events = {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": f"tcp://*:{free_port()}"}  # fmt: skip
            args = ("--max-model-len", "512", "--block-size", "8",
                    "--kv-events-config", json.dumps(events))  # fmt: skip
            started.append(start_server(tiny_model, tmp_path / f"server{i}.log", *args, env=env))
        yield started
    finally:
        for server in started:
            if server.process.poll() is None:
                stop_server(server)


@contextlib.contextmanager
def router(servers: list[Server], log: Path, *policy: str) -> Iterator[Fleet]:
    """vllm-router in front of `servers` with the given policy arguments, once it sees both."""
    port = free_port()
    cmd = [
        ROUTER, "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *(s.url for s in servers), *policy,
        "--prometheus-port", str(free_port()), "--log-level", "debug",
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


@pytest.fixture(scope="module")
def fleet(servers, tmp_path_factory) -> Iterator[Fleet]:
    """The servers behind vllm-router's cache_aware policy (its default)."""
    log = tmp_path_factory.mktemp("router") / "cache_aware.log"
    with router(servers, log, "--policy", "cache_aware") as running:
        yield running


@pytest.fixture(scope="module")
def kv_fleet(servers, tmp_path_factory) -> Iterator[Fleet]:
    """The servers behind vllm-router's kv_aware policy, which finds their event streams by
    itself (/kv_event_sources, /get_server_info): no per-worker flags."""
    log = tmp_path_factory.mktemp("router") / "kv_aware.log"
    with router(servers, log, "--policy", "kv_aware") as running:
        wait_until(lambda: running.logs().count("spawned subscriber") == 2,
                   what="the router to subscribe to both servers' KV events")  # fmt: skip
        yield running


def complete(fleet: Fleet, prompt: str) -> dict:
    body = {"model": fleet.servers[0].model, "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    response = httpx.post(fleet.router + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, (response.text, fleet.logs())
    return response.json()


def route(fleet: Fleet, prompt: str) -> tuple[int, int]:
    """Send `prompt` through the router; return the server that served it (requests go one at a
    time: the one whose count moved) and the prompt tokens it found cached."""
    before = [served(s) for s in fleet.servers]
    usage = complete(fleet, prompt)["usage"]
    after = wait_until(
        lambda: now if sum(now := [served(s) for s in fleet.servers]) > sum(before) else None,
        what="the request to be counted",
    )
    (index,) = [i for i in range(len(before)) if after[i] > before[i]]
    return index, usage["prompt_tokens_details"]["cached_tokens"]


def test_servers_report_their_event_streams(servers):
    """/kv_event_sources: each server's one publisher, keyed by rank, as vLLM reports it."""
    endpoints = set()
    for server in servers:
        (source,) = httpx.get(server.url + "/kv_event_sources", timeout=30).json().values()
        assert source["endpoint"].startswith("tcp://*:")
        assert (source["topic"], source["encoding"], source["replay_endpoint"]) == (
            "",
            "msgpack",
            None,
        )
        endpoints.add(source["endpoint"])
    assert len(endpoints) == 2


def test_shared_prefixes_land_on_one_server(fleet):
    placed: dict[str, set[int]] = {family: set() for family in FAMILIES}
    cached: dict[str, list[int]] = {family: [] for family in FAMILIES}
    for tail in TAILS:
        for family in FAMILIES:
            hits_before = [prefix_hits(s) for s in fleet.servers]
            index, tokens = route(fleet, family + tail)
            placed[family].add(index)
            cached[family].append(tokens)
            # The server's own prefix-cache counter saw the hit the response reports.
            wait_until(
                lambda i=index, c=tokens, h=hits_before: prefix_hits(fleet.servers[i]) - h[i] >= c,
                what="the server's prefix-cache hits to count the request",
            )
    for family in FAMILIES:
        assert len(placed[family]) == 1, f"{family[:14]}... went to servers {placed[family]}"
        first, *later = cached[family]
        # Only the first request of a family computes its prefix; the others find it cached.
        assert first == 0
        assert all(c >= 8 * 8 for c in later), cached[family]


def test_kv_aware_routes_to_the_server_holding_the_prefix(kv_fleet):
    """Each server is warmed directly, not through the router, with a prefix of its own; the
    router then sends each prefix's requests to the server its KV events say holds it."""
    warm = {
        index: f"Family {name}: " + " ".join(f"{name}{i} consectetur adipiscing" for i in range(16))
        for index, name in enumerate(("echo", "golf"))
    }
    for index, prefix in warm.items():
        server = kv_fleet.servers[index]
        body = {"model": server.model, "prompt": prefix, "max_tokens": 1}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        # The router has applied the server's stored blocks once its subscriber logs them.
        wait_until(
            lambda url=server.url: (
                f"kv_index live sequence advanced source={url}" in kv_fleet.logs()
            ),
            what="the router to receive the warm-up's KV events",
        )
    for tail in TAILS:
        for index, prefix in warm.items():
            served_by, cached = route(kv_fleet, prefix + tail)
            assert served_by == index, (prefix[:12], tail)
            assert cached >= 8 * 8


def test_a_dead_server_leaves_rotation(fleet):  # last: it leaves the fleet one server short
    # The server that takes the first family's request (and has its prefix cached) dies.
    index, _ = route(fleet, FAMILIES[0] + TAILS[0])
    dead, alive = fleet.servers[index], fleet.servers[1 - index]
    dead.process.kill()
    dead.process.wait(timeout=15)
    # The router's health checks (every second here) take it out of rotation. Until then a
    # request routed to it fails: vllm-router 0.1.17 answers a refused connection with a 500
    # rather than retrying another worker.
    wait_until(lambda: healthy_workers(fleet) == 1, timeout=30, what="the dead server to leave")
    before = served(alive)
    # Then every request succeeds on the survivor, the dead server's families included.
    prompts = [family + tail for family in FAMILIES for tail in TAILS]
    for prompt in prompts:
        assert complete(fleet, prompt)["choices"][0]["finish_reason"] == "length"
    wait_until(lambda: served(alive) - before == len(prompts), what="the survivor's counts")
