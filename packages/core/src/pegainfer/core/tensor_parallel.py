"""The ranks of a tensor-parallel engine: rank 0 is the engine's own process (scheduler,
sampler, rank 0's share of the model); ranks 1..N-1 are worker processes it starts, each
holding its share of the model and of the KV cache. Every step rank 0 broadcasts the step's
plan (the arguments of `ForwardBatch.build`), and every rank runs the forward; the row-parallel
layers' all-reduces keep them in step, and only rank 0 samples.

A worker that died is noticed before the next broadcast and fails the engine with a clear
error; collectives time out rather than hang (`TIMEOUT`). Under async scheduling, a step's
decode rows take the ids the step before samples on rank 0: rank 0 broadcasts them once fed.
CPU only (gloo) for now: NCCL and CUDA graphs across ranks are not built yet
(docs/parallelism.md).
"""

from __future__ import annotations

import atexit
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pegainfer.core.errors import PegainferError
from pegainfer.core.forward_batch import ForwardBatch
from pegainfer.core.kv_cache import KVCache
from pegainfer.core.model_line import ModelContext, RuntimeConfig
from pegainfer.core.parallel import ParallelGroup

TIMEOUT = timedelta(seconds=60)
# NVLink multicast (NCCL's NVLS algorithms, torch's symmetric-memory multicast) can take a
# host's GPUs down; off unless the user sets these themselves.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def keep_multicast_off() -> dict[str, str]:
    """Set the switches in `MULTICAST_OFF` that the environment leaves unset (the worker
    processes inherit them); return the values in force."""
    for key, value in MULTICAST_OFF.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in MULTICAST_OFF}


class RankFailedError(PegainferError):
    """A tensor-parallel worker process exited or stopped answering."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its share of the model."""

    line: str
    model_dir: Path
    config: dict[str, Any]
    dtype: torch.dtype
    device: str


@dataclass(frozen=True)
class CacheShape:
    """Rank 0's decisions the others must share: block ids and state slots mean the same
    thing on every rank."""

    runtime: RuntimeConfig
    block_size: int
    num_blocks: int
    num_slots: int


def _init(rank: int, world: int, port: int) -> ParallelGroup:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=TIMEOUT)  # fmt: skip
    return ParallelGroup(rank, world, dist.group.WORLD)


def _receive() -> Any:
    box = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _worker(rank: int, world: int, port: int, spec: WorkerSpec) -> None:
    from pegainfer.core.plugins import model_lines

    group = _init(rank, world, port)
    try:
        line = next(line for line in model_lines() if line.name == spec.line)
        device = torch.device(spec.device)
        model = line.build_model(ModelContext(spec.model_dir, spec.config, spec.dtype, device,
                                              group))  # fmt: skip
        model.eval()
        shape: CacheShape = _receive()
        model.init_runtime(shape.runtime)
        cache = KVCache(model.kv_arenas(shape.block_size), shape.num_blocks, device,
                        model.state_arenas(), shape.num_slots)  # fmt: skip
        with torch.inference_mode():
            while (message := _receive()) is not None:
                plan, fed = message
                batch = ForwardBatch.build(**plan, device=device)
                if fed:  # async scheduling: ids sampled by the step still in flight
                    dist.broadcast(batch.input_ids, src=0)
                model.prepare(batch)
                model(batch, cache)
    finally:
        dist.destroy_process_group()


class TensorParallelRanks:
    """Rank 0's handle on the workers: start them, share the cache shape, broadcast plans."""

    def __init__(self, world: int, spec: WorkerSpec) -> None:
        keep_multicast_off()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        context = mp.get_context("spawn")
        self.workers = [context.Process(target=_worker, args=(rank, world, port, spec),
                                        daemon=True, name=f"pegainfer-tp-rank{rank}")
                        for rank in range(1, world)]  # fmt: skip
        for worker in self.workers:
            worker.start()
        self.group = _init(0, world, port)
        self._open = True
        atexit.register(self.shutdown)

    def share(self, shape: CacheShape) -> None:
        self._broadcast(shape)

    def run(self, plan: dict[str, Any], fed: bool = False) -> None:
        """Have every worker run the step `plan` describes (rank 0 runs it next). `fed`: the
        batch's input ids follow (`share_inputs`) once rank 0 has fed it the tokens the step
        in flight samples (async scheduling)."""
        self._broadcast((plan, fed))

    def share_inputs(self, input_ids: torch.Tensor) -> None:
        self._collective(lambda: dist.broadcast(input_ids, src=0))

    def _broadcast(self, message: Any) -> None:
        self._collective(lambda: dist.broadcast_object_list([message], src=0))

    def _collective(self, call: Callable[[], object]) -> None:
        for rank, worker in enumerate(self.workers, start=1):
            if not worker.is_alive():
                raise RankFailedError(
                    f"tensor-parallel rank {rank} exited (code {worker.exitcode}); "
                    "the engine cannot continue"
                )
        try:
            call()
        except RuntimeError as exc:  # a peer vanished mid-collective or timed out
            raise RankFailedError(f"a tensor-parallel rank stopped answering: {exc}") from exc

    def shutdown(self) -> None:
        """Stop the workers (an empty plan ends their loop) and leave the process group."""
        if not self._open:
            return
        self._open = False
        try:
            if all(worker.is_alive() for worker in self.workers):
                dist.broadcast_object_list([None], src=0)
        finally:
            for worker in self.workers:
                worker.join(timeout=10)
                if worker.is_alive():
                    worker.kill()
            dist.destroy_process_group()
