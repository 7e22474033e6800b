"""Where the ranks run: the hosts' flags, torchrun's environment, and the rank numbering."""

from __future__ import annotations

from datetime import timedelta

import pytest

from pegainfer.core.args import EngineArgs
from pegainfer.core.distributed.nodes import Nodes, interface_towards
from pegainfer.core.errors import ConfigError


def nodes(env: dict[str, str] | None = None, **args) -> Nodes:
    return Nodes.from_args(EngineArgs(model="m", **args).validate(), env or {})


def test_one_host_by_default():
    assert nodes(tensor_parallel_size=4) == Nodes(4)


def test_several_hosts_from_the_flags():
    found = nodes(tensor_parallel_size=4, nnodes=2, node_rank=1, master_addr="10.0.0.1",
                  master_port=1234, rendezvous_timeout=30)  # fmt: skip
    assert found == Nodes(4, 2, 1, "10.0.0.1", 1234, timedelta(seconds=30), timedelta(seconds=30))
    assert found.per_node == 2 and found.local_ranks == range(2, 4)
    assert [found.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [found.local_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert "node 1 of 2: ranks 2..3 of 4" in found.describe()


def test_the_master_port_defaults_to_torchs():
    found = nodes(data_parallel_size=2, enable_expert_parallel=True, nnodes=2, master_addr="a")
    assert (found.node_rank, found.master_port) == (0, 29500)


TORCHRUN = {"GROUP_WORLD_SIZE": "2", "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "r7",
            "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}  # fmt: skip


def test_torchruns_environment_fills_what_the_flags_leave():
    found = nodes(TORCHRUN, tensor_parallel_size=2)
    assert (found.nnodes, found.node_rank, found.master_addr, found.master_port) == (
        2, 1, "10.0.0.9", 29400)  # fmt: skip
    # Its agent hosts the store, shared by every run and restart: rank 0 is a client.
    assert found.agent_store and found.store_prefix == "pegainfer/r7/2/"
    # Flags win over the environment.
    found = nodes(TORCHRUN, tensor_parallel_size=2, node_rank=0, master_addr="10.0.0.1")
    assert (found.node_rank, found.master_addr) == (0, "10.0.0.1")


def test_torchrun_starting_several_servers_on_a_host_is_refused():
    with pytest.raises(ConfigError, match="--nproc-per-node 1"):
        nodes(TORCHRUN | {"LOCAL_WORLD_SIZE": "8"}, tensor_parallel_size=2)


@pytest.mark.parametrize(("env", "args", "error"), [
    ({}, {"tensor_parallel_size": 2, "nnodes": 2}, "needs --master-addr"),
    ({}, {"tensor_parallel_size": 2, "master_port": 5}, "--master-port only apply with --nnodes"),
    ({}, {"node_rank": 0, "master_addr": "a"}, "--node-rank, --master-addr only apply"),
    ({}, {"rendezvous_timeout": 5, "peer_timeout": 3},
     "--rendezvous-timeout, --peer-timeout only apply"),
    ({"MASTER_PORT": "x"}, {"tensor_parallel_size": 2, "nnodes": 2, "master_addr": "a"},
     "MASTER_PORT must be an integer"),
    (TORCHRUN | {"GROUP_WORLD_SIZE": "4"}, {"tensor_parallel_size": 2},
     "2 ranks do not split evenly over 4 hosts"),
])  # fmt: skip
def test_bad_hosts_are_refused(env, args, error):
    with pytest.raises(ConfigError, match=error):
        nodes(env, **args)


@pytest.mark.parametrize(("args", "error"), [
    ({"nnodes": 0}, "nnodes must be a positive integer"),
    ({"nnodes": 2, "node_rank": 2, "tensor_parallel_size": 2}, r"node_rank must be in \[0, 2\)"),
    ({"master_port": 70000}, "master_port must be in"),
    ({"rendezvous_timeout": 0}, "rendezvous_timeout must be a positive number"),
    ({"peer_timeout": float("inf")}, "peer_timeout must be a positive number"),
    ({"nnodes": 2, "tensor_parallel_size": 3}, "3 ranks do not split evenly over --nnodes 2"),
])  # fmt: skip
def test_bad_host_flags_are_refused_before_anything_starts(args, error):
    with pytest.raises(ConfigError, match=error):
        EngineArgs(model="m", **args).validate()


def test_the_interface_towards_an_address_is_the_one_holding_the_route():
    assert interface_towards("127.0.0.1", 1) == "lo"
