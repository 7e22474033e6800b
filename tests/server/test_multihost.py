"""Ranks on two hosts: each "host" a network namespace (its own loopback and address, a veth
pair between them), node 0's pegainfer-server serving HTTP with rank 0, node 1's running its
ranks only. They generate what one process does (tensor parallel; data-parallel attention with
the experts divided), and a rank killed on node 1 ends the request in flight with an error,
turns node 0's /health 503 and node 1's process exits."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.engine_harness import generate, greedy, make_engine
from tests.namespace_hosts import Host, cut_off, end, two_hosts, unavailable
from tests.server.conftest import free_port

# Generous bounds for a busy two-core machine: each is a wait for a condition, not a sleep.
_START_S, _EXIT_S = 240.0, 60.0
_PORT, _MASTER_PORT = 8000, 29500  # each namespace has its own ports

SERVED = {
    "tensor": ("qwen3", ["--tensor-parallel-size", "2"]),
    "data": ("deepseek", ["--data-parallel-size", "2", "--enable-expert-parallel"]),
}
LAYOUTS = [pytest.param(name, marks=pytest.mark.line(line)) for name, (line, _) in SERVED.items()]


@pytest.fixture
def hosts():
    if (reason := unavailable()) is not None:
        pytest.skip(f"namespace hosts cannot be made here: {reason}")
    with two_hosts() as pair:
        yield pair


@dataclass
class Cluster:
    node0: subprocess.Popen
    node1: subprocess.Popen
    host: Host
    logs: tuple[Path, Path]
    model: str

    @property
    def url(self) -> str:
        return f"http://{self.host.address}:{_PORT}"

    def output(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text()}" for log in self.logs)

    def get(self, path: str) -> httpx.Response:
        return self.host.call(lambda: httpx.get(self.url + path, timeout=10))

    def complete(self, prompt: list[int], max_tokens: int) -> list[int]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        reply = self.host.call(lambda: httpx.post(self.url + "/v1/completions", json=body,
                                                  timeout=_START_S))  # fmt: skip
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["token_ids"]

    def stop(self) -> None:
        for process in (self.node0, self.node1):
            end(process)


def tiny(tmp_path: Path, layout: str) -> Path:
    from pegainfer.core.plugins import model_lines

    line = SERVED[layout][0]
    path = tmp_path / "tiny"
    next(m for m in model_lines() if m.name == line).write_tiny_checkpoint(path)
    return path


def command(model: Path, layout: str, master: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pegainfer.server.cli", "--model-path", str(model),
            "--device", "cpu", "--nnodes", "2", "--master-addr",
            master, "--master-port", str(_MASTER_PORT), *SERVED[layout][1], *extra]  # fmt: skip


def start(hosts: tuple[Host, Host], tmp_path: Path, model: Path, layout: str,
          node1_flags: tuple[str, ...] = (), max_model_len: int = 256,
          node0_flags: tuple[str, ...] = ()) -> Cluster:  # fmt: skip
    """Node 1 first (it waits for node 0's rendezvous), then node 0."""
    node0, node1 = hosts
    node1_flags = ("--max-model-len", str(max_model_len), *node1_flags)
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    logs = (tmp_path / "node0.log", tmp_path / "node1.log")
    worker = node1.popen(command(model, layout, node0.address, "--node-rank", "1", *node1_flags),
                         logs[1], env)  # fmt: skip
    server = node0.popen(command(model, layout, node0.address, "--max-model-len",
                                 str(max_model_len), "--host", "0.0.0.0", "--port", str(_PORT),
                                 *node0_flags),
                         logs[0], env)  # fmt: skip
    return Cluster(server, worker, node0, logs, str(model))


def wait_ready(cluster: Cluster) -> None:
    deadline = time.monotonic() + _START_S
    while time.monotonic() < deadline:
        for process in (cluster.node0, cluster.node1):
            if process.poll() is not None:
                raise AssertionError(f"a node exited with {process.returncode}:\n"
                                     f"{cluster.output()}")  # fmt: skip
        try:
            if cluster.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"the nodes did not become ready:\n{cluster.output()}")


