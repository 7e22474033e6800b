"""Compiling a model line's kernels while its weights load, not when a step first needs them
(issue 21).

Triton compiles a kernel on its first launch with a given specialization (argument dtypes,
constexprs, whether an int equals 1 or is divisible by 16, whether a pointer is 16-byte
aligned, num_warps/num_stages) and FlashInfer builds a module (nvcc, ninja) on the first plan
that needs it. Left to the engine's first steps they compile one after another: on a fresh
H200 25-37 s in the KV-sizing step and 30 s more in Qwen3.5's warm-up.

A line lists what its served steps launch (`ModelLine.kernel_plan`): its Triton launches, found
by running its model's forward on the meta device with its CUDA ops while `JITFunction.run`
records instead of launching (`record_launches`, `runner/meta_steps.py`), so the list follows
the model's own code; and a factory of its attention backend, whose plan of a small mixed batch
builds the FlashInfer modules its steps use. `Precompile` builds the attention modules on one
thread (nvcc and ninja run as subprocesses) and records the Triton launches on another, which
compiles them on a pool of spawned processes (each `JITFunction.warmup` fills Triton's on-disk
cache, which the engine's launches then load), all while the engine loads the weights; `wait`
joins them before the KV-sizing step measures memory (the pool's processes have exited).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pegainfer.core.model_line import RuntimeConfig
from pegainfer.core.runner.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

# Triton specializes a pointer on 16-byte alignment and an int on divisibility by 16.
_ALIGN = 16
# Compile processes at most: each imports torch first (~0.4 GB resident, seconds of CPU), and
# the engine is loading weights meanwhile; 8 compile a MoE line's ~40 launches in a few rounds.
_MAX_WORKERS = 8


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument as Triton's specialization sees it: its dtype and its address modulo
    16 (`data_ptr` is all `JITFunction.warmup` reads of a tensor)."""

    dtype: torch.dtype
    offset: int = 0

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorArg:
        # A meta tensor has no address: a view's is its base's (allocations are aligned) plus
        # its storage offset.
        address = (tensor.storage_offset() * tensor.element_size() if tensor.is_meta
                   else tensor.data_ptr())  # fmt: skip
        return cls(tensor.dtype, address % _ALIGN)

    def data_ptr(self) -> int:
        return self.offset


def _spec(value: Any, exact: bool, specialize: bool, align: bool) -> Any:
    """What of an argument's value Triton's cache key holds: all of a constexpr's (`exact`);
    a tensor's dtype and 16-byte alignment; an int's equality to 1 and divisibility by 16
    (none of it where the kernel says `do_not_specialize`, no alignment or divisibility where
    it says `do_not_specialize_on_alignment`); a runtime float's or bool's type alone."""
    if exact:
        return value
    if isinstance(value, TensorArg):
        return (value.dtype, specialize and align and value.offset == 0)
    if isinstance(value, bool):
        return "u1"
    if isinstance(value, int):
        wide = not -(2**31) <= value < 2**31
        if not specialize:
            return ("int", wide)
        return ("int", wide, value == 1, align and value % _ALIGN == 0)
    if isinstance(value, float):
        return "fp32"
    return value


def _arg(value: Any) -> Any:
    return TensorArg.of(value) if isinstance(value, torch.Tensor) else value


@dataclass(frozen=True)
class KernelLaunch:
    """One Triton launch, without its grid: the kernel (by module and name, so a spawned
    process finds it), its arguments (tensors as `TensorArg`) and its keyword arguments
    (constexprs, num_warps, num_stages) in the order the launch passed them."""

    module: str
    name: str
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...] = ()

    def kernel(self) -> Any:
        return getattr(importlib.import_module(self.module), self.name)

    def key(self) -> tuple[Any, ...]:
        """Equal for two launches that compile the same kernel (Triton's specialization
        rules, read from the kernel's parameters)."""
        params = {p.name: p for p in self.kernel().params}
        names = list(params)

        def spec(name: str, value: Any) -> Any:
            param = params.get(name)
            if param is None:  # a compile option (num_warps, num_stages)
                return value
            # (Tritons before do_not_specialize_on_alignment specialize every argument on it.)
            align = not getattr(param, "do_not_specialize_on_alignment", False)
            return _spec(value, param.is_constexpr, not param.do_not_specialize, align)

        positional = tuple(spec(names[i], v) for i, v in enumerate(self.args))
        return (self.module, self.name, positional,
                tuple((k, spec(k, v)) for k, v in self.kwargs))  # fmt: skip

    def warmup(self) -> None:
        """Compile this launch's kernel (into Triton's on-disk cache) without running it."""
        self.kernel().warmup(*self.args, grid=(1,), **dict(self.kwargs))


