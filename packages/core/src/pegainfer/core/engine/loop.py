"""The GPU-owning loop: steps the engine and talks to the frontend only through messages.

Inbound messages (`messages.Inbound`) and outbound `EngineOutputs` cross as msgpack bytes, so
the frontend drives this loop in a thread of its own process (`EngineLoop.start`: the offline
API's tests, the engine tests) or in a process of its own (`process.EngineProcess`,
which runs `EngineLoop.run` in the engine process's main thread) through one interface,
`EngineConnection`. The loop blocks when it has nothing to do; aborts and new requests take
effect at the next step. A request with a grammar is compiled against the tokenizer on a
thread of the loop's pool first and scheduled once its grammar is ready, so a large schema
never holds up the running requests' steps; so does the server's `CheckGrammar` (its answer
goes out with the next outputs, and the grammar stays compiled for the request that follows).
Once the loop has idled `SETTLE_S` seconds after
work, the heap its steps freed goes back to the system (at rest the process is as small as
it can be; a busy loop keeps its freed memory for reuse).
A failure inside a step ends every request in flight with an error instead of hanging its
client. The loop owns the engine: when it ends, it shuts the engine down from the thread that
ran its steps (under tensor parallelism the CUDA graphs go before the NCCL communicator, then
the workers stop; left to exit time, NCCL's teardown waits on graphs still alive).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import msgspec

from pegainfer.core.engine.messages import (
    AbortRequest,
    CheckGrammar,
    EngineOutputs,
    EngineRequest,
    GrammarChecked,
    Inbound,
    RequestOutput,
    Shutdown,
)
from pegainfer.core.errors import InvalidRequestError
from pegainfer.core.process_info import release_freed_memory

if TYPE_CHECKING:
    from pegainfer.core.engine.core import EngineCore
    from pegainfer.core.engine.engine_config import EngineConfig

logger = logging.getLogger(__name__)

OutputSink = Callable[[bytes], None]

_encoder = msgspec.msgpack.Encoder()
_inbound_decoder = msgspec.msgpack.Decoder(Inbound)
_outputs_decoder = msgspec.msgpack.Decoder(EngineOutputs)

# Grammars compiled at once: llguidance compiles outside the GIL, each on a thread of its own.
_GRAMMAR_THREADS = 2
#: Seconds without work after which the loop gives its freed heap back.
SETTLE_S = 2.0


def encode(message: Inbound | EngineOutputs) -> bytes:
    return _encoder.encode(message)


def decode_outputs(data: bytes) -> EngineOutputs:
    return _outputs_decoder.decode(data)


class EngineConnection(Protocol):
    """What the frontend drives, whether the loop runs in a thread or in its own process.

    `start(sink)` begins delivering encoded `EngineOutputs` to `sink`, from a thread other
    than the caller's (the sink must not block). `alive` turns False once the engine cannot
    serve; its last message then carries `engine_failed`, unless it was shut down.
    """

    config: EngineConfig

    @property
    def alive(self) -> bool: ...

    def start(self, sink: OutputSink) -> None: ...

    def send(self, message: Inbound) -> None: ...

    def shutdown(self, timeout: float | None = 30.0) -> None: ...


class EngineLoop:
    """Steps `engine`, in a thread of its own (`start`) or in the caller's (`run`)."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.config = engine.config
        # Encoded inbound messages; None wakes the loop (a grammar has compiled, a rank failed).
        self._inbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._compiling: dict[str, tuple[EngineRequest, Future]] = {}
        self._checking: dict[str, Future] = {}  # CheckGrammar's check_id -> its compile
        self._grammar_pool: ThreadPoolExecutor | None = None
        self._settled = True  # nothing freed since the heap was last given back
        self.error: BaseException | None = None

    def start(self, sink: OutputSink) -> None:
        """Run the loop in a daemon thread."""
        self._thread = threading.Thread(
            target=self.run, args=(sink,), name="pegainfer-engine", daemon=True
        )
        self._thread.start()

    @property
    def alive(self) -> bool:
        # A failed loop is dead from the moment it fails, before its thread has ended: the
        # failure it hands the sink must not race with this flag.
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def send(self, message: Inbound) -> None:
        self._inbox.put(encode(message))

    def send_encoded(self, data: bytes) -> None:
        """Queue a message already encoded (as it arrives from another process)."""
        self._inbox.put(data)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop and wait for the engine's own shutdown (a failed loop is still
        shutting its engine down when it reports the failure)."""
        if self.alive:
            self.send(Shutdown())
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)

    def run(self, sink: OutputSink) -> None:
        """Step the engine until a `Shutdown` arrives or a step fails; `sink` gets every
        encoded `EngineOutputs` (from this thread: it must not block)."""
        outputs: list[RequestOutput] = []
        # A parallel rank failing while the loop idles wakes it (None), to fail at once.
        self.engine.notify_on_rank_failure(lambda: self._inbox.put(None))
        try:
            while True:
                # Idle: capture a decode graph still missing before waiting for work.
                idle = not self.engine.has_unfinished_requests
                block = idle and not self.engine.capture_pending_graph()
                for message in self._receive(block=block):
                    if isinstance(message, Shutdown):
                        return
                    outputs.extend(self._handle(message))
                self.engine.check_ranks()
                outputs.extend(self._admit_compiled())
                checks = self._answer_checks()
                outputs.extend(self.engine.step())
                if outputs or checks:
                    sink(encode(EngineOutputs(outputs, self.engine.stats(), checks)))
                    outputs = []
        except Exception as exc:
            logger.exception("engine loop failed; failing every request in flight")
            self.error = exc
            # The frontend fails every request it is waiting on, sent or still in the inbox.
            sink(encode(EngineOutputs(outputs, engine_failed=f"engine failure: {exc}")))
        finally:
            if self._grammar_pool is not None:
                self._grammar_pool.shutdown(wait=False, cancel_futures=True)
            self.engine.shutdown()

    def _receive(self, block: bool) -> list[Inbound]:
        """Everything waiting in the inbox; waits for the first message (or a compiled
        grammar) when `block`."""
        messages = []
        try:
            if block:
                data = self._wait()
                if data is not None:
                    messages.append(_inbound_decoder.decode(data))
            while True:
                data = self._inbox.get_nowait()
                if data is not None:
                    messages.append(_inbound_decoder.decode(data))
        except queue.Empty:
            if messages:
                self._settled = False
            return messages

    def _wait(self) -> bytes | None:
        """The next inbox item, once there is one. After work, the first `SETTLE_S` seconds
        without any end in `release_freed_memory`."""
        if not self._settled:
            self._settled = True
            try:
                return self._inbox.get(timeout=SETTLE_S)
            except queue.Empty:
                release_freed_memory()
        return self._inbox.get()

    def _handle(self, message: EngineRequest | AbortRequest | CheckGrammar) -> list[RequestOutput]:
        if isinstance(message, CheckGrammar):
            self._checking[message.check_id] = self._on_pool(
                self.engine.check_grammar, message.structured, message.eos_token_ids
            )
            return []
        if isinstance(message, AbortRequest):
            aborted = [rid for rid in message.request_ids if self._compiling.pop(rid, None)]
            outputs = [RequestOutput(request_id=rid, new_token_ids=[], num_cached_tokens=0,
                                     finish_reason="abort") for rid in aborted]  # fmt: skip
            return outputs + self.engine.abort(message.request_ids)
        if message.params.structured is not None:
            self._compile(message)
            return []
        return self._add(message)

    def _add(self, message: EngineRequest) -> list[RequestOutput]:
        try:
            self.engine.add_request(message)
        except InvalidRequestError as exc:
            return [RequestOutput.failure(message.request_id, str(exc))]
        return []

    def _compile(self, message: EngineRequest) -> None:
        """Check the request, its grammar compiled against the tokenizer, on the pool; the
        loop wakes when that is done. The checks and the compiled grammar are remembered, so
        `add_request` repeats them on the loop's thread at the cost of a copy."""
        self._compiling[message.request_id] = (message, self._on_pool(self.engine.check_request,
                                                                      message))  # fmt: skip

    def _on_pool(self, work: Callable[..., object], *args: object) -> Future:
        """`work(*args)` on the grammar pool; the loop wakes when it is done."""
        if self._grammar_pool is None:
            self._grammar_pool = ThreadPoolExecutor(
                _GRAMMAR_THREADS, thread_name_prefix="pegainfer-grammar"
            )
        future = self._grammar_pool.submit(work, *args)
        future.add_done_callback(lambda _: self._inbox.put(None))
        return future

    def _admit_compiled(self) -> list[RequestOutput]:
        """Hand the engine the requests whose grammars have compiled (or fail them)."""
        outputs: list[RequestOutput] = []
        for request_id, (message, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            error = future.exception()
            if isinstance(error, InvalidRequestError):
                outputs.append(RequestOutput.failure(request_id, str(error)))
            elif error is not None:
                raise error
            else:
                outputs.extend(self._add(message))
        return outputs

    def _answer_checks(self) -> list[GrammarChecked]:
        """The verdicts on the grammars whose checks have compiled."""
        answers: list[GrammarChecked] = []
        for check_id, future in list(self._checking.items()):
            if not future.done():
                continue
            del self._checking[check_id]
            error = future.exception()
            if error is not None and not isinstance(error, InvalidRequestError):
                raise error
            answers.append(GrammarChecked(check_id, None if error is None else str(error)))
        return answers
