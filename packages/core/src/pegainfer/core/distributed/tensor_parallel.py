"""The ranks of a parallel engine (tensor-parallel, or data-parallel attention): rank 0 is
the engine's own process (scheduler, sampler, rank 0's share of the model); ranks 1..N-1 are
worker processes it starts on its host, or the other hosts start (`nodes.py`: their messages
come over TCP, `remote_ranks.py`), each holding its share of the model and of the KV cache (with
data-parallel attention, its own sequences' cache), on its host's GPU `rank` mod the ranks
per host (CUDA) or the CPU. Every
rank loads its share of the weights before the ranks join, so the workers' start (spawn,
imports) overlaps rank 0's loading.

Rank 0 tells the workers what to do, in the order it does the same itself, so every
collective of the forward pass meets its peers: set up the per-step machinery (`RuntimeConfig`),
size the KV cache (on GPUs every rank runs the profiling step, which all-reduces, and the
smallest block count wins), allocate it, capture the decode CUDA graphs (the same buckets in
the same order on every rank: their warm-up steps all-reduce), then per step the step's plan
(its `StepPlan`; with data-parallel attention, each rank its own).
Every rank runs the forward, replaying a graph exactly when rank 0 does (`DecodeGraphs.can_run`
is a function of the plan); only rank 0 samples.

The forward's collectives go over one process group (NCCL on GPUs, gloo on the CPU); rank 0's
messages go down a pipe to each worker, pickled: writing one costs rank 0 microseconds and
does not wait for the worker while the pipe has room (1 MiB; the gloo broadcast used before
waited for the worker to take every message), and a worker waits for the next one however
long the server stays idle. A watcher thread on rank 0 sees a worker die: the engine fails
with a clear error at its next message, the other workers are ended, and on GPUs the NCCL
communicator is aborted, so rank 0's work in flight fails instead of waiting on collectives
that will never complete (a replayed graph's collectives are outside NCCL's watchdog and its
time limit, `collective_timeout()`; eager ones time out). A worker exits at once on any
error or when rank 0's process ends, and the ranks leave their group with graphs gone first
and a time limit. Under async scheduling, a step's decode rows take the ids the step before
samples on rank 0: rank 0 broadcasts them, and each rank writes them into its rows.
"""

from __future__ import annotations

import atexit
import fcntl
import gc
import logging
import multiprocessing.connection as mp_connection
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pegainfer.core.distributed.nodes import Nodes
from pegainfer.core.distributed.parallel import ParallelGroup
from pegainfer.core.distributed.remote_ranks import RemoteRanks, connect_to_rank_0
from pegainfer.core.engine.step_plan import StepPlan
from pegainfer.core.errors import ConfigError, PegainferError
from pegainfer.core.model import Model, ModelContext
from pegainfer.core.model_line import RuntimeConfig
from pegainfer.core.process_info import exit_with_parent
from pegainfer.core.runner.forward_batch import Feed
from pegainfer.core.runner.memory import KVSizing, fit_kv_blocks
from pegainfer.core.runner.model_runner import CacheShape, GraphSpec, ModelRunner

logger = logging.getLogger(__name__)
T = TypeVar("T")
# The forward's collectives, by default: long enough for a rank's first use of a kernel to
# compile it while its peers wait (FlashInfer's JIT takes minutes).
TIMEOUT = timedelta(seconds=600)
# NVLink multicast (NCCL's NVLS algorithms, torch's symmetric-memory multicast) can take a
# host's GPUs down; off unless the user sets these themselves.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# The ranks meet at rank 0's store: each worker checks in there once loaded, then waits for
# rank 0's go (set once rank 0 has loaded too and seen every worker alive) before joining.
_CHECK_IN, _GO, _POLL_S = "check-in/", "go", 0.05
_PIPE_BYTES = 1 << 20  # Linux's default limit for an unprivileged process


def keep_multicast_off() -> dict[str, str]:
    """Set the switches in `MULTICAST_OFF` that the environment leaves unset (the worker
    processes inherit them); return the values in force."""
    for key, value in MULTICAST_OFF.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in MULTICAST_OFF}


