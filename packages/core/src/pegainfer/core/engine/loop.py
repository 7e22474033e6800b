"""The GPU-owning loop: steps the engine and talks to the frontend only through messages.

Inbound messages (`messages.Inbound`) and outbound `EngineOutputs` cross as msgpack bytes, so
this thread-based loop and a process-based one are interchangeable for the frontend. The loop
blocks when it has nothing to do; aborts and new requests take effect at the next step.
A failure inside a step ends every request with an error instead of hanging its client.
The loop owns the engine: when it ends, it shuts the engine down from the thread that ran its
steps (under tensor parallelism the CUDA graphs go before the NCCL communicator, then the
workers stop; left to exit time, NCCL's teardown waits on graphs still alive).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import msgspec

from pegainfer.core.engine.core import EngineCore
from pegainfer.core.engine.messages import (
    AbortRequest,
    EngineOutputs,
    EngineRequest,
    Inbound,
    RequestOutput,
    Shutdown,
)
from pegainfer.core.errors import InvalidRequestError

logger = logging.getLogger(__name__)

OutputSink = Callable[[bytes], None]

_encoder = msgspec.msgpack.Encoder()
_inbound_decoder = msgspec.msgpack.Decoder(Inbound)
_outputs_decoder = msgspec.msgpack.Decoder(EngineOutputs)


def decode_outputs(data: bytes) -> EngineOutputs:
    return _outputs_decoder.decode(data)


class EngineLoop:
    """Runs `engine` in a dedicated thread; `sink` receives encoded `EngineOutputs`.

    `sink` is called from the loop's thread and must not block (hand the bytes to another
    thread or event loop).
    """

    def __init__(self, engine: EngineCore, sink: OutputSink) -> None:
        self.engine = engine
        self._sink = sink
        self._inbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pegainfer-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        # A failed loop is dead from the moment it fails, before its thread has ended: the
        # failure it hands the sink must not race with this flag.
        return self._thread.is_alive() and self.error is None

    def send(self, message: Inbound) -> None:
        self._inbox.put(_encoder.encode(message))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop and wait for the engine's own shutdown (a failed loop is still
        shutting its engine down when it reports the failure)."""
        if self.alive:
            self.send(Shutdown())
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        outputs: list[RequestOutput] = []
        try:
            while True:
                for message in self._receive(block=not self.engine.has_unfinished_requests):
                    if isinstance(message, Shutdown):
                        return
                    outputs.extend(self._handle(message))
                outputs.extend(self.engine.step())
                if outputs:
                    self._sink(_encoder.encode(EngineOutputs(outputs, self.engine.stats())))
                    outputs = []
        except Exception as exc:
            logger.exception("engine loop failed; failing every request in flight")
            self.error = exc
            # The frontend fails every request it is waiting on, sent or still in the inbox.
            failure = EngineOutputs(outputs, engine_failed=f"engine failure: {exc}")
            self._sink(_encoder.encode(failure))
        finally:
            self.engine.shutdown()

    def _receive(self, block: bool) -> list[Inbound]:
        """Everything waiting in the inbox; waits for the first message when `block`."""
        messages = []
        try:
            if block:
                messages.append(_inbound_decoder.decode(self._inbox.get()))
            while True:
                messages.append(_inbound_decoder.decode(self._inbox.get_nowait()))
        except queue.Empty:
            return messages

    def _handle(self, message: EngineRequest | AbortRequest) -> list[RequestOutput]:
        if isinstance(message, AbortRequest):
            return self.engine.abort(message.request_ids)
        try:
            self.engine.add_request(message)
        except InvalidRequestError as exc:
            return [RequestOutput.failure(message.request_id, str(exc))]
        return []
