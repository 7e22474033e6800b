"""KV cache events (issue 27, item 4): `--kv-events-config` parsing, the block manager's event
log, and the wire format vLLM's consumers read."""

from __future__ import annotations

import msgspec
import pytest

from pegainfer.core.args import EngineArgs
from pegainfer.core.errors import ConfigError
from pegainfer.core.kv.block_manager import BlockManager, hash_block_tokens
from pegainfer.core.kv.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    endpoint_for_rank,
)
from tests.core.test_block_manager import hashes_of, run_request


def test_config_takes_vllms_json():
    config = KVEventsConfig.parse(
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:6000", '
        '"topic": "kv", "replay_endpoint": "tcp://*:6001"}'
    )
    assert config.publishes
    assert (config.endpoint, config.topic, config.replay_endpoint) == (
        "tcp://*:6000", "kv", "tcp://*:6001"
    )  # fmt: skip
    assert (config.buffer_steps, config.hwm, config.max_queue_size) == (10_000, 100_000, 100_000)
    # vLLM's defaults: nothing is published unless enabled, and by the zmq publisher.
    assert not KVEventsConfig.parse("{}").publishes
    assert not KVEventsConfig.parse('{"enable_kv_cache_events": true}').publishes


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher must be one of"),
        ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown field"),
        ('{"hwm": 0}', "hwm must be a positive integer"),
        ("{not json", "--kv-events-config"),
    ],
)
def test_config_refusals_name_the_problem(text, message):
    with pytest.raises(ConfigError, match=message):
        KVEventsConfig.parse(text)


def test_engine_args_refuse_events_without_the_prefix_cache():
    events = '{"enable_kv_cache_events": true, "publisher": "zmq"}'
    with pytest.raises(ConfigError, match="needs prefix caching"):
        EngineArgs(model="m", kv_events_config=events, enable_prefix_caching=False).validate()
    EngineArgs(model="m", kv_events_config=events).validate()
    with pytest.raises(ConfigError, match="unknown field"):
        EngineArgs(model="m", kv_events_config='{"topics": "kv"}').validate()


def test_endpoints_per_rank_follow_vllm():
    assert endpoint_for_rank("tcp://*:5557", 0) == "tcp://*:5557"
    assert endpoint_for_rank("tcp://*:5557", 3) == "tcp://*:5560"
    assert endpoint_for_rank("ipc:///tmp/kv", 2) == "ipc:///tmp/kv_dp2"
    with pytest.raises(ConfigError):
        endpoint_for_rank("tcp://host", 1)


def test_a_prompts_full_blocks_are_one_stored_chain():
    bm = BlockManager(num_blocks=8, block_size=4, record_events=True)
    tokens = list(range(100, 114))  # three full blocks and two tokens
    hashes = hashes_of(bm, tokens)
    bm.release(run_request(bm, tokens))
    (stored,) = bm.take_events()
    assert stored == BlockStored(hashes, None, tokens[:12], 4)
    assert bm.take_events() == []
    # A second prompt sharing two blocks stores only its new block, chained on the second.
    other = [*tokens[:8], 7, 7, 7, 7, 7]
    bm.release(run_request(bm, other))
    (stored,) = bm.take_events()
    new_hash = hash_block_tokens(hashes[1], other[8:12])
    assert stored == BlockStored([new_hash], hashes[1], other[8:12], 4)


def test_evictions_are_removed_tail_first_after_what_they_made_room_for():
    bm = BlockManager(num_blocks=4, block_size=2, record_events=True)
    first = [1, 2, 3, 4, 5, 6, 7, 8]
    first_hashes = hashes_of(bm, first)
    bm.release(run_request(bm, first))
    bm.take_events()
    second = [9, 9, 8, 8, 7, 7]
    bm.release(run_request(bm, second))
    removed, stored = bm.take_events()
    # Allocating the second prompt's three blocks evicted three of the first's, tail first
    # (a released sequence's tail enters the LRU before its head); then they were sealed.
    assert removed == BlockRemoved(first_hashes[:0:-1])
    assert stored == BlockStored(hashes_of(bm, second), None, second, 2)


def test_recording_needs_the_prefix_cache():
    with pytest.raises(ValueError, match="needs it on"):
        BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False, record_events=True)


def test_wire_format_is_what_vllm_router_reads():
    """A batch is positional, [ts, events, rank]; an event is a map tagged with its type (the
    shape vllm-router 0.1.17's subscriber decodes; it refuses positional events)."""
    batch = KVEventBatch(
        1.5,
        [BlockStored([b"h1", b"h2"], None, [1, 2, 3, 4], 2), BlockRemoved([b"h0"])],
        0,
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert decoded == [
        1.5,
        [
            {
                "type": "BlockStored", "block_hashes": [b"h1", b"h2"], "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU",
                "lora_name": None,
            },
            {"type": "BlockRemoved", "block_hashes": [b"h0"], "medium": "GPU"},
        ],
        0,
    ]  # fmt: skip
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=KVEventBatch) == batch
