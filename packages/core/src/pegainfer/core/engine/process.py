"""The engine loop in a process of its own, as vLLM's engine core runs.

HTTP framing, detokenization and metrics would otherwise share a GIL with the step loop (under
load the front end's Python took a third of the server's samples, and the step loop waited
for it). `spawn_engine` starts the engine process (`spawn.py`: before the server imports
torch, so the two import at once), which loads the model and answers with its resolved
`EngineConfig` or the text of the error that stopped it. Then inbound messages go down one
pipe and encoded `EngineOutputs` come back up another, the same bytes an `EngineLoop` thread
exchanges, so the frontend drives either through `EngineConnection`.

This module is the server's side and what both sides write on the pipes; it imports no torch,
which the server never does (the engine process's side: `process_main.py`). The server writes
inbound messages from a thread (`PipeWriter`), so its event loop never waits on a full pipe,
and a reader thread blocks in `recv_bytes` and hands each message to the sink; when the pipe
closes without a shutdown, the engine process died (killed, a crash, a CUDA error) and every
request in flight fails.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import signal
import threading
from multiprocessing import connection as mp_connection
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.engine_config import EngineConfig
from pegainfer.core.engine.loop import OutputSink, encode
from pegainfer.core.engine.messages import EngineOutputs, Inbound, Shutdown
from pegainfer.core.engine.spawn import EngineChild, SpawnedEngine, spawn_engine
from pegainfer.core.errors import PegainferError

logger = logging.getLogger(__name__)

# How long a shutdown waits for the engine process to stop after SIGTERM, before SIGKILL.
_TERMINATE_S = 10.0


class EngineStartError(PegainferError):
    """The engine process could not load the model; the message is the reason it gave."""


class Started(msgspec.Struct, omit_defaults=True):
    """The engine process's first message: the resolved config, or why it did not start."""

    config: EngineConfig | None = None
    error: str | None = None


def _enc_hook(obj: object) -> object:
    if isinstance(obj, Path):
        return str(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: object) -> object:
    if kind is Path:
        return Path(obj)  # type: ignore[arg-type]
    raise NotImplementedError(f"cannot decode {kind}")


_started_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_started_decoder = msgspec.msgpack.Decoder(Started, dec_hook=_dec_hook)


def encode_started(started: Started) -> bytes:
    return _started_encoder.encode(started)


class EngineProcess:
    """The engine process, seen from the server: `spawned` (`spawn_engine`) loads its model
    at once; `wait_ready` returns the engine's config once it has (or raises
    `EngineStartError`). `EngineProcess.spawn` does both steps."""

    def __init__(self, spawned: SpawnedEngine) -> None:
        self.process = spawned.process
        self._inbox, self._outbox = spawned.inbox, spawned.outbox
        self._writer = PipeWriter(self._inbox)
        self._reader: threading.Thread | None = None
        self._stopping = False
        self._dead = False

    @classmethod
    def spawn(cls, args: EngineArgs, log_format: str = logging.BASIC_FORMAT) -> EngineProcess:
        """Start the engine process for `args` (logging at this process's level, in
        `log_format`)."""
        return cls(spawn_engine(args, log_format))

    def wait_ready(self) -> EngineConfig:
        """Block until the engine has loaded; raise `EngineStartError` with its reason if it
        could not, or if the process died (or was stopped by `shutdown`) while loading."""
        mp_connection.wait([self._outbox, self.process.sentinel])
        try:
            started = _started_decoder.decode(self._outbox.recv_bytes())
        except (EOFError, OSError):
            self.process.join(_TERMINATE_S)
            started = Started(error=f"the engine process {_ended(self.process)} while loading")
        if started.config is None:
            self.shutdown()
            self._dead = True
            raise EngineStartError(started.error or "the engine did not start")
        self.config = started.config
        return started.config

    @property
    def alive(self) -> bool:
        return not self._dead and self.process.is_alive()

    def start(self, sink: OutputSink) -> None:
        """Deliver the engine's outputs to `sink` from a reader thread."""
        self._reader = threading.Thread(
            target=self._read, args=(sink,), name="pegainfer-engine-reader", daemon=True
        )
        self._reader.start()

    def send(self, message: Inbound) -> None:
        """Queue `message` for the engine; never blocks (a busy engine process may leave the
        pipe full for a while, and the caller is the server's event loop)."""
        self._writer.put(encode(message))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Ask the engine to stop, wait up to `timeout` s, then terminate (and kill) it."""
        self._stopping = True
        if self.process.is_alive():
            self.send(Shutdown())
            self.process.join(timeout)
        if self.process.is_alive():
            if timeout:
                logger.warning("the engine process did not stop in %s s: terminating it", timeout)
            self.process.terminate()
            self.process.join(_TERMINATE_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._writer.close()  # the engine process is gone: a write still blocked fails
        self._inbox.close()
        if self._reader is not None:
            self._reader.join()
        self._outbox.close()
        self.process.close()

    def _read(self, sink: OutputSink) -> None:
        try:
            while True:
                sink(self._outbox.recv_bytes())
        except (EOFError, OSError):
            pass
        if self._stopping:
            return
        # Died without a shutdown: whatever it was doing is lost.
        self.process.join(_TERMINATE_S)
        self._dead = True
        reason = f"the engine process {_ended(self.process)}"
        logger.error("%s; failing every request in flight", reason)
        sink(encode(EngineOutputs([], engine_failed=reason)))


def _ended(process: EngineChild) -> str:
    code = process.exitcode
    if code is None:
        return "closed its pipe"
    if code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"


class PipeWriter:
    """Writes messages to a pipe from a thread of its own, in order, so the caller never
    waits on a full pipe (the step loop, writing outputs to the server; the server's event
    loop, writing requests to the engine process). Once the other end is gone, messages are
    dropped."""

    def __init__(self, pipe: Connection) -> None:
        self._pipe = pipe
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="pegainfer-writer")
        self._thread.start()

    def put(self, data: bytes) -> None:
        self._queue.put(data)

    def close(self) -> None:
        """Write what is queued, then stop."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        with contextlib.suppress(OSError):  # the other end is gone
            while (data := self._queue.get()) is not None:
                self._pipe.send_bytes(data)
