"""Where the parallel ranks run: one host, or `nnodes` hosts with an equal share each.

Every host runs `pegainfer-server` with the same flags and its own `--node-rank` (SGLang's and
vLLM's multi-node model; or torchrun with one process per host, whose environment supplies the
same values). Ranks are numbered host by host: node k holds ranks [k * L, (k + 1) * L), L = world
/ nnodes, and on CUDA rank r drives the host's GPU r mod L. Rank 0 (node 0's engine) hosts the
rendezvous store at --master-addr:--master-port, where the ranks check in and find rank 0's
message listener; under torchrun its agent hosts the store and every rank is its client.

The forward's collectives must leave each host by the interface that reaches the others: gloo
would otherwise bind the address the host name resolves to (often loopback), so each host sets
GLOO_SOCKET_IFNAME to the interface routing to --master-addr, unless the user chose one (NCCL
picks a non-loopback interface itself; NCCL_SOCKET_IFNAME still overrides it).
"""

from __future__ import annotations

import array
import dataclasses
import fcntl
import logging
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from pegainfer.core.args import EngineArgs
from pegainfer.core.errors import ConfigError, PegainferError

if TYPE_CHECKING:
    import torch.distributed as dist

logger = logging.getLogger(__name__)

#: torchrun's default port, which vLLM and SGLang use too.
DEFAULT_MASTER_PORT = 29500
_LOOPBACK = "127.0.0.1"
_SIOCGIFADDR = 0x8915


class RendezvousError(PegainferError):
    """The hosts did not all reach the rendezvous in time."""


