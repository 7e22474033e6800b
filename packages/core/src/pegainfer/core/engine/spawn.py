"""Starting the engine process before the server imports torch.

A spawned interpreter imports torch, the model lines and their kernels (seconds) before it can
load anything. Started first, the engine process does that while the server imports its own
modules (torch among them) and brings HTTP up, instead of after; so this module imports
nothing heavy, and the engine process's entry point imports the engine itself
(`pegainfer.core.engine.process`, which wraps a `SpawnedEngine` for the server).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from pegainfer.core.args import EngineArgs

_STOP_S = 10.0


@dataclass(frozen=True)
class SpawnedEngine:
    """A started engine process and the server's ends of its pipes: `inbox` carries messages
    to the engine, `outbox` its answers (only the engine process holds the other ends, so its
    death closes them)."""

    process: BaseProcess
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


def spawn_engine(args: EngineArgs, log_format: str = logging.BASIC_FORMAT) -> SpawnedEngine:
    """Spawn the engine process for `args`; it loads the model at once and logs at this
    process's level, in `log_format`."""
    context = mp.get_context("spawn")  # CUDA cannot be forked
    inbox_reader, inbox = context.Pipe(duplex=False)
    outbox, outbox_writer = context.Pipe(duplex=False)
    level = logging.getLogger().getEffectiveLevel()
    process = context.Process(
        target=_main,
        args=(args, inbox_reader, outbox_writer, level, log_format),
        name="pegainfer-engine",
        daemon=False,  # it may spawn tensor-parallel workers, which a daemon cannot
    )
    process.start()
    inbox_reader.close()
    outbox_writer.close()
    return SpawnedEngine(process, inbox, outbox)


def _main(
    args: EngineArgs, inbox: Connection, outbox: Connection, log_level: int, log_format: str
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
    engine_main(args, inbox, outbox, startup)