class RankFailedError(PegainferError):
    """A parallel worker process exited or stopped answering."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its share of the model."""

    line: str
    model_dir: Path
    config: dict[str, Any]
    dtype: torch.dtype
    device: str
    expert_parallel: bool = False
    #: The ranks are data-parallel attention ranks (each serves its own sequences), not
    #: tensor-parallel ones.
    data_parallel: bool = False
    #: Each rank draws its weights in place (`--load-format dummy`).
    random_weights: bool = False

    def context(self, device: torch.device, rank: int, world: int) -> ModelContext:
        """Rank `rank`'s context for building its share of the model."""
        ranks = ParallelGroup(rank, world)
        placement = {"data_parallel" if self.data_parallel else "parallel": ranks}
        return ModelContext(self.model_dir, self.config, self.dtype, device,
                            expert_parallel=self.expert_parallel,
                            random_weights=self.random_weights, **placement)  # fmt: skip

    def terms(self, nodes: Nodes) -> dict[str, object]:
        """What every host must agree on (JSON): the model and the ranks' layout, not the
        checkpoint's path, which may differ between hosts."""
        return {"line": self.line, "config": self.config, "dtype": str(self.dtype),
                "device": torch.device(self.device).type, "expert_parallel": self.expert_parallel,
                "data_parallel": self.data_parallel, "random_weights": self.random_weights,
                "world": nodes.world, "nnodes": nodes.nnodes}  # fmt: skip


def rank_device(device: str, local_rank: int) -> torch.device:
    """The device of the rank that is `local_rank` on its host: that GPU on CUDA, else the
    engine's device."""
    engine = torch.device(device)
    return torch.device("cuda", local_rank) if engine.type == "cuda" else engine


def collective_timeout() -> timedelta:
    """The forward's collectives' time limit: `TIMEOUT`, or PEGAINFER_TP_TIMEOUT_S seconds."""
    text = os.environ.get("PEGAINFER_TP_TIMEOUT_S")
    if text is None:
        return TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ConfigError(f"PEGAINFER_TP_TIMEOUT_S must be a positive number, not {text!r}")
    return timedelta(seconds=seconds)


