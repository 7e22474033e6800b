"""Starting the engine process before the server imports anything heavy.

A new interpreter imports torch, the model lines and their kernels (seconds) before it can
load anything. Started first, the engine process does that while the server imports its own
modules and brings HTTP up, instead of after; so this module imports nothing heavy, and the
engine process's entry point imports the engine itself (`pegainfer.core.engine.process`,
which wraps a `SpawnedEngine` for the server).

The process is a plain child interpreter (`python -m pegainfer.core.engine.spawn`), not a
multiprocessing one: multiprocessing's spawn runs the server's main module again in the child
(the `pegainfer-server` script, importing the CLI and its dependencies before the engine's own
imports begin) and starts a resource-tracker process beside it, which stays resident for the
server's life. The child gets its pipes as inherited descriptors and its arguments pickled as
the inbox's first message; two more pipes stand for the processes themselves: the server
watches one whose write end only the engine holds (readable once the engine has exited: its
`sentinel`), the engine one whose write end only the server holds (it ends itself when the
server has gone, even while blocked in a device sync).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

from pegainfer.core.args import EngineArgs

_STOP_S = 10.0


class EngineChild:
    """The engine process as the server drives it, with the part of multiprocessing's
    `Process` interface it uses."""

    def __init__(self, popen: subprocess.Popen[bytes], sentinel: int, lifeline: int) -> None:
        self._popen = popen
        #: Readable (end of file) once the engine process has exited.
        self.sentinel = sentinel
        self._lifeline = lifeline  # closing it tells the engine process the server has gone
        self._closed = False

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def exitcode(self) -> int | None:
        """None while it runs; its exit status, or -N if signal N ended it."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        """Wait for it to end, at most `timeout` seconds."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)

    def terminate(self) -> None:
        self._popen.terminate()  # nothing once it has been waited for

    def kill(self) -> None:
        self._popen.kill()

    def close(self) -> None:
        """Release the descriptors that stand for it (once it has ended, or to let it go)."""
        if not self._closed:
            self._closed = True
            os.close(self.sentinel)
            os.close(self._lifeline)


@dataclass(frozen=True)
class SpawnedEngine:
    """A started engine process and the server's ends of its pipes: `inbox` carries messages
    to the engine, `outbox` its answers (only the engine process holds the other ends, so its
    death closes them)."""

    process: EngineChild
    inbox: Connection
    outbox: Connection

    def stop(self) -> None:
        """End the process at once (before anything was asked of it: no orderly shutdown)."""
        self.inbox.close()
        self.outbox.close()
        self.process.terminate()
        self.process.join(_STOP_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.process.close()


def spawn_engine(args: EngineArgs, log_format: str = logging.BASIC_FORMAT) -> SpawnedEngine:
    """Start the engine process for `args`; it loads the model at once and logs at this
    process's level, in `log_format`."""
    inbox_reader, inbox_writer = os.pipe()
    outbox_reader, outbox_writer = os.pipe()
    sentinel, engine_end = os.pipe()
    lifeline_end, lifeline = os.pipe()
    child_fds = (inbox_reader, outbox_writer, engine_end, lifeline_end)
    try:
        popen = subprocess.Popen(
            [sys.executable, "-m", "pegainfer.core.engine.spawn", *map(str, child_fds)],
            pass_fds=child_fds,
        )
    except BaseException:
        for fd in (*child_fds, inbox_writer, outbox_reader, sentinel, lifeline):
            os.close(fd)
        raise
    for fd in child_fds:
        os.close(fd)
    inbox = Connection(inbox_writer, readable=False)
    level = logging.getLogger().getEffectiveLevel()
    # Into the pipe's buffer at once: the child reads it once its interpreter is up.
    inbox.send_bytes(pickle.dumps((args, level, log_format)))
    return SpawnedEngine(EngineChild(popen, sentinel, lifeline), inbox,
                         Connection(outbox_reader, writable=False))  # fmt: skip


def _child() -> None:
    """`python -m pegainfer.core.engine.spawn INBOX OUTBOX SENTINEL LIFELINE`: the engine
    process, on the descriptors `spawn_engine` passed."""
    inbox_fd, outbox_fd, sentinel_fd, lifeline_fd = map(int, sys.argv[1:5])
    for fd in (inbox_fd, outbox_fd, sentinel_fd, lifeline_fd):
        os.set_inheritable(fd, False)  # the engine's own children (parallel ranks) hold none
    inbox = Connection(inbox_fd, writable=False)
    args, log_level, log_format = pickle.loads(inbox.recv_bytes())
    _main(args, inbox, Connection(outbox_fd, readable=False), log_level, log_format,
          lifeline_fd)  # fmt: skip


def _main(
    args: EngineArgs,
    inbox: Connection,
    outbox: Connection,
    log_level: int,
    log_format: str,
    lifeline: int,
) -> None:
    """The engine process's entry point. What needs no torch starts first, beside its import:
    the checkpoint is read ahead into the page cache and the CUDA context is created on
    threads. The start-up log's first lines say when this process began, when torch and the
    engine were imported and when the context was ready."""
    from pegainfer.core.engine.early_cuda import start_primary_context
    from pegainfer.core.loading.prefetch import prefetch_checkpoint
    from pegainfer.core.process_info import StartupLog

    logging.basicConfig(level=log_level, format=log_format)
    startup = StartupLog(logging.getLogger("pegainfer.core.engine"))
    startup.mark("engine process started")
    if args.load_format != "dummy":
        prefetch_checkpoint(args.model)

    def context_done(failure: str | None) -> None:
        if failure is None:
            startup.mark("CUDA context ready (on a thread, beside the imports)")
        else:
            logging.getLogger(__name__).debug("no early CUDA context: %s", failure)

    start_primary_context(args.device, context_done)
    import torch  # noqa: F401  (timed here: the engine's largest import)

    startup.mark("torch imported")
    from pegainfer.core.engine.process_main import engine_main

    startup.mark("engine imported")
    engine_main(args, inbox, outbox, startup, lifeline)


if __name__ == "__main__":
    _child()
