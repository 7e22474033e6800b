"""The link between rank 0 and the ranks on other hosts.

A worker on rank 0's host reads rank 0's messages from a pipe and is watched through its
process. A rank on another host cannot be either: it connects to a listener rank 0 opens (its
port published in the rendezvous store), says which rank it is and the model and layout its host
was started with (JSON: nothing is unpickled from a peer that has not been checked), and rank 0
answers with an error if they differ from its own. From then on the connection carries the same
pickled messages a pipe does, and its end is the rank's liveness on both sides: a process that
dies closes its sockets, so rank 0 sees a remote rank's connection turn readable (the rank never
writes after its hello) and the rank sees rank 0's end hang up (POLLRDHUP: readable is taken by
its message loop) and exits, even from inside a collective that will never complete.

A host that vanishes without closing its sockets (power, network) is noticed by TCP keepalive
on the link: after --peer-timeout seconds without an answer the kernel fails the connection,
which both sides see as above, idle or not; data sent and never acknowledged fails it as soon
(TCP_USER_TIMEOUT). A host that answers but hangs (a stuck GPU) is the forward's collectives'
time limit's to notice (PEGAINFER_TP_TIMEOUT_S).

The link, like torch.distributed's store and NCCL, trusts the network between the hosts: run
them on a private network.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import socket
import sys
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from multiprocessing.connection import Client, Connection, Listener

import torch.distributed as dist

from pegainfer.core.distributed.nodes import Nodes, RendezvousError
from pegainfer.core.errors import ConfigError, PegainferError

logger = logging.getLogger(__name__)

_PORT_KEY = "messages-port"
_SEND_BUFFER = 1 << 20  # a large plan is written without waiting for the rank to read it


class RemoteRankError(PegainferError):
    """A rank on another host was refused, went away, or never connected."""


class RemoteRanks:
    """Rank 0's side: accepts the other hosts' ranks (in a thread, while rank 0 loads), checks
    each was started like rank 0 (`terms`), and holds their connections."""

    def __init__(self, nodes: Nodes, store: dist.Store, terms: Mapping[str, object]) -> None:
        self._nodes, self._terms = nodes, dict(terms)
        self._expected = [r for r in range(nodes.world) if nodes.node_of(r) != 0]
        self._listener = Listener(("0.0.0.0", 0), backlog=len(self._expected))
        store.set(_PORT_KEY, str(self._listener.address[1]))
        self._deadline = time.monotonic() + nodes.rendezvous_timeout.total_seconds()
        self._lock = threading.Lock()
        self._connections: dict[int, Connection] = {}
        self._error: str | None = None
        self._open = True
        self._accepting = threading.Thread(target=self._accept, daemon=True,
                                           name="pegainfer-remote-accept")  # fmt: skip
        self._accepting.start()

    def connected(self) -> bool:
        """Whether every remote rank has connected and been accepted; raise `RemoteRankError`
        if one was refused or hung up, or if --rendezvous-timeout passed with some missing."""
        with self._lock:
            if self._error is not None:
                raise RemoteRankError(self._error)
            for rank, connection in self._connections.items():
                if connection.poll():  # it never writes after its hello: this is its end
                    raise RemoteRankError(
                        f"parallel rank {rank} (node {self._nodes.node_of(rank)}) exited before "
                        "joining; that host's output says why"
                    )
            missing = [r for r in self._expected if r not in self._connections]
        if not missing:
            return True
        if time.monotonic() > self._deadline:
            nodes = sorted({self._nodes.node_of(r) for r in missing})
            raise RendezvousError(
                f"the ranks of node(s) {nodes} did not connect within --rendezvous-timeout "
                f"{self._nodes.rendezvous_timeout.total_seconds():g} s: start pegainfer-server "
                f"there with the same flags, --node-rank and --master-addr "
                f"{self._nodes.master_addr}"
            )
        return False

    def outboxes(self) -> dict[int, Connection]:
        """Each remote rank's connection (once `connected`)."""
        return dict(self._connections)

    def stop_accepting(self) -> None:
        """Close the listener (every rank is in, or the start failed)."""
        self._open = False
        self._listener.close()

    def hang_up(self) -> None:
        """End every remote rank's connection, from any thread (each rank then exits): the
        handles stay open, so a write racing with this fails with an OSError."""
        self.stop_accepting()
        with self._lock:
            for connection in self._connections.values():
                with contextlib.suppress(OSError):  # the rank has hung up already
                    _socket_of(connection).shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Hang up on every remote rank and release the connections."""
        self.hang_up()
        with self._lock:
            for connection in self._connections.values():
                connection.close()
            self._connections.clear()

    def _accept(self) -> None:
        while self._open:
            try:
                connection = self._listener.accept()
            except OSError:  # closed by `close`
                return
            try:
                self._greet(connection)
            except (OSError, EOFError, ValueError) as exc:
                logger.warning("a connection to rank 0's listener was not a rank: %s", exc)
                connection.close()

    def _greet(self, connection: Connection) -> None:
        """Read a rank's hello; accept it or answer why not (and fail the start)."""
        _tune(connection, self._nodes.peer_timeout)
        if not connection.poll(self._nodes.rendezvous_timeout.total_seconds()):
            raise ValueError("it sent no hello")
        hello = json.loads(connection.recv_bytes())
        rank, terms = int(hello["rank"]), hello["terms"]
        differ = sorted(k for k in self._terms.keys() | terms.keys()
                        if self._terms.get(k) != terms.get(k))  # fmt: skip
        with self._lock:
            if rank not in self._expected:
                error = f"rank {rank} is not a rank of another host ({self._nodes.describe()})"
            elif rank in self._connections:
                error = (f"rank {rank} connected twice: were two hosts started with --node-rank "
                         f"{self._nodes.node_of(rank)}?")  # fmt: skip
            elif differ:
                error = (f"node {self._nodes.node_of(rank)} was started unlike node 0: "
                         + "; ".join(f"{k}: {terms.get(k)!r} there, {self._terms.get(k)!r} on "
                                     "node 0" for k in differ))  # fmt: skip
            else:
                error = None
                self._connections[rank] = connection
            if error is not None and self._error is None:
                self._error = error
        connection.send_bytes(json.dumps({"error": error}).encode())
        if error is not None:
            logger.error("%s", error)
            connection.close()