@contextlib.contextmanager
def record_launches() -> Iterator[list[KernelLaunch]]:
    """Within the block, a Triton launch (`kernel[grid](...)`) from this thread is recorded,
    deduplicated by `KernelLaunch.key`, and neither compiled nor run: a launcher called on
    meta tensors lists what it would launch. Other threads' launches run as usual."""
    from triton.runtime.jit import JITFunction

    launches: dict[tuple[Any, ...], KernelLaunch] = {}
    original = JITFunction.run
    owner = threading.get_ident()

    def record(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        if warmup or threading.get_ident() != owner:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        # The keyword arguments in the call's order: the options among them (num_warps,
        # num_stages) are in Triton's in-memory cache key as the text of their dict, so a
        # warm-up that passed them in another order would load a kernel no step finds.
        launch = KernelLaunch(self.fn.__module__, self.fn.__name__, tuple(map(_arg, args)),
                              tuple((k, _arg(v)) for k, v in kwargs.items()))  # fmt: skip
        launches.setdefault(launch.key(), launch)
        return None

    recorded: list[KernelLaunch] = []
    with _PATCH_LOCK:  # one recording at a time (each restores what it replaced)
        JITFunction.run = record
        try:
            yield recorded
        finally:
            JITFunction.run = original
            recorded.extend(launches.values())


_PATCH_LOCK = threading.Lock()


class AttentionBackend(Protocol):
    """What `Precompile` needs of an attention backend: planning a step (which builds the
    library modules its runs use)."""

    def plan(self, batch: ForwardBatch) -> None: ...


@dataclass(frozen=True)
class KernelPlan:
    """What a line's served steps compile: a function recording its Triton launches (a meta
    forward per step: a second, several for a MoE line, so it runs in the background too) and
    a factory of its attention backend (None: nothing of that kind to compile)."""

    launches: Callable[[], tuple[KernelLaunch, ...]] | None = None
    attention: Callable[[], AttentionBackend] | None = None


@dataclass(frozen=True)
class StepBounds:
    """What bounds the steps the engine will run, known before the model is built."""

    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    graph_buckets: tuple[int, ...] = ()
    decode_attention_tensor_cores: str = "auto"
    small_batch_gemv: bool = False

    def runtime(self) -> RuntimeConfig:
        """A runtime within these bounds, for a model whose steps are only recorded (its
        sequences no longer than a step's budget)."""
        return RuntimeConfig(self.block_size, self.max_num_batched_tokens,
                             self.max_num_batched_tokens, self.max_num_seqs, self.graph_buckets,
                             self.decode_attention_tensor_cores,
                             self.small_batch_gemv)  # fmt: skip

    def token_counts(self, extra: frozenset[int] = frozenset()) -> list[int]:
        """Token counts of steps that together make every specialization on a step's size:
        the warm-up's (both sides of every power of two, and the `extra` counts modules ask
        for), and the decode-graph buckets."""
        from pegainfer.core.runner.warmup import warmup_token_counts

        budget = self.max_num_batched_tokens
        return sorted(set(warmup_token_counts(budget, budget, extra)) | set(self.graph_buckets))


def probe_batch(block_size: int, device: torch.device, decodes: int = 1) -> ForwardBatch:
    """`decodes` decode rows (each a sequence's second token) beside a three-token prompt:
    planning it builds what decode and prefill attention run (a backend may decode a few rows
    and many with different kernels)."""
    lengths = [2] * decodes + [3]
    tables, first = [], 0
    for length in lengths:
        pages = -(-length // block_size)
        tables.append(list(range(first, first + pages)))
        first += pages
    return ForwardBatch.build([[0]] * decodes + [[0, 0, 0]], [1] * decodes + [0], tables,
                              [True] * len(lengths), block_size, device)  # fmt: skip


def _compile(launch: KernelLaunch) -> None:
    launch.warmup()


class Precompile:
    """Compiles a line's `KernelPlan` in the background: `start` returns at once, `wait` joins.

    One thread builds the attention modules (FlashInfer's JIT runs nvcc and ninja as
    subprocesses: the longest compile, so it starts first); another records the Triton
    launches (or reads those of the same plan compiled into Triton's cache before:
    `plan_store`, when `plan_inputs` describes what the plan depends on besides the code),
    compiles them on a pool of spawned processes unless they were, then loads each into this
    process.
    """

    def __init__(
        self,
        plan: KernelPlan,
        bounds: StepBounds,
        device: torch.device,
        plan_inputs: str | None = None,
        imports: threading.Thread | None = None,
    ) -> None:
        self._plan = plan
        self._imports = imports
        self._plan_inputs = plan_inputs
        self._bounds = bounds
        self._device = device
        self.launches: tuple[KernelLaunch, ...] = ()  # once recorded
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self._cancelled = False
        self._errors: list[str] = []
        self._workers = 0
        self._in_cache = False  # the plan was compiled into Triton's cache before
        self._started = time.perf_counter()
        self._threads = [
            threading.Thread(target=target, daemon=True, name=f"pegainfer-precompile-{name}")
            for name, target, wanted in (
                ("attention", self._build_attention, plan.attention is not None),
                ("triton", self._compile_triton, plan.launches is not None),
            )
            if wanted
        ]

    @classmethod
    def start(
        cls,
        plan: KernelPlan,
        bounds: StepBounds,
        device: torch.device,
        plan_inputs: str | None = None,
        imports: threading.Thread | None = None,
    ) -> Precompile:
        """`imports`: a thread importing the kernels' libraries (the engine's); the attention
        modules are built once it has finished."""
        self = cls(plan, bounds, device, plan_inputs, imports)
        for thread in self._threads:
            thread.start()
        return self

    def _build_attention(self) -> None:
        if self._imports is not None:
            # Not beside it: importing a submodule (`flashinfer.mla`) while another thread
            # runs the package's `__init__` can deadlock on the two modules' import locks
            # (Python then raises `_DeadlockError` in one of the threads; seen on a GPU).
            self._imports.join()
        try:
            self._use_device()
            backend = self._plan.attention()
            # One decode row and as many as a step holds: both of a backend's decode kernels.
            for decodes in sorted({1, self._bounds.max_num_seqs}):
                backend.plan(probe_batch(self._bounds.block_size, self._device, decodes))
            if self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
        except Exception as error:
            self._errors.append(f"the attention backend: {error!r}")

    def _compile_triton(self) -> None:
        try:
            self._record_compile_and_load()
        except Exception as error:
            self._errors.append(f"the Triton launches: {error!r}")

    def _record_compile_and_load(self) -> None:
        from pegainfer.core.kernels import plan_store

        path = None
        if self._plan_inputs is not None:
            path = plan_store.plan_path(self._plan_inputs, self._device)
            stored = plan_store.load(path)
            self._in_cache = stored is not None
            self.launches = stored or ()
        if not self._in_cache:
            try:
                self.launches = self._plan.launches()
            except Exception as error:
                self._errors.append(f"recording the Triton launches: {error!r}")
                return
        launches = self.launches
        if not launches:
            return
        self._use_device()
        failed = set() if self._in_cache else self._compile_in_pool(launches)
        if path is not None and not self._in_cache and not failed and not self._cancelled:
            plan_store.store(path, launches)
        # Load each compiled kernel into this process (Triton's disk cache to its launch
        # cache: milliseconds each), so the engine's first steps find them there.
        for launch in launches:
            if launch.key() in failed or self._cancelled:
                continue
            try:
                launch.warmup()
            except Exception as error:
                self._errors.append(f"loading {launch.module}.{launch.name}: {error!r}")

    def _compile_in_pool(self, launches: tuple[KernelLaunch, ...]) -> set[tuple[Any, ...]]:
        """Compile `launches` on spawned processes; the keys of those that failed."""
        # At most one process per launch, one CPU left to the engine's loading.
        cpus = max(1, (os.cpu_count() or 2) - 1)
        self._workers = min(_MAX_WORKERS, cpus, len(launches))
        # Spawned, not forked: the engine process has threads and a CUDA context.
        context = multiprocessing.get_context("spawn")
        with self._lock:
            if self._cancelled:
                return {launch.key() for launch in launches}
            self._pool = ProcessPoolExecutor(self._workers, mp_context=context)
        futures = [(launch, self._pool.submit(_compile, launch)) for launch in launches]
        failed = set()
        for launch, future in futures:
            try:
                future.result()
            except Exception as error:
                failed.add(launch.key())
                self._errors.append(f"{launch.module}.{launch.name}: {error!r}")
        self._pool.shutdown(wait=True)
        return failed

    def _use_device(self) -> None:
        """Make the engine's GPU this thread's (CUDA's current device is per thread; a device
        without an index is the current one, the same in every thread that never set one)."""
        if self._device.type == "cuda" and self._device.index is not None:
            torch.cuda.set_device(self._device)

    def wait(self) -> str:
        """Wait for every compile and load (the pool's processes exit). A compile that fails
        is logged and left to the step that launches the kernel (which compiles it, or raises
        the same error there): precompiling saves time, it decides nothing. Returns what was
        compiled, for the start-up log."""
        for thread in self._threads:
            thread.join()
        failures = self._errors
        if failures:
            logger.warning(
                "precompiling failed for %d of the kernels (they compile at their first launch "
                "instead): %s", len(failures), "; ".join(failures),
            )  # fmt: skip
        seconds = time.perf_counter() - self._started
        attention = ", attention modules" if self._plan.attention is not None else ""
        failed = f", {len(failures)} failed" if failures else ""
        where = ("already in Triton's cache" if self._in_cache
                 else f"compiled on {self._workers} processes")  # fmt: skip
        return (f"{len(self.launches)} Triton launches {where}{attention}{failed}, "
                f"{seconds:.1f} s after they started")  # fmt: skip

    def cancel(self) -> None:
        """Stop compiling (compiles not started are dropped; the pool's processes exit)."""
        with self._lock:
            self._cancelled = True
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
        for thread in self._threads:
            thread.join()
