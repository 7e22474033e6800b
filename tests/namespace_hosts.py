"""Two "hosts" on one machine: network namespaces joined by a veth pair, each with its own
loopback and address, so processes in one reach the other only through the pair, as two hosts
reach each other through a network (needs root, or CAP_NET_ADMIN, and `ip`)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
_CLONE_NEWNET = 0x40000000
_SUBNET = "10.213.7"


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str
    link: str  # its end of the veth pair

    def popen(self, cmd: list[str], log: Path, env: dict[str, str] | None = None):
        """Start `cmd` in this host's namespace, its output going to `log`, in a process group
        of its own (`end` kills whatever it started)."""
        with open(log, "w") as handle:  # the child keeps its own descriptor
            return subprocess.Popen(["ip", "netns", "exec", self.namespace, *cmd], stdout=handle,
                                    stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)  # fmt: skip

    def call(self, fn: Callable[[], T]) -> T:
        """fn() run from this host's network (a thread of ours that enters the namespace:
        namespaces are per thread)."""
        result: list = []

        def run() -> None:
            libc = ctypes.CDLL(None, use_errno=True)
            with open(f"/run/netns/{self.namespace}") as ns:
                if libc.setns(ns.fileno(), _CLONE_NEWNET) != 0:
                    result.append(OSError(ctypes.get_errno(), "setns"))
                    return
            try:
                result.append((fn(),))
            except BaseException as exc:
                result.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0][0]


def end(process: subprocess.Popen) -> None:
    """Kill the process group `Host.popen` started (the process and what it started)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"pgi-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create network namespaces: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=True)
    return None


@contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Two namespace hosts (10.213.7.1 and .2), removed afterwards with whatever still runs
    in them."""
    names = [f"pgi-{os.getpid()}-{i}" for i in range(2)]
    links = [f"pgv{os.getpid() % 100000}{i}" for i in range(2)]  # at most 15 characters
    hosts = [Host(name, f"{_SUBNET}.{i + 1}", link) for i, (name, link) in
             enumerate(zip(names, links, strict=True))]  # fmt: skip
    try:
        for name in names:
            _ip("netns", "add", name)
        _ip("link", "add", links[0], "netns", names[0], "type", "veth", "peer", "name", links[1],
            "netns", names[1])  # fmt: skip
        for host in hosts:
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.link)
            _ip("-n", host.namespace, "link", "set", host.link, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        yield hosts[0], hosts[1]
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def cut_off(host: Host) -> None:
    """Take `host`'s link down: its peers get no answer from it, nor it from them, and no
    connection is closed (a host losing power or its network)."""
    _ip("-n", host.namespace, "link", "set", host.link, "down")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)
