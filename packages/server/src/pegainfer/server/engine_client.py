"""The asyncio side of the engine boundary: submit requests, stream their outputs back.

The client holds an `EngineConnection` (the server's: the engine in a process of its own;
tests may drive a thread-mode `EngineLoop`), the engine's config and the frontend's
`RequestLimits`, never the engine itself. The connection hands encoded outputs to
`_on_outputs` from a thread of its own; they move onto the event loop, where each request's
outputs are detokenized (never on the engine loop) and measured for metrics. A consumer that
falls behind gets the outputs queued meanwhile as one delta (one SSE event instead of one per
token). A request whose consumer goes away is aborted.

Work on a request before it reaches the engine (chat templates, tokenizing, waiting for the
engine's verdict on a grammar) runs on a small pool of threads (`run_frontend`), never on the
event loop: a 10 MB prompt
takes seconds to tokenize, and every stream and `/health` must keep answering meanwhile.
Tokenizing and compiling release the GIL; a template holds it only in slices. A request being
prepared is a request waiting: it holds a waiting slot (and its body, up to the body limit)
until its preparation is done, so requests piling up behind slow preparations are bounded by
`--max-waiting-requests` and refused past it as a full queue refuses them.

A request's grammar is compiled by the engine, not here (`check_grammar`): the engine needs
it compiled to mask the request's tokens, and compiling it here too would cost this process
llguidance's view of the tokenizer (~120 MiB for Qwen3's vocabulary) and the compile twice.
The engine compiles it on its grammar threads, off the step loop, keeps it for the request,
and answers before the request is sent, so a bad grammar is still a 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

from pegainfer.core.engine.frontend import Frontend, RequestLimits, RequestStream, StreamDelta
from pegainfer.core.engine.loop import EngineConnection, decode_outputs
from pegainfer.core.engine.messages import (
    AbortRequest,
    CheckGrammar,
    EngineRequest,
    RequestOutput,
)
from pegainfer.core.engine.metrics import Metrics
from pegainfer.core.errors import InvalidRequestError
from pegainfer.core.process_info import release_freed_memory
from pegainfer.core.sampling.structured_output import StructuredOutput


class EngineFailedError(RuntimeError):
    """The engine loop failed while this request was in flight."""


class ServerBusyError(RuntimeError):
    """Too many requests are waiting for their first token."""


class ShuttingDownError(EngineFailedError):
    """The server is stopping: the request was ended (or refused) past the shutdown grace."""


# How long a reservation holds its slots if its requests never start (a client that left).
_RESERVATION_TTL = 30.0

_SHUTTING_DOWN = "the server is shutting down"

# Seconds every waiting slot may stay held with none given back before /health reports that
# the server cannot admit work: far longer than any healthy request waits for its first token.
_STALLED_S = 60.0

# Threads preparing requests: enough to overlap a large request with small ones, few enough
# that preparation never competes with the event loop for every core.
_FRONTEND_THREADS = max(2, min(4, (os.cpu_count() or 1) // 2))

# A job this long has likely allocated a lot (tokenizing a 2 MB prompt takes ~2 s and
# ~300 MB) and freed it; glibc keeps freed memory in its arenas, so it is given back to the
# system then (milliseconds, negligible beside such a job).
_LONG_JOB_S = 0.1

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(eq=False)
class Reservation:
    slots: int
    created: float


class AsyncEngineClient:
    """Starts delivering `engine`'s outputs (call it on the event loop that will serve)."""

    def __init__(
        self,
        engine: EngineConnection,
        frontend: Frontend,
        metrics: Metrics,
        max_waiting: int,
        max_unsent_tokens: int = 16384,
    ) -> None:
        self.config = engine.config
        self.limits = RequestLimits(
            self.config.vocab_size, self.config.max_model_len, self.check_grammar
        )
        self.frontend = frontend
        self.metrics = metrics
        self.max_waiting = max_waiting
        #: Tokens of one response that may wait for a client reading its stream slowly.
        self.max_unsent_tokens = max_unsent_tokens
        self._event_loop = asyncio.get_running_loop()
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._waiting: set[str] = set()
        self._preparing = 0  # frontend jobs queued or running, each holding a waiting slot
        self._slot_freed_at = time.monotonic()  # when a waiting slot was last given back
        self._reservations: list[Reservation] = []
        self._failed = False
        # Grammars the engine is compiling for frontend threads waiting on its verdict, by
        # check id; once it cannot answer, `_checks_ended` is why (shared with those threads).
        self._checks: dict[str, Future[str | None]] = {}
        self._checks_ended: EngineFailedError | None = None
        self._checks_lock = threading.Lock()
        # Shutdown: draining (no new requests; those in flight may finish), then stopped
        # (what is left was ended; nothing more starts). `_idle` is set once none are left.
        self.draining = False
        self._stopped = False
        self._idle = asyncio.Event()
        self._engine = engine
        self._frontend_pool = ThreadPoolExecutor(_FRONTEND_THREADS, "pegainfer-frontend")
        engine.start(self._on_outputs)

    async def run_frontend(self, work: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`work(*args, **kwargs)` on the frontend's threads: request preparation that may
        take long (see the module's docstring). It holds a waiting slot until it is done, or
        is refused with `ServerBusyError` when none is free."""

        def job() -> T:
            started = time.monotonic()
            try:
                return work(*args, **kwargs)
            finally:
                if time.monotonic() - started > _LONG_JOB_S:
                    release_freed_memory()

        self._admit(1)
        self._preparing += 1
        try:
            return await self._event_loop.run_in_executor(self._frontend_pool, job)
        finally:
            self._preparing -= 1
            self._slot_freed_at = time.monotonic()

    def close(self) -> None:
        """Stop the frontend's threads (work already queued still finishes; a thread waiting
        for a grammar's verdict gets `ShuttingDownError`)."""
        self._end_checks(ShuttingDownError(_SHUTTING_DOWN))
        self._frontend_pool.shutdown(wait=False, cancel_futures=True)

    def check_grammar(self, structured: StructuredOutput, eos_token_ids: list[int]) -> None:
        """Have the engine compile `structured` for requests ending in `eos_token_ids` and
        wait for its verdict (on a frontend thread: it blocks); raise `InvalidRequestError`
        if the grammar cannot be served, `EngineFailedError` if the engine cannot answer."""
        check_id = uuid.uuid4().hex
        verdict: Future[str | None] = Future()
        with self._checks_lock:
            if self._checks_ended is not None:
                raise self._checks_ended
            self._checks[check_id] = verdict
        self._engine.send(CheckGrammar(check_id, structured, eos_token_ids))
        error = verdict.result()
        if error is not None:
            raise InvalidRequestError(error, structured.kind)

    def _end_checks(self, reason: EngineFailedError) -> None:
        """No verdict will come: every waiting check, and any later one, fails with `reason`."""
        with self._checks_lock:
            self._checks_ended = self._checks_ended or reason
            waiting, self._checks = self._checks, {}
        for verdict in waiting.values():
            verdict.set_exception(reason)

    async def drain(self, grace: float) -> None:
        """Stop taking requests, give those in flight up to `grace` seconds to finish, then
        end the rest with `ShuttingDownError` (each consumer answers it: a 503, or an error
        event and [DONE] in a stream)."""
        self.draining = True
        if not self._queues:
            self._idle.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace)
        self._stopped = True
        for request_id, queue in self._queues.items():
            queue.put_nowait(RequestOutput.failure(request_id, _SHUTTING_DOWN))

    @property
    def slots_held(self) -> int:
        """Waiting slots held now, of `max_waiting`."""
        return self._held(time.monotonic())

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet finished, waiting or running."""
        return len(self._queues)

    @property
    def alive(self) -> bool:
        return not self._failed and self._engine.alive

    def _on_outputs(self, data: bytes) -> None:
        """Called on the engine thread: hand the bytes to the event loop."""
        self._event_loop.call_soon_threadsafe(self._dispatch, data)

    def _dispatch(self, data: bytes) -> None:
        batch = decode_outputs(data)
        if batch.stats is not None:
            self.metrics.record_engine_stats(batch.stats)
        for output in batch.outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)
        for checked in batch.grammar_checks:
            with self._checks_lock:
                verdict = self._checks.pop(checked.check_id, None)
            if verdict is not None:
                verdict.set_result(checked.error)
        if batch.engine_failed is not None:
            self._end_checks(EngineFailedError(batch.engine_failed))
            self._failed = True
            for request_id, queue in self._queues.items():
                queue.put_nowait(RequestOutput.failure(request_id, batch.engine_failed))

    def reserve(self, num_requests: int) -> Reservation:
        """Hold `num_requests` waiting slots for requests about to start, or refuse (503).

        Handlers reserve before they answer, so a refusal is a proper 503 even for a stream;
        `generate` claims the slots. A reservation nobody claims lapses after a while.
        """
        reservation = Reservation(num_requests, self._admit(num_requests))
        self._reservations.append(reservation)
        return reservation

    def _admit(self, num_requests: int) -> float:
        """Refuse (`ServerBusyError`, or the engine's state) unless `num_requests` more
        waiting slots are free; the time checked."""
        self._refuse_if_stopped()
        now = time.monotonic()
        held = self._held(now)
        if held + num_requests > self.max_waiting:
            raise ServerBusyError(f"{held} requests are already waiting")
        return now

    def _held(self, now: float) -> int:
        """Waiting slots held: by requests being prepared, by requests before their first
        token, and by reservations (those past their time freed)."""
        live = [r for r in self._reservations if now - r.created < _RESERVATION_TTL]
        if len(live) < len(self._reservations):
            self._slot_freed_at = now
        self._reservations = live
        return self._preparing + len(self._waiting) + sum(r.slots for r in live)

    def admission_stalled(self) -> str | None:
        """Why this server cannot admit work (None when it can): every waiting slot is held
        and none has been given back for `_STALLED_S` seconds, so every request gets 503 and
        will go on getting it. A server merely full for a moment is not stalled."""
        now = time.monotonic()
        if self._held(now) < self.max_waiting or now - self._slot_freed_at < _STALLED_S:
            return None
        return (
            f"cannot admit work: all {self.max_waiting} waiting slots held, none given back "
            f"for {now - self._slot_freed_at:.0f} s"
        )

    def _free_slot(self, request_id: str) -> None:
        if request_id in self._waiting:
            self._waiting.discard(request_id)
            self._slot_freed_at = time.monotonic()

    async def generate(
        self, request: EngineRequest, reservation: Reservation, prompt: str | None = None
    ) -> AsyncIterator[tuple[RequestStream, StreamDelta]]:
        """Submit `request` and yield its stream state with each new delta until it finishes.

        Closing the iterator early (the client disconnected) aborts the request.
        """
        reservation.slots -= 1
        if reservation.slots <= 0 and reservation in self._reservations:
            self._reservations.remove(reservation)
        self._refuse_if_stopped()
        request_id = request.request_id
        stream = RequestStream(
            request_id, request.prompt_token_ids, request.params, self.frontend.tokenizer, prompt
        )
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        self._waiting.add(request_id)
        # Latencies count from the request's arrival at the frontend, as vLLM's do.
        arrival = last = request.arrival_time
        backlog: deque[RequestOutput] = deque()
        try:
            # Inside the try: a send that fails still gives the waiting slot back.
            self._engine.send(request)
            if not self.alive:  # died before our request arrived: no output will come
                raise EngineFailedError("the engine loop is not running")
            while not stream.finished:
                if not backlog:
                    backlog.append(await queue.get())
                while not queue.empty():  # a consumer behind: what came meanwhile goes as one
                    backlog.append(queue.get_nowait())
                delta: StreamDelta | None = None
                while backlog and not stream.finished:
                    output = backlog[0]
                    if output.finish_reason == "error":
                        if delta is None:
                            failed = ShuttingDownError if self._stopped else EngineFailedError
                            raise failed(output.error or "the engine failed")
                        break  # the tokens before the failure go out first
                    backlog.popleft()
                    step, last = self._process(stream, output, arrival, last)
                    if delta is None:
                        delta = step
                    else:
                        delta.extend(step)
                assert delta is not None
                yield stream, delta
        finally:
            self._queues.pop(request_id, None)
            self._free_slot(request_id)
            if self.draining and not self._queues:
                self._idle.set()
            if not stream.finished:
                self._engine.send(AbortRequest([request_id]))
                reason = "abort" if self.alive else "error"
                elapsed = time.time() - arrival
                self.metrics.record_finished(
                    reason,
                    len(request.prompt_token_ids),
                    elapsed,
                    generation_tokens=len(stream.token_ids),
                    max_tokens=request.params.max_tokens,
                )

    def _refuse_if_stopped(self) -> None:
        if self._stopped:
            raise ShuttingDownError(_SHUTTING_DOWN)
        if not self.alive:
            raise EngineFailedError("the engine loop is not running")

    def _process(
        self, stream: RequestStream, output: RequestOutput, arrival: float, last: float
    ) -> tuple[StreamDelta, float]:
        """Fold one output into its request's stream and metrics; return the delta and when
        the request's latest tokens arrived (`last` unless this output brought some)."""
        now = time.time()
        request_id = stream.request_id
        if output.new_token_ids:
            first = request_id in self._waiting
            self._free_slot(request_id)
            self.metrics.record_tokens(len(output.new_token_ids), first=first, latency=now - last,
                                       prompt_tokens=len(stream.prompt_token_ids))  # fmt: skip
            last = now
        delta = stream.process(output)
        if delta.abort_engine:
            self._engine.send(AbortRequest([request_id]))
        if stream.finished:
            prompt_tokens = len(stream.prompt_token_ids)
            reason = stream.finish_reason or "abort"
            self.metrics.record_finished(
                reason,
                prompt_tokens,
                now - arrival,
                generation_tokens=len(stream.token_ids),
                max_tokens=stream.params.max_tokens,
                timing=output.timing,
            )
        return delta, last