def _widen(outbox: Connection) -> None:
    """Give the pipe room for a large plan (every row's block table) so that rank 0's write
    does not wait for the worker; Linux pipes hold 64 KiB by default."""
    try:
        fcntl.fcntl(outbox.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    except OSError as exc:  # above /proc/sys/fs/pipe-max-size: large plans wait for the reader
        logger.info("the parallel ranks' pipe keeps its default size: %s", exc)


def _init(rank: int, world: int, store: dist.Store, device: torch.device) -> None:
    """Join the forward's group (the default one, which `ParallelGroup` uses): NCCL on GPUs,
    gloo on the CPU."""
    init = dict(store=store, rank=rank, world_size=world, timeout=collective_timeout())
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # device_id: the communicator exists before any graph captures a collective.
        dist.init_process_group("nccl", device_id=device, **init)
    else:
        dist.init_process_group("gloo", **init)


def _leave(seconds: float = 10.0) -> None:
    """Destroy the process groups, giving up after `seconds`: NCCL's teardown waits for its
    peers (and for graphs still holding its work), and the process ends anyway."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception as exc:  # e.g. a communicator aborted after a rank died
            logger.warning("leaving the parallel ranks' process group: %s", exc)

    teardown = threading.Thread(target=destroy, daemon=True)
    teardown.start()
    teardown.join(seconds)
    if teardown.is_alive():
        logger.warning("the parallel ranks' process group did not close in %.0f s", seconds)


def _smallest(value: int, device: torch.device) -> int:
    """The smallest of every rank's `value`."""
    box = torch.tensor([value], device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MIN)
    return int(box.item())


def worker_main(rank: int, nodes: Nodes, spec: WorkerSpec, inbox: Connection | None) -> None:
    """Rank `rank`: on rank 0's host `inbox` is the pipe from rank 0 (its parent); on another
    host (None) the rank connects to rank 0 first, and its parent is that host's launcher
    (`worker_node`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it stops us
    threading.Thread(target=exit_with_parent, daemon=True, name="pegainfer-tp-parent").start()
    world = nodes.world
    device = rank_device(spec.device, nodes.local_rank(rank))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = stopped = None
    if inbox is None:  # before loading: rank 0 checks this host was started like its own
        store = nodes.connect_store(collective_timeout())
        inbox, stopped = connect_to_rank_0(nodes, store, rank, spec.terms(nodes))
    # Load this rank's share while the others start: a failure here (or a device that cannot
    # start) ends the worker before its check-in, which rank 0 reports when it joins.
    from pegainfer.core.plugins import model_lines

    line = next(line for line in model_lines() if line.name == spec.line)
    model = line.build_model(spec.context(device, rank, world)).eval()
    if store is None:
        store = nodes.connect_store(collective_timeout())
    store.set(f"{_CHECK_IN}{rank}", "")
    # However long rank 0 still loads (the parent thread ends us if rank 0 goes): joining
    # first would time out in the rendezvous and leave rank 0 in NCCL's set-up, unwatched.
    while not store.check([_GO]):
        time.sleep(_POLL_S)
    _init(rank, world, store, device)
    try:
        _serve(model, device, inbox)
    except EOFError:
        print(
            f"parallel rank {rank}: rank 0 hung up (its host stopped or failed)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)
    except BaseException:
        # A collective failed (or rank 0 went): exit at once, never waiting on peers that left.
        traceback.print_exc()
        os._exit(1)
    if stopped is not None:
        stopped.set()
    gc.collect()  # the graphs (captured collectives) before the communicator
    _leave()


def _serve(model: Model, device: torch.device, inbox: Connection) -> None:
    """Follow rank 0's messages until it sends None (EOFError if rank 0 is gone)."""
    runner = ModelRunner(model, device)
    with torch.inference_mode():
        while (message := pickle.loads(inbox.recv_bytes())) is not None:
            kind, detail = message
            if kind == "step":
                plan, feed = detail
                fed_ids = None
                if feed is not None:  # async scheduling: ids sampled by the step in flight
                    fed_ids = torch.empty(feed.total, dtype=torch.int64, device=device)
                    dist.broadcast(fed_ids, src=0)
                runner.forward(runner.batch(plan, feed, fed_ids))
            elif kind == "runtime":
                model.init_runtime(detail)
            elif kind == "size_kv":
                _smallest(fit_kv_blocks(model, detail, device), device)
            elif kind == "cache":
                runner.allocate(detail)
            elif kind == "graphs":
                runner.capture(detail)
            else:
                raise ValueError(f"rank 0 sent an unknown message {kind!r}")
    runner.release_graphs()


class TensorParallelRanks:
    """Rank 0's handle on the workers: start those of its host and accept those of the others
    (each loads its share of the weights while rank 0 loads its own), join them (`join`), then
    have them follow rank 0's set-up and steps (each call here comes right before rank 0 does
    the same)."""

    def __init__(self, nodes: Nodes, spec: WorkerSpec) -> None:
        self._timeout = collective_timeout()  # a bad PEGAINFER_TP_TIMEOUT_S fails first
        keep_multicast_off()
        nodes.choose_gloo_interface()  # before the workers start: they inherit it
        self._store, nodes = nodes.host_store(self._timeout)
        self.nodes = nodes
        context = mp.get_context("spawn")
        #: This host's workers (ranks 1..): the other hosts' ranks are `remote`'s.
        self.workers: list[BaseProcess] = []
        self._outboxes: list[Connection] = []  # ranks 1.. in order, once joined
        self.device = rank_device(spec.device, 0)
        #: Rank 0's place; its collectives work once `join` has set up the default group.
        self.group = ParallelGroup(0, nodes.world)
        self._joined, self._open = False, True
        self.failed: str | None = None
        self._on_failure: list[Callable[[], None]] = []
        self.remote: RemoteRanks | None = None
        atexit.register(self.shutdown)
        try:
            if nodes.nnodes > 1:
                self.remote = RemoteRanks(nodes, self._store, spec.terms(nodes))
            for rank in nodes.local_ranks[1:]:
                inbox, outbox = context.Pipe(duplex=False)
                _widen(outbox)
                self._outboxes.append(outbox)
                self.workers.append(context.Process(
                    target=worker_main, args=(rank, nodes, spec, inbox), daemon=True,
                    name=f"pegainfer-tp-rank{rank}",
                ))  # fmt: skip
                self.workers[-1].start()
                inbox.close()  # the worker's end: writing to a dead worker then fails at once
        except BaseException:
            self.shutdown()
            raise

    def join(self) -> None:
        """Wait for every worker to check in (failing at once if one exits first), then join
        the forward's group with them and start watching them."""
        try:
            self._await_check_in()
            if self.remote is not None:  # ranks are numbered host by host
                self.remote.stop_accepting()
                self._outboxes += [conn for _, conn in sorted(self.remote.outboxes().items())]
            self._store.set(_GO, "")
            _init(0, self.group.world_size, self._store, self.device)
        except BaseException:  # the workers would wait for rank 0 until their time limit
            self.shutdown()
            raise
        self._joined = True
        threading.Thread(target=self._watch, daemon=True, name="pegainfer-tp-watch").start()

    def _await_check_in(self) -> None:
        """Wait until every worker has loaded and reached the store, failing at once if one
        exits before (a worker that cannot start or load would otherwise leave rank 0 in the
        rendezvous, or in NCCL's set-up, which has no time limit).

        Loading has no time limit here, as rank 0's own load has none: the collectives' limit
        (PEGAINFER_TP_TIMEOUT_S, set short to notice a hung collective soon) would fail the
        start of any model whose shards take longer to load, or of workers that start slowly
        on a busy host. Another host's ranks must connect within --rendezvous-timeout; from
        then on their connections are their liveness."""
        keys = [f"{_CHECK_IN}{rank}" for rank in range(1, self.group.world_size)]
        while True:
            checked_in = self._store.check(keys)
            for rank, worker in enumerate(self.workers, start=1):
                if not worker.is_alive():
                    raise RankFailedError(
                        f"parallel rank {rank} exited (code {worker.exitcode}) before "
                        "joining; its output above says why"
                    )
            connected = self.remote is None or self.remote.connected()
            if checked_in and connected:
                return
            time.sleep(_POLL_S)

    def _watch(self) -> None:
        """When a worker dies mid-run, fail the engine at its next message and end the others:
        a survivor may be stuck in a collective with the dead rank, never reading rank 0's
        next message (whose write then blocks once the pipe is full); the other hosts' ranks
        exit when rank 0 hangs up on them. On GPUs, also abort the communicator: the dead rank
        leaves rank 0's NCCL kernels waiting (a replayed graph's collectives are not even
        under NCCL's watchdog)."""
        # A remote rank never writes after its hello: its connection turns readable when it ends.
        ended_by = {worker.sentinel: f"parallel rank {rank} exited mid-run"
                    for rank, worker in enumerate(self.workers, 1)}  # fmt: skip
        remote = self.remote.outboxes() if self.remote is not None else {}
        for rank, connection in remote.items():
            node = self.nodes.node_of(rank)
            ended_by[connection] = f"parallel rank {rank} (node {node}) hung up mid-run"
        ended = mp_connection.wait(list(ended_by))
        if not self._open:
            return
        self.failed = ended_by[ended[0]]
        logger.error("%s; stopping the other ranks", self.failed)
        for callback in self._on_failure:
            callback()
        for worker in self.workers:
            worker.kill()
        if self.remote is not None:
            self.remote.hang_up()
        if self.device.type != "cuda":
            return
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is None:
            logger.error("this torch cannot abort NCCL: work in flight may hang")
            return
        abort()

    def init_runtime(self, runtime: RuntimeConfig) -> None:
        self._send("runtime", runtime)

    def size_kv(self, sizing: KVSizing, fit: Callable[[], int]) -> int:
        """Every rank fits its KV cache (rank 0 by `fit`); the smallest block count."""
        self._send("size_kv", sizing)
        return self._collective(lambda: _smallest(fit(), self.device))

    def share(self, shape: CacheShape) -> None:
        self._send("cache", shape)

    def capture_graphs(self, spec: GraphSpec) -> None:
        self._send("graphs", spec)

    def run(self, plan: StepPlan, feed: Feed | None = None) -> None:
        """Have every worker run the step `plan` describes (rank 0 runs it next). `feed`: the
        rows whose ids the step in flight samples, which rank 0 broadcasts next
        (`share_inputs`; async scheduling)."""
        self._send("step", (plan, feed))

    def run_each(self, plans: list[StepPlan], feeds: list[Feed] | None = None) -> None:
        """Have worker `r` run the step `plans[r - 1]` describes (data-parallel attention: each
        rank its own sequences; rank 0 runs its own next), fed as `feeds[r - 1]` says."""

        def post() -> None:
            for r, (outbox, plan) in enumerate(zip(self._outboxes, plans, strict=True)):
                message = ("step", (plan, feeds and feeds[r]))
                outbox.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

        self._collective(post)

    def share_inputs(self, fed_ids: torch.Tensor) -> None:
        """Broadcast the ids the step in flight samples that this step's batches take."""
        self._collective(lambda: dist.broadcast(fed_ids, src=0))

    def _send(self, kind: str, detail: Any) -> None:
        self._collective(lambda: self._post((kind, detail)))

    def _post(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for outbox in self._outboxes:
            outbox.send_bytes(data)

    def notify_on_failure(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from the watcher's thread) once a rank has failed mid-run, so an
        idle engine learns of it without waiting for its next step."""
        self._on_failure.append(callback)

    def check(self) -> None:
        """Raise `RankFailedError` if a rank has failed."""
        if self.failed is not None:
            raise RankFailedError(f"{self.failed}; the engine cannot continue")

    def _collective(self, call: Callable[[], T]) -> T:
        self.check()
        for rank, worker in enumerate(self.workers, start=1):
            if not worker.is_alive():
                raise RankFailedError(
                    f"parallel rank {rank} exited (code {worker.exitcode}); "
                    "the engine cannot continue"
                )
        try:
            return call()
        except (RuntimeError, OSError) as exc:  # a peer vanished or a collective timed out
            raise RankFailedError(f"a parallel rank stopped answering: {exc}") from exc

    def shutdown(self) -> None:
        """Stop the workers (None ends their loop), leave the process groups with them, and
        kill any worker that has not ended 10 s later."""
        if not self._open:
            return
        self._open = False
        if not self._joined:  # nothing to leave: the workers are loading or waiting to join
            self._stop_workers(deadline=time.monotonic())
            return
        try:
            if self.failed is None and all(worker.is_alive() for worker in self.workers):
                self._post(None)
        except OSError:
            logger.warning("a parallel rank did not take the stop message")
        try:
            _leave()
        finally:
            self._stop_workers(deadline=time.monotonic() + 10)

    def _stop_workers(self, deadline: float) -> None:
        """Join the workers until `deadline`, kill those still running, close the pipes; wait
        as long for the other hosts' ranks to hang up, then hang up on those left (they exit)."""
        for worker in self.workers:
            worker.join(timeout=max(0.0, deadline - time.monotonic()))
            if worker.is_alive():
                worker.kill()
                worker.join()
        if self.remote is not None:
            left = list(self.remote.outboxes().values())
            while left and (wait := deadline - time.monotonic()) > 0:
                ended = mp_connection.wait(left, wait)
                left = [connection for connection in left if connection not in ended]
            self.remote.close()
        for outbox in self._outboxes:
            outbox.close()
