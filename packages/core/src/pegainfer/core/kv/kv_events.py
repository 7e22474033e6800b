"""KV cache events: blocks entering and leaving the prefix cache, for routers that route by it.

The wire format is vLLM's (`vllm/distributed/kv_events.py`, `--kv-events-config`), so consumers
written for vLLM (vllm-router's `kv_aware` policy, llm-d's KV-cache indexer, Dynamo) read a
pegainfer server's stream unchanged:

- a `KVEventBatch` is msgpack `[ts, [event, ...], data_parallel_rank]`; each event is a map of
  its fields whose `type` names it (`BlockStored`, `BlockRemoved`), as vLLM's tagged structs
  encode (and vllm-router's subscriber requires: it refuses positional events);
- each batch goes out on a ZMQ PUB socket as three frames: the topic, an 8-byte big-endian
  sequence number (0, 1, ... per publisher) and the payload;
- with a `replay_endpoint`, a ROUTER socket answers `[b"", start_seq]` from a DEALER with every
  buffered batch from `start_seq` on, each as `[b"", topic, seq, payload]`, then the end marker
  `[b"", b"", -1, b""]`.

vLLM's contract (docs/features/kv_events.md there) pins all of this.

Block hashes are pegainfer's own 16-byte chained digests (`block_manager.hash_block_tokens`),
sent as bytes: consumers treat them as opaque keys and hash the token ids themselves.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import msgspec

from pegainfer.core.errors import ConfigError

if TYPE_CHECKING:
    import zmq

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"


class BlockStored(msgspec.Struct, tag=True, gc=False):
    """Blocks newly cached on the device: a chain, each block's parent the one before it and the
    first one's `parent_block_hash`; `token_ids` holds every block's tokens, in order."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, gc=False):
    """Cached blocks evicted from the device (their space reused)."""

    block_hashes: list[bytes]
    medium: str | None = MEDIUM_GPU


KVEvent = BlockStored | BlockRemoved


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    """The events of one engine step, in the order they happened."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


PUBLISHERS = ("null", "zmq")


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`--kv-events-config`: vLLM's `KVEventsConfig` fields, with its defaults."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """Decode and check the JSON the flag carries; `ConfigError` names what is wrong."""
        try:
            config = msgspec.json.decode(text, type=cls)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ConfigError(f"--kv-events-config: {exc}") from None
        if config.publisher not in PUBLISHERS:
            raise ConfigError(
                f"--kv-events-config: publisher must be one of {', '.join(PUBLISHERS)}, "
                f"got {config.publisher!r}"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(config, name) < 1:
                raise ConfigError(f"--kv-events-config: {name} must be a positive integer")
        return config

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def endpoint_for_rank(endpoint: str, rank: int) -> str:
    """Rank `rank`'s endpoint, as vLLM derives it: a TCP port moves up by the rank, an ipc or
    inproc name gains `_dp<rank>`. Rank 0 (and every engine without data-parallel attention)
    uses the endpoint as given."""
    if rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[-1].isdigit():
        address, port = endpoint.rsplit(":", 1)
        return f"{address}:{int(port) + rank}"
    raise ConfigError(f"--kv-events-config: cannot derive rank {rank}'s endpoint from {endpoint!r}")


_END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STOP = None


class ZmqEventPublisher:
    """Sends batches from a thread of its own, so the step loop never waits on the network.

    `publish` numbers the batch and queues it; when the queue is full the batch is dropped (and
    logged), leaving a gap in the sequence that tells subscribers their view is incomplete,
    rather than stalling a step. The sockets are made here, so a bad or busy endpoint fails the
    engine's start; afterwards only the thread touches them.
    """

    def __init__(self, config: KVEventsConfig, rank: int = 0) -> None:
        try:
            import zmq
        except ImportError:
            raise ConfigError(
                "--kv-events-config with the zmq publisher needs pyzmq: "
                "pip install 'pegainfer-core[kv-events]'"
            ) from None
        self._zmq = zmq
        self._rank = rank
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(
            config.max_queue_size
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._context = zmq.Context.instance()
        endpoint = endpoint_for_rank(config.endpoint, rank)
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        try:
            # vLLM's rule: a wildcard or local address is bound, a remote one connected to.
            if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(endpoint_for_rank(config.replay_endpoint, rank))
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ConfigError(f"--kv-events-config: cannot open {endpoint!r}: {exc}") from None
        self._thread = threading.Thread(target=self._run, name="pegainfer-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events (never blocks)."""
        batch = KVEventBatch(time.time(), events, self._rank)
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            logger.warning("KV events: queue full, batch %d dropped", seq)

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (within `timeout`), then close the sockets."""
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV events: publisher thread still busy after %.1fs", timeout)
            return  # the daemon thread still owns the sockets
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                # What was published before the request came is queued by now: sent first,
                # the replay covers it.
                if not self._send_queued(encoder):
                    return
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if not self._send(item, encoder):
                return

    def _send_queued(self, encoder: msgspec.msgpack.Encoder) -> bool:
        """Send every queued batch; False once the stop sentinel is reached."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return True
            if not self._send(item, encoder):
                return False

    def _send(
        self, item: tuple[int, KVEventBatch] | None, encoder: msgspec.msgpack.Encoder
    ) -> bool:
        """Publish one queued batch and keep it for replay; False for the stop sentinel."""
        if item is _STOP:
            return False
        seq, batch = item
        payload = encoder.encode(batch)
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        return True

    def _serve_replay(self) -> None:
        frames: list[Any] = self._replay.recv_multipart()  # type: ignore[union-attr]
        if len(frames) != 3:
            logger.warning("KV events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                frames = (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                self._replay.send_multipart(frames)  # type: ignore[union-attr]
        self._replay.send_multipart((client, b"", b"", _END_SEQ, b""))  # type: ignore[union-attr]