@dataclass(frozen=True)
class Nodes:
    """The hosts the `world` ranks are spread over, and where they meet."""

    world: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = _LOOPBACK
    #: 0 on one host: the store binds a free port.
    master_port: int = 0
    rendezvous_timeout: timedelta = timedelta(seconds=600)
    #: How long another host may stay silent before it counts as gone (`remote_ranks`).
    peer_timeout: timedelta = timedelta(seconds=30)
    #: torchrun's agent hosts the store; rank 0 is one more client.
    agent_store: bool = False
    #: The store's keys for this run (torchrun's run and restart: its store outlives a run).
    store_prefix: str = "pegainfer/"

    @classmethod
    def from_args(cls, args: EngineArgs, environ: Mapping[str, str] | None = None) -> Nodes:
        """The hosts `args` describe; flags left at their defaults take torchrun's environment
        (`environ`, default os.environ) where it has them."""
        env = os.environ if environ is None else environ
        world = args.tensor_parallel_size * args.data_parallel_size
        explicit = args.explicit_fields()
        torchrun = "GROUP_WORLD_SIZE" in env
        if torchrun and env.get("LOCAL_WORLD_SIZE", "1") != "1":
            raise ConfigError(
                f"torchrun started {env['LOCAL_WORLD_SIZE']} pegainfer-servers on this host: "
                "start one per host (torchrun --nproc-per-node 1); each starts its own ranks"
            )
        nnodes = args.nnodes
        if torchrun and "nnodes" not in explicit:
            nnodes = _int(env, "GROUP_WORLD_SIZE")
        node_rank = args.node_rank
        if node_rank is None:
            node_rank = _int(env, "GROUP_RANK") if torchrun else 0
        if nnodes == 1:
            given = [f"--{name.replace('_', '-')}" for name in
                     ("node_rank", "master_addr", "master_port", "rendezvous_timeout",
                      "peer_timeout")
                     if name in explicit]  # fmt: skip
            if given:
                raise ConfigError(f"{', '.join(given)} only apply with --nnodes > 1")
            return cls(world)
        if world % nnodes:
            raise ConfigError(f"{world} ranks do not split evenly over {nnodes} hosts")
        if not 0 <= node_rank < nnodes:
            raise ConfigError(f"node rank {node_rank} is not in [0, {nnodes})")
        addr = args.master_addr or env.get("MASTER_ADDR")
        if not addr:
            raise ConfigError("--nnodes > 1 needs --master-addr: node 0's address (or MASTER_ADDR)")
        port = args.master_port
        if port is None:
            port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_MASTER_PORT
        agent_store = torchrun and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        prefix = "pegainfer/"
        if torchrun:
            run = env.get("TORCHELASTIC_RUN_ID", "")
            prefix = f"pegainfer/{run}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        return cls(world, nnodes, node_rank, addr, port, timedelta(seconds=args.rendezvous_timeout),
                   timedelta(seconds=args.peer_timeout), agent_store, prefix)  # fmt: skip

    @property
    def per_node(self) -> int:
        """Ranks on each host."""
        return self.world // self.nnodes

    @property
    def local_ranks(self) -> range:
        """This host's ranks."""
        return self.ranks_of(self.node_rank)

    def ranks_of(self, node: int) -> range:
        return range(node * self.per_node, (node + 1) * self.per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def local_rank(self, rank: int) -> int:
        """`rank`'s place on its host (its GPU's index there)."""
        return rank % self.per_node

    def host_store(self, timeout: timedelta) -> tuple[dist.Store, Nodes]:
        """Rank 0's rendezvous store, whose operations wait up to `timeout`, and these hosts
        with the store's actual port (one host: a free one). Under torchrun's agent store,
        rank 0 joins it as a client."""
        import torch.distributed as dist

        if self.agent_store:
            return self.connect_store(timeout), self
        try:  # the store listens on every interface
            store = dist.TCPStore(_LOOPBACK if self.nnodes == 1 else self.master_addr,
                                  self.master_port, self.world, is_master=True, timeout=timeout,
                                  wait_for_workers=False)  # fmt: skip
        except (RuntimeError, OSError) as exc:
            raise ConfigError(
                f"cannot host the rendezvous on --master-port {self.master_port}: {exc}"
            ) from exc
        placed = dataclasses.replace(self, master_port=store.port)
        return dist.PrefixStore(self.store_prefix, store), placed

    def connect_store(self, timeout: timedelta) -> dist.Store:
        """A client of the rendezvous store, trying to reach it for `rendezvous_timeout` (a
        host may start before node 0 listens); its operations then wait up to `timeout`."""
        import torch.distributed as dist

        addr = _LOOPBACK if self.nnodes == 1 else self.master_addr
        try:
            store = dist.TCPStore(addr, self.master_port, self.world, is_master=False,
                                  timeout=self.rendezvous_timeout)  # fmt: skip
        except (RuntimeError, OSError) as exc:  # torch's DistNetworkError is a RuntimeError
            raise RendezvousError(
                f"could not reach the rendezvous at {addr}:{self.master_port} within "
                f"--rendezvous-timeout {self.rendezvous_timeout.total_seconds():g} s: {exc}"
            ) from exc
        store.set_timeout(timeout)
        return dist.PrefixStore(self.store_prefix, store)

    def choose_gloo_interface(self) -> None:
        """On several hosts, send gloo's traffic out of the interface that reaches
        --master-addr (unless GLOO_SOCKET_IFNAME is set already; workers inherit it)."""
        if self.nnodes == 1 or "GLOO_SOCKET_IFNAME" in os.environ:
            return
        name = interface_towards(self.master_addr, self.master_port)
        os.environ["GLOO_SOCKET_IFNAME"] = name
        logger.info("gloo's collectives use interface %s (towards %s)", name, self.master_addr)

    def describe(self) -> str:
        ranks, where = self.local_ranks, f"{self.master_addr}:{self.master_port}"
        return (f"node {self.node_rank} of {self.nnodes}: ranks {ranks.start}..{ranks.stop - 1} "
                f"of {self.world}, rendezvous at {where}")  # fmt: skip


def interface_towards(addr: str, port: int) -> str:
    """The name of the interface whose address this host uses to reach `addr` (an unsent UDP
    "connection" asks the kernel's routing table)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((addr, port))
            local = probe.getsockname()[0]
    except OSError as exc:
        raise ConfigError(f"no route from this host to --master-addr {addr}: {exc}") from exc
    for _, name in socket.if_nameindex():
        if _address_of(name) == local:
            return name
    raise ConfigError(f"no interface holds {local}, this host's address towards {addr}")


def _address_of(name: str) -> str | None:
    """The IPv4 address of interface `name`, or None if it has none."""
    request = array.array("B", struct.pack("256s", name.encode()[:15]))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
        except OSError:
            return None
    return socket.inet_ntoa(request.tobytes()[20:24])


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {env[name]!r}") from None
