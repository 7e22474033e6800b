"""The engine process's side of `process.py`: load the engine, report its config (or why it
did not load) to the server, then run its loop until the server says stop or goes away.

The step loop runs in the main thread; a receiver thread moves messages from the server's
pipe to the loop's inbox and a `PipeWriter` thread writes outputs back, so a step never waits
on a full pipe. SIGINT is ignored (the server's Ctrl-C reaches the whole process group; the
server decides how the engine stops), and the process ends at once if the server's does.
"""

from __future__ import annotations

import logging
import signal
import threading
from multiprocessing.connection import Connection

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.engine.loop import EngineLoop
from pegainfer.core.engine.messages import Shutdown
from pegainfer.core.engine.process import PipeWriter, Started, encode_started
from pegainfer.core.errors import PegainferError
from pegainfer.core.process_info import StartupLog, exit_with_parent

logger = logging.getLogger(__name__)


def engine_main(
    args: EngineArgs, inbox: Connection, outbox: Connection, startup: StartupLog, lifeline: int
) -> None:
    """The engine process (logging set up, its start-up log begun): load, report, then run
    the loop until Shutdown or the server ends (`lifeline`: readable once it has)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=exit_with_parent, args=(lifeline,), daemon=True,
                     name="pegainfer-parent").start()  # fmt: skip
    try:
        engine = EngineCore(args, startup=startup)
    except Exception as exc:
        if not isinstance(exc, PegainferError):
            logger.exception("the engine failed to start")
        outbox.send_bytes(encode_started(Started(error=str(exc) or repr(exc))))
        raise SystemExit(1) from None
    outbox.send_bytes(encode_started(Started(config=engine.config)))
    loop = EngineLoop(engine)
    threading.Thread(target=_receive, args=(inbox, loop), daemon=True,
                     name="pegainfer-engine-receiver").start()  # fmt: skip
    writer = PipeWriter(outbox)
    try:
        loop.run(writer.put)
    finally:
        writer.close()
    if loop.error is not None:
        raise SystemExit(1)


def _receive(inbox: Connection, loop: EngineLoop) -> None:
    """Move inbound messages to the loop's inbox; the server closing the pipe stops it."""
    try:
        while True:
            loop.send_encoded(inbox.recv_bytes())
    except (EOFError, OSError):
        loop.send(Shutdown())