def wait_exit(process: subprocess.Popen, cluster: Cluster) -> int:
    try:
        return process.wait(_EXIT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"a node did not exit:\n{cluster.output()}") from None


def prompts() -> list[list[int]]:
    return [[(7 * i + 3 * n) % 200 + 1 for i in range(n)] for n in (3, 17, 40, 9)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ranks_on_two_hosts_generate_what_one_process_does(hosts, tmp_path, layout):
    """Concurrent greedy requests (with data-parallel attention: on both ranks, each MoE
    layer's tokens crossing between the hosts) equal one process's tokens. Node 0 stopped
    cleanly stops node 1 (exit 0); for the second layout node 0 is killed instead, and node
    1's ranks, losing rank 0, exit 1."""
    model = tiny(tmp_path, layout)
    expected = generate(make_engine(model, max_model_len=256, block_size=16), prompts(),
                        greedy(12))  # fmt: skip
    cluster = start(hosts, tmp_path, model, layout)
    try:
        wait_ready(cluster)
        with ThreadPoolExecutor(len(expected)) as pool:
            got = list(pool.map(lambda p: cluster.complete(p, 12), prompts()))
        assert got == expected
        if layout == "tensor":
            cluster.node0.send_signal(signal.SIGTERM)
            assert wait_exit(cluster.node0, cluster) == 0
            assert wait_exit(cluster.node1, cluster) == 0, cluster.output()
        else:
            cluster.node0.kill()
            assert wait_exit(cluster.node1, cluster) == 1, cluster.output()
            assert "rank 0 hung up" in cluster.logs[1].read_text()
    finally:
        cluster.stop()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_rank_killed_on_the_other_host_fails_requests_and_health(hosts, tmp_path, layout):
    """The stream in flight ends with an `engine_error` event (it never hangs), node 0's
    /health turns 503 and new requests are refused while it stays up; node 1 exits 1."""
    cluster = start(hosts, tmp_path, tiny(tmp_path, layout), layout, max_model_len=4096)
    try:
        wait_ready(cluster)
        body = {"model": cluster.model, "prompt": "Hello", "max_tokens": 2000, "stream": True,
                "ignore_eos": True, "temperature": 0}  # fmt: skip

        def stream() -> list[dict]:
            events = []
            with httpx.stream("POST", cluster.url + "/v1/completions", json=body,
                              timeout=_START_S) as reply:  # fmt: skip
                assert reply.status_code == 200, reply.read()
                for line in reply.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    events.append(json.loads(line.removeprefix("data: ")))
                    if len(events) == 3:  # mid-request: kill node 1's rank
                        os.kill(_rank_of(cluster.node1.pid), signal.SIGKILL)
            return events

        events = cluster.host.call(stream)
        assert "error" in events[-1], events[-1]
        assert events[-1]["error"]["code"] == "engine_error"
        assert len(events) < 2000
        assert wait_exit(cluster.node1, cluster) == 1
        assert cluster.get("/health").status_code == 503
        again = {"model": cluster.model, "prompt": "Hi", "max_tokens": 2}
        reply = cluster.host.call(lambda: httpx.post(cluster.url + "/v1/completions", json=again,
                                                     timeout=30))  # fmt: skip
        assert reply.status_code >= 500
        assert cluster.node0.poll() is None  # it stays up to say so
        assert "hung up mid-run" in cluster.logs[0].read_text()
    finally:
        cluster.stop()


@pytest.mark.line("qwen3")
def test_a_host_that_stops_answering_is_noticed_after_the_peer_timeout(hosts, tmp_path):
    """Node 1's link goes down while the server idles (no process dies, no connection
    closes): after --peer-timeout node 0's /health turns 503 and node 1 exits 1."""
    cluster = start(hosts, tmp_path, tiny(tmp_path, "tensor"), "tensor", ("--peer-timeout", "3"),
                    node0_flags=("--peer-timeout", "3"))  # fmt: skip
    try:
        wait_ready(cluster)
        assert len(cluster.complete(prompts()[0], 4)) == 4
        cut_off(hosts[1])
        deadline = time.monotonic() + _EXIT_S
        while cluster.get("/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.25)
        assert cluster.get("/health").status_code == 503, cluster.output()
        assert wait_exit(cluster.node1, cluster) == 1
        assert "hung up mid-run" in cluster.logs[0].read_text()
    finally:
        cluster.stop()


@pytest.mark.line("qwen3")
def test_torchrun_starts_one_server_per_host(hosts, tmp_path):
    """torchrun (static rendezvous, one process per host) with no pegainfer host flags: its
    environment names the hosts and its agent's store is the rendezvous."""
    model = tiny(tmp_path, "tensor")
    expected = generate(make_engine(model, max_model_len=256, block_size=16), prompts()[:2],
                        greedy(8))  # fmt: skip
    node0, node1 = hosts
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    logs = (tmp_path / "node0.log", tmp_path / "node1.log")

    def torchrun(node: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr",
                node0.address, "--master-port", "29400", "--no-python", sys.executable, "-m",
                "pegainfer.server.cli", "--model-path", str(model), "--device", "cpu",
                "--max-model-len", "256", "--tensor-parallel-size", "2", "--port",
                str(_PORT)]  # fmt: skip

    worker = node1.popen(torchrun(1), logs[1], env)
    server = node0.popen(torchrun(0), logs[0], env)
    cluster = Cluster(server, worker, node0, logs, str(model))
    try:
        wait_ready(cluster)
        assert [cluster.complete(p, 8) for p in prompts()[:2]] == expected
        assert "rendezvous at 10.213.7.1:29400" in logs[1].read_text()
    finally:  # torchrun runs its workers in sessions of their own: it must stop them itself
        for agent in (server, worker):
            agent.send_signal(signal.SIGTERM)
        for agent in (server, worker):
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(_EXIT_S)
        cluster.stop()


@pytest.mark.line("qwen3")
def test_a_host_started_differently_is_refused_by_name(hosts, tmp_path):
    """Node 1 with another dtype: node 0's start fails naming it, and both exit."""
    cluster = start(hosts, tmp_path, tiny(tmp_path, "tensor"), "tensor", ("--dtype", "bfloat16"))
    try:
        assert wait_exit(cluster.node0, cluster) == 1
        assert wait_exit(cluster.node1, cluster) == 1
        assert "dtype: 'torch.bfloat16' there, 'torch.float32' on node 0" in cluster.output()
    finally:
        cluster.stop()


@pytest.mark.line("qwen3")
@pytest.mark.parametrize("node", [0, 1])
def test_a_host_alone_gives_up_after_the_rendezvous_timeout(tmp_path, node):
    """Node 0 waits --rendezvous-timeout for node 1's ranks to connect, node 1 as long for
    node 0's rendezvous to listen; then each exits with an error naming the flag."""
    model = tiny(tmp_path, "tensor")
    flags = ["--node-rank", str(node), "--rendezvous-timeout", "3", "--master-port",
             str(free_port()), "--port", str(free_port())]  # fmt: skip
    cmd = [sys.executable, "-m", "pegainfer.server.cli", "--model-path", str(model), "--device",
           "cpu", "--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
           "--host", "127.0.0.1", *flags]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=_START_S)
    assert run.returncode == 1, run.stderr
    assert "--rendezvous-timeout 3 s" in run.stderr


def _rank_of(launcher: int) -> int:
    """Node 1's rank process: the launcher's child that multiprocessing spawned (not its
    resource tracker)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if parent == launcher and b"spawn_main" in cmdline:
            return int(stat.parent.name)
    raise AssertionError("node 1 runs no rank")
