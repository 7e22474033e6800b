"""A host other than node 0: it runs its share of the ranks and nothing else (no engine, no
HTTP), and supervises them as node 0's engine supervises its own workers.

The ranks connect to rank 0 (`remote_ranks`) and follow it until it stops them. This process
waits for them: when one exits with an error (or is killed), it ends the others and exits 1, so
the host's failure reaches rank 0 through the ranks' connections at once; when rank 0 stops
them, they exit 0 and so does this process. SIGTERM or SIGINT ends the ranks (rank 0 then
fails: a host it needs has gone). A rank that loses rank 0 exits by itself.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import threading
from multiprocessing import connection as mp_connection

from pegainfer.core.args import EngineArgs
from pegainfer.core.distributed.tensor_parallel import (
    collective_timeout,
    keep_multicast_off,
    worker_main,
)
from pegainfer.core.engine.core import plan_ranks
from pegainfer.core.errors import ConfigError

logger = logging.getLogger(__name__)

_STOP_S = 10.0


def run_worker_node(args: EngineArgs) -> int:
    """Run this host's ranks of `args` (a --node-rank other than 0) until they end; the exit
    status: 0 when rank 0 stopped them, 1 when one failed or the host was asked to stop."""
    args.validate()
    collective_timeout()  # a bad PEGAINFER_TP_TIMEOUT_S fails here, not in each rank
    _, spec, nodes = plan_ranks(args)
    if nodes.node_rank == 0:
        raise ConfigError("node 0 runs the engine and the HTTP server, not a worker node")
    keep_multicast_off()
    nodes.choose_gloo_interface()
    logger.info("%s; this host runs workers only (no HTTP server: node 0 serves it; the "
                "engine's settings beyond the model and layout are node 0's)",
                nodes.describe())  # fmt: skip
    context = mp.get_context("spawn")
    ranks = {
        context.Process(target=worker_main, args=(rank, nodes, spec, None), daemon=True,
                        name=f"pegainfer-tp-rank{rank}"): rank
        for rank in nodes.local_ranks
    }  # fmt: skip
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGINT, signal.SIGTERM)}  # fmt: skip
    try:
        for process in ranks:
            process.start()
        return _supervise(ranks, stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for process in ranks:
            process.join(_STOP_S)
            if process.is_alive():
                process.kill()
                process.join()


def _supervise(ranks: dict[mp.process.BaseProcess, int], stop: threading.Event) -> int:
    """Wait until every rank has exited 0, or one fails (then end the rest), or `stop`."""
    running = dict(ranks)
    while running:
        ended = mp_connection.wait([p.sentinel for p in running], timeout=0.2)
        for process in [p for p in running if p.sentinel in ended]:
            rank = running.pop(process)
            process.join()  # its sentinel closes as it exits, before its exit code is known
            if process.exitcode != 0:
                logger.error("parallel rank %d exited with code %s; ending this host's ranks",
                             rank, process.exitcode)  # fmt: skip
                _end(running)
                return 1
        if stop.is_set():
            logger.info("asked to stop: ending this host's ranks")
            _end(running)
            return 1
    logger.info("rank 0 stopped this host's ranks")
    return 0


def _end(running: dict[mp.process.BaseProcess, int]) -> None:
    for process in running:
        process.terminate()
