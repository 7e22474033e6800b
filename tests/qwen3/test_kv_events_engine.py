"""The engine publishes its prefix cache's changes as vLLM's KV events (issue 27, item 4): a ZMQ
subscriber sees each prompt's full blocks stored (hashes, parents, tokens) and evicted blocks
removed, in order, live and through the replay socket."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import msgspec
import pytest

zmq = pytest.importorskip("zmq", reason="pyzmq (pegainfer-core[kv-events]) not installed")

from pegainfer import LLM, SamplingParams  # noqa: E402
from pegainfer.core.kv.block_manager import hash_block_tokens  # noqa: E402
from pegainfer.core.kv.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from pegainfer.models.qwen3.line import Qwen3Line  # noqa: E402

BS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chain(tokens: list[int], parent: bytes | None = None) -> list[bytes]:
    """The hashes of `tokens`' full blocks, chained onto `parent`."""
    hashes = []
    for start in range(0, len(tokens) - BS + 1, BS):
        parent = hash_block_tokens(parent, tokens[start : start + BS])
        hashes.append(parent)
    return hashes


def decode(payload: bytes) -> KVEventBatch:
    return msgspec.msgpack.decode(payload, type=KVEventBatch)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen3-kv-events")
    Qwen3Line().write_tiny_checkpoint(path, seed=2, num_hidden_layers=1)
    return path


def test_subscriber_sees_stored_and_removed_blocks_in_order(tiny):
    port, replay_port = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
        "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay_port}",
    }  # fmt: skip
    # Eight blocks of four tokens: the second prompt must evict the first one's blocks.
    llm = LLM(str(tiny), device="cpu", block_size=BS, num_kv_blocks=8, max_model_len=32,
              kv_events_config=json.dumps(config))  # fmt: skip
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    params = SamplingParams(max_tokens=1, temperature=0)
    try:
        first = list(range(10, 23))  # 13 tokens: three full blocks
        second = list(range(40, 68))  # 28 tokens: seven full blocks
        llm.generate([first], params)
        llm.generate([second], params)

        # Everything so far, from the replay socket (a subscriber that joined late catches up
        # this way): batches numbered from 0, in order, then the end marker.
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed: list[tuple[int, KVEventBatch]] = []
        while True:
            assert dealer.poll(30_000), "the replay socket did not answer"
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert (topic, payload) == (b"", b"")
                break
            assert topic == b"kv"
            replayed.append((int.from_bytes(seq, "big"), decode(payload)))
        assert [seq for seq, _ in replayed] == list(range(len(replayed)))
        assert all(batch.data_parallel_rank == 0 for _, batch in replayed)
        events = [event for _, batch in replayed for event in batch.events]

        a, b = chain(first), chain(second)
        stored_a, removed, stored_b = events
        assert stored_a == BlockStored(a, None, first[:12], BS)
        # The second prompt's blocks came partly from evicting the first's, tail first.
        assert removed == BlockRemoved(a[::-1][: len(removed.block_hashes)])
        assert 1 <= len(removed.block_hashes) <= len(a)
        assert stored_b == BlockStored(b, None, second, BS)

        # Live: a prompt sharing the first prompt's (still cached) first block stores only its
        # new blocks, chained onto that block; its batch continues the sequence.
        assert removed.block_hashes[-1] != a[0]
        third = [*first[:4], *range(80, 88), 1]
        llm.generate([third], params)
        received: list[BlockStored | BlockRemoved] = []
        while not any(isinstance(e, BlockStored) for e in received):
            assert sub.poll(30_000), "no live KV event arrived"
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            if int.from_bytes(seq, "big") < len(replayed):
                continue  # published before this subscription had joined
            received += decode(payload).events
        stored_c = next(e for e in received if isinstance(e, BlockStored))
        assert stored_c == BlockStored(chain(third[4:12], a[0]), a[0], third[4:12], BS)
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        llm.engine.shutdown()