def connect_to_rank_0(
    nodes: Nodes, store: dist.Store, rank: int, terms: Mapping[str, object]
) -> tuple[Connection, threading.Event]:
    """A remote rank's connection to rank 0, once rank 0 has accepted it, and the event to set
    once rank 0 has asked it to stop. From now on the process exits as soon as rank 0 hangs up
    (code 0 if it had been asked to stop, 1 otherwise)."""
    port = int(store.get(_PORT_KEY))
    try:
        connection = Client((nodes.master_addr, port))
    except OSError as exc:
        raise RemoteRankError(
            f"rank {rank} could not connect to rank 0 at {nodes.master_addr}:{port}: {exc}"
        ) from exc
    _tune(connection, nodes.peer_timeout)
    connection.send_bytes(json.dumps({"rank": rank, "terms": dict(terms)}).encode())
    answer = json.loads(connection.recv_bytes())
    if answer["error"] is not None:
        raise ConfigError(f"rank 0 refused rank {rank}: {answer['error']}")
    stopped = threading.Event()
    threading.Thread(target=_exit_when_rank_0_hangs_up, args=(connection, stopped),
                     daemon=True, name="pegainfer-rank0-link").start()  # fmt: skip
    return connection, stopped


def _exit_when_rank_0_hangs_up(connection: Connection, stopped: threading.Event) -> None:
    poller = select.poll()
    poller.register(connection.fileno(), select.POLLRDHUP)
    while not poller.poll():
        pass
    if not stopped.is_set():
        print(
            "parallel rank: rank 0 hung up (its host stopped or failed)",
            file=sys.stderr,
            flush=True,
        )
    os._exit(0 if stopped.is_set() else 1)


def _tune(connection: Connection, peer_timeout: timedelta) -> None:
    """No Nagle (a message's header and body go in two writes: the second would wait for the
    first's ACK), a send buffer that holds a large plan, and keepalive probes that fail the
    connection once the peer has not answered for `peer_timeout` (a third of it idle, then
    four probes over the rest)."""
    seconds = peer_timeout.total_seconds()
    sock = _socket_of(connection)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, round(seconds / 3)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, round(seconds / 6)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 4)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, round(seconds * 1000)))
    finally:
        sock.close()


def _socket_of(connection: Connection) -> socket.socket:
    """A socket object on a duplicate of `connection`'s descriptor (options and shutdown act
    on the connection; closing it leaves the connection's own descriptor open)."""
    return socket.socket(fileno=os.dup(connection.fileno()))
