"""The engine core: one model, its KV cache, a scheduler and a sampler, stepped by its owner.

It speaks only in token ids and the structs of `messages.py`. Tokenization, detokenization and
stop strings belong to the frontend; the engine handles stops it can see in token ids.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pegainfer.core.args import EngineArgs
from pegainfer.core.distributed.data_parallel import DataParallelScheduler, rank_plans
from pegainfer.core.distributed.nodes import Nodes
from pegainfer.core.distributed.tensor_parallel import TensorParallelRanks, WorkerSpec
from pegainfer.core.engine.engine_config import EngineConfig
from pegainfer.core.engine.frontend import RequestLimits
from pegainfer.core.engine.messages import (
    EngineRequest,
    EngineStats,
    RequestOutput,
    RequestTiming,
)
from pegainfer.core.engine.model_source import ModelSource, resolve_model_source
from pegainfer.core.engine.request import Request, RequestStatus
from pegainfer.core.engine.scheduler import (
    ScheduledChunk,
    Scheduler,
    SchedulerConfig,
    SchedulerStep,
)
from pegainfer.core.engine.step_plan import StepPlan
from pegainfer.core.errors import ConfigError, InvalidRequestError, ModelLineError
from pegainfer.core.kernels.precompile import KernelPlan, Precompile, StepBounds
from pegainfer.core.kv.block_manager import BlockManager
from pegainfer.core.kv.kv_cache import (
    ArenaSpec,
    StateSpec,
    bytes_per_block,
)
from pegainfer.core.kv.kv_events import KVEventsConfig, ZmqEventPublisher
from pegainfer.core.kv.kv_offload import HostMemoryTier
from pegainfer.core.model import ModelContext
from pegainfer.core.model_line import ModelLine, RuntimeConfig
from pegainfer.core.process_info import StartupLog
from pegainfer.core.runner.cuda_graphs import graph_buckets
from pegainfer.core.runner.forward_batch import Feed, ForwardBatch, LogitsRows, to_device
from pegainfer.core.runner.memory import (
    KVSizing,
    cpu_kv_blocks,
    fit_kv_blocks,
    given_gpu_kv_blocks,
    release_start_up_memory,
)
from pegainfer.core.runner.mixed_buckets import graph_token_cap, token_buckets
from pegainfer.core.runner.model_runner import CacheShape, GraphSpec, ModelRunner
from pegainfer.core.runner.warmup import WarmupShape, warm_up, watch_late_compiles
from pegainfer.core.sampling.sampler import ScoredTokens, sample_requests
from pegainfer.core.sampling.structured_output import Grammars, StructuredOutput
from pegainfer.core.speculative.drafter import Drafter, DraftInputs
from pegainfer.core.speculative.self_drafter import SelfDrafter
from pegainfer.core.speculative.verify import SpeculativeDecoding

if TYPE_CHECKING:
    import llguidance

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_GIB = 1 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} was asked for, but CUDA is not available")
    return device


def resolve_dtype(name: str, config: dict[str, Any], device: torch.device) -> torch.dtype:
    """`auto` computes in float32 on the CPU; on CUDA it keeps a 16-bit checkpoint's dtype and
    serves float32 checkpoints in bfloat16, since the CUDA kernels are 16-bit only."""
    if device.type == "cpu":
        return torch.float32 if name == "auto" else _DTYPES[name]
    if name == "float32":
        raise ConfigError(
            "dtype float32 is not supported on CUDA (the attention kernels are 16-bit); "
            "use bfloat16 or float16, or device cpu"
        )
    if name != "auto":
        return _DTYPES[name]
    declared = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    return torch.float16 if declared == "float16" else torch.bfloat16


@dataclass
class _Launched:
    """A step queued on the device whose sampled tokens have not reached the host.

    Its results are copied to the host as part of the step itself (non-blocking copies into
    pinned memory, then an event): waiting for them waits for this step only, not for the
    step launched after it, which a plain `.tolist()` on the stream would.
    """

    step: SchedulerStep
    tokens: torch.Tensor  # one per sampling chunk, on the device
    rows: dict[int, int]  # id(request) -> its row in `tokens`
    logprobs: tuple[list[int], ScoredTokens] | None = None  # the rows that asked, scored
    # Prompt logprobs: (request, position of the first token scored, its tokens, scores).
    prompt_logprobs: list[tuple[Request, int, list[int], ScoredTokens]] = field(
        default_factory=list
    )
    _host_tokens: torch.Tensor | None = None
    _ready: torch.cuda.Event | None = None

    def __post_init__(self) -> None:
        """Start the copies to the host behind the step's work."""
        self._host_tokens = self.tokens.to("cpu", non_blocking=True)
        if self.logprobs is not None:
            self.logprobs = (self.logprobs[0], self.logprobs[1].to_host_async())
        self.prompt_logprobs = [
            (request, position, targets, scores.to_host_async())
            for request, position, targets, scores in self.prompt_logprobs
        ]
        if self.tokens.is_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record()

    def token_ids(self) -> list[int]:
        """The sampled ids, once they are on the host (waits for this step's copies)."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host_tokens.tolist()

    def fed_ids(self, step: SchedulerStep) -> torch.Tensor:
        """The tokens this step samples that `step` feeds (its requests' pending ones), in
        chunk order, on the device."""
        sources = [self.rows[id(c.request)] for c in step.chunks if c.request.num_pending]
        # int64 whatever the sampler gave: the other ranks receive them as such.
        return self.tokens[to_device(sources, self.tokens.device)].long()


def _feeds(step: SchedulerStep) -> list[Feed]:
    """Each rank's rows fed by the step in flight (one rank's unless `step` has `parts`): a
    request scheduled with a pending token (the one that step samples) has it as its last
    input."""
    feeds, start = [], 0
    for part in step.parts or [step]:
        rows, end = [], 0
        for chunk in part.chunks:
            end += chunk.num_tokens
            if chunk.request.num_pending:
                rows.append(end - 1)
        feeds.append((tuple(rows), start))
        start += len(rows)
    return [Feed(rows, first, start) for rows, first in feeds]


def plan_ranks(
    args: EngineArgs, lines: list[ModelLine] | None = None
) -> tuple[ModelSource, WorkerSpec, Nodes]:
    """What every rank of `args` builds (the model, its line and layout: checked here) and on
    which hosts the ranks run; the same on every host."""
    source = resolve_model_source(args, lines)
    line = source.line
    ignored = sorted(line.unsupported_args & args.explicit_fields())
    if ignored:
        raise ConfigError(
            f"the {line.name!r} model line does not use these arguments: {', '.join(ignored)}"
        )
    if args.data_parallel_size > 1 and not line.supports_data_parallel:
        raise ConfigError(
            f"the {line.name!r} model line does not run data-parallel attention "
            "(--data-parallel-size): it has no experts for the ranks to share"
        )
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, source.config, device)
    spec = WorkerSpec(line.name, source.model_dir, source.config, dtype, str(device),
                      args.enable_expert_parallel, args.data_parallel_size > 1,
                      args.load_format == "dummy")  # fmt: skip
    nodes = Nodes.from_args(args)
    if nodes.world > 1:
        check_parallel(args, device, nodes.per_node)
    return source, spec, nodes


def check_parallel(args: EngineArgs, device: torch.device, local_world: int) -> None:
    """Refuse a parallel layout this host cannot run (`local_world` ranks on it)."""
    sizes = "--tensor-parallel-size x --data-parallel-size"
    if device.type == "cuda":
        if device.index not in (None, 0):
            raise ConfigError(
                f"parallel ranks run on the first {sizes} visible GPUs (divided by --nnodes): "
                "pick them with CUDA_VISIBLE_DEVICES rather than --device"
            )
        if torch.cuda.device_count() < local_world:
            raise ConfigError(
                f"{sizes} ranks on this host need {local_world} GPUs; visible: "
                f"{torch.cuda.device_count()}"
            )
    elif device.type != "cpu":
        raise ConfigError(f"parallel ranks run on CUDA or the CPU, not {device.type}")
    if args.kv_offload:
        raise ConfigError("--kv-offload does not work with parallel ranks yet")


class EngineCore:
    def __init__(
        self,
        args: EngineArgs,
        lines: list[ModelLine] | None = None,
        startup: StartupLog | None = None,
    ) -> None:
        """Load `args`' model and get it ready to serve; `startup` is the process's start-up
        log if it began one before (the engine process: its imports), else one starts here."""
        args.validate()
        self._startup = startup or StartupLog(logger)
        source, spec, nodes = plan_ranks(args, lines)
        if nodes.node_rank != 0:
            raise ConfigError(
                f"node {nodes.node_rank} of {nodes.nnodes} runs workers only "
                "(pegainfer.core.distributed.worker_node), not an engine"
            )
        device = torch.device(spec.device)
        # The kernels' libraries import while the weights load (`_set_up` waits).
        self._backend_import = (
            _import_in_background(("triton", "flashinfer"), self._startup)
            if device.type == "cuda"
            else None
        )
        logger.info("Loading %s with model line %r on %s in %s", source.model_dir,
                    source.line.name, spec.device, spec.dtype)  # fmt: skip
        # The kernels compile (spawned processes, a thread) while the weights load.
        self.precompile: Precompile | None = None
        if device.type == "cuda":
            self.precompile = _start_precompile(args, source.line,
                                                spec.context(device, 0, nodes.world),
                                                self._backend_import)  # fmt: skip
            self._startup.mark("model line imported, kernel plan started")
        self.ranks: TensorParallelRanks | None = None
        self.runner: ModelRunner | None = None  # once the model is built
        #: One KV-event publisher per attention rank, with its rank's block manager.
        self.kv_events: list[tuple[ZmqEventPublisher, BlockManager]] = []
        if nodes.world > 1:
            if nodes.nnodes > 1:
                logger.info("%s", nodes.describe())
            self.ranks = TensorParallelRanks(nodes, spec)
        try:
            self._set_up(args, source.line, source.tokenizer_dir,
                         spec.context(device, 0, nodes.world))  # fmt: skip
        except BaseException:
            self.shutdown()  # the workers and their process group end with the failed engine
            raise

    def _set_up(
        self, args: EngineArgs, line: ModelLine, tokenizer_dir: Path, context: ModelContext
    ) -> None:
        """Everything after the ranks start: the model (rank 0's share: `context`), its cache
        and graphs, the scheduler."""
        model_dir, device = context.model_dir, context.device
        self.model = line.build_model(context)
        self.model.eval()
        self.runner = ModelRunner(self.model, device)
        if self.ranks is not None:  # the workers loaded their shares meanwhile
            self.ranks.join()
        self._startup.mark("model loaded")

        max_model_len = args.max_model_len or self.model.max_position_embeddings
        if max_model_len > self.model.max_position_embeddings:
            raise ConfigError(
                f"max_model_len {max_model_len} exceeds the model's maximum of "
                f"{self.model.max_position_embeddings} positions"
            )
        # Speculative decoding's drafters write up to k positions past a sequence's newest
        # token (scratch the verify step rewrites): the per-step machinery (block tables, RoPE
        # tables) covers them.
        lookahead = args.speculative_tokens
        if not args.enable_chunked_prefill and args.max_num_batched_tokens < max_model_len:
            raise ConfigError(
                f"without chunked prefill, max_num_batched_tokens ({args.max_num_batched_tokens})"
                f" must be at least max_model_len ({max_model_len})"
            )
        cuda = device.type == "cuda"
        use_graphs = cuda and not args.enforce_eager and self.model.supports_cuda_graphs
        buckets = graph_buckets(args.max_num_seqs) if use_graphs else ()
        # Piecewise graphs for mixed steps: one process only for now (the workers could
        # capture them too, but that has not run on GPUs; data-parallel steps run eagerly).
        mixed_graphs = (use_graphs and args.mixed_step_graphs and self.ranks is None
                        and self.model.supports_piecewise_graphs)  # fmt: skip
        if args.max_mixed_graph_tokens is not None and not mixed_graphs:
            raise ConfigError(
                "--max-mixed-graph-tokens bounds the piecewise CUDA graphs of mixed steps, which "
                f"this engine does not capture (the {line.name!r} line on {device}"
                + (", --enforce-eager" if args.enforce_eager else "")
                + (", --no-mixed-step-graphs" if not args.mixed_step_graphs else "")
                + (", parallel ranks" if self.ranks is not None else "")
                + ")"
            )
        if args.decode_attention_tensor_cores != "auto" and not self.model.gqa_decode_kernels:
            raise ConfigError(
                f"--decode-attention-tensor-cores {args.decode_attention_tensor_cores}: the "
                f"{line.name!r} line's attention does not decode through FlashInfer's GQA "
                "kernels, so there is no choice to make; leave it at auto"
            )
        if args.small_batch_gemv and not (cuda and self.model.supports_small_batch_gemv):
            raise ConfigError(
                "--small-batch-gemv runs a CUDA kernel in the dense layers of lines that support "
                f"it (Qwen3); not the {line.name!r} line on {device}"
            )
        runtime = RuntimeConfig(
            block_size=args.block_size,
            max_model_len=max_model_len + lookahead,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            graph_buckets=buckets,
            decode_attention_tensor_cores=args.decode_attention_tensor_cores,
            small_batch_gemv=args.small_batch_gemv,
        )
        if self.ranks is not None:
            self.ranks.init_runtime(runtime)
        if self._backend_import is not None:
            self._backend_import.join()
        if self.precompile is not None:  # before any step compiles, or memory is measured
            self._startup.mark(f"kernels compiled: {self.precompile.wait()}")
        self.model.init_runtime(runtime)
        # The pieces' token buckets, up to where steps stop being launch-bound (mixed_buckets.py).
        tokens: tuple[int, ...] = ()
        if mixed_graphs:
            cap = graph_token_cap(self.model, args.max_num_batched_tokens,
                                  args.max_mixed_graph_tokens)  # fmt: skip
            tokens = token_buckets(cap)
        self.generator = torch.Generator(device).manual_seed(args.seed)
        # Before the arenas are read: a line's drafter may bring its own (an MTP layer's KV).
        drafter = self._drafter(args, line, context) if args.speculative_tokens else None
        specs = self.model.kv_arenas(args.block_size)
        states = self.model.state_arenas()
        prefix_caching = args.enable_prefix_caching and line.supports_prefix_caching
        if args.enable_prefix_caching and not prefix_caching:
            logger.info("prefix caching is off: the %r line does not support it yet", line.name)
        # Recurrent state: a slot per running sequence, then the checkpoints prefix hits need,
        # then (with graphs) the dummy slot that padding rows of graph replays use.
        checkpoints = args.state_checkpoints if states and prefix_caching else 0
        if states and prefix_caching and not checkpoints:
            logger.info("prefix caching is off: no state checkpoints (--state-checkpoints 0)")
            prefix_caching = False
        # With speculative decoding, one more per sequence: its state before a verify step's
        # drafts, to roll back to.
        rollback = args.max_num_seqs if drafter is not None else 0
        num_slots = (args.max_num_seqs + checkpoints + rollback + int(bool(buckets))
                     if states else 0)  # fmt: skip
        state_bytes = num_slots * sum(spec.bytes_per_slot for spec in states)
        num_blocks = args.num_kv_blocks or self._default_num_blocks(
            args, specs, device, max_model_len, num_slots, tokens
        )
        self._startup.mark(f"KV cache sized: {num_blocks} blocks")
        if num_blocks * args.block_size < max_model_len + lookahead:
            raise ConfigError(
                f"the KV cache holds {num_blocks} blocks of {args.block_size} tokens, fewer than "
                f"one sequence of max_model_len {max_model_len} needs"
                + (f" (and --speculative-tokens {lookahead} more)" if lookahead else "")
                + "; lower max_model_len or give the cache more memory"
            )
        # On CUDA (and with data-parallel attention) one more block than the block manager
        # hands out: padding rows of graph replays (and idle ranks' dummy tokens) read and
        # write it.
        self.data_parallel_size = args.data_parallel_size
        dummy = int(cuda or self.data_parallel_size > 1)
        shape = CacheShape(args.block_size, num_blocks + dummy, num_slots)
        if self.ranks is not None:
            self.ranks.share(shape)
        self.kv_cache = self.runner.allocate(shape)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)%s",
            num_blocks,
            args.block_size,
            self.kv_cache.nbytes / _GIB,
            f", of which {state_bytes / _GIB:.2f} GiB recurrent state: {args.max_num_seqs} "
            f"sequences and {checkpoints} checkpoints for prefix hits"
            if states
            else "",
        )
        self._startup.mark("KV cache allocated")
        if self.ranks is None:  # parallel ranks' forwards need a plan the workers follow
            _check_forward(line, self.runner, args.block_size, bool(states))
        captured: tuple[int, ...] = ()  # the decode graphs' buckets captured before serving
        if buckets:
            # One process captures the rest of the decode graphs while it serves.
            graph_spec = GraphSpec(buckets, num_blocks, num_slots - 1 if states else None, tokens,
                                   lazy=self.ranks is None)  # fmt: skip
            if self.ranks is not None:
                self.ranks.capture_graphs(graph_spec)
            self.runner.capture(graph_spec)
            captured = self.runner.graphs.captured
            pieces = self.runner.mixed_graphs.captured if tokens else ()
            self._startup.mark(f"{len(captured)} of {len(buckets)} decode graphs and {len(pieces)} "
                               f"of {len(tokens)} mixed-step graphs captured")  # fmt: skip
        if cuda and self.ranks is None:  # parallel ranks' steps need plans (as for the check)
            warmup = WarmupShape(args.block_size, args.max_num_batched_tokens, max_model_len,
                                 args.max_num_seqs, num_blocks, bool(states), checkpoints,
                                 captured)  # fmt: skip
            self._startup.mark(f"warm-up: {warm_up(self.runner, warmup)} eager steps")
            watch_late_compiles()
        self.config = EngineConfig(
            model_dir=model_dir,
            tokenizer_dir=tokenizer_dir,
            model_config=context.config,
            line=line.name,
            device=str(device),
            dtype=str(context.dtype).removeprefix("torch."),
            max_model_len=max_model_len,
            block_size=args.block_size,
            num_kv_blocks=num_blocks,
            vocab_size=self.model.vocab_size,
            reasoning_parser=line.reasoning_parser_for(context.config, tokenizer_dir),
            tool_call_parser=line.tool_call_parser,
        )
        self.offload: HostMemoryTier | None = None
        self._landing: dict[int, Request] = {}  # device block -> the request restoring it
        if args.kv_offload:
            self.offload = self._host_tier(args, specs, states, checkpoints, device)
        scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            num_state_checkpoints=checkpoints,
            num_speculative_tokens=args.speculative_tokens,
            rollback_slots=args.max_num_seqs + checkpoints if states and rollback else None,
        )
        events = KVEventsConfig.parse(args.kv_events_config or "{}")
        if events.publishes and not prefix_caching:
            raise ConfigError(
                "--kv-events-config reports the prefix cache's blocks, and the prefix cache is off "
                f"for the {line.name!r} line here (unsupported, or --state-checkpoints 0)"
            )
        # One per attention rank (data-parallel attention: each rank has its own cache).
        hash_blocks = prefix_caching or args.kv_offload
        schedulers = [
            line.scheduler_class()(
                scheduler_config,
                BlockManager(num_blocks, args.block_size, prefix_caching, hash_blocks=hash_blocks,
                             record_events=events.publishes),
                self.offload,
            )
            for _ in range(self.data_parallel_size)
        ]  # fmt: skip
        self.kv_events = [
            (ZmqEventPublisher(events, rank), scheduler.blocks)
            for rank, scheduler in enumerate(schedulers)
            if events.publishes
        ]
        #: The block manager (rank 0's with data-parallel attention; `scheduler.ranks` holds
        #: every rank's scheduler and its block manager).
        self.block_manager = schedulers[0].blocks
        self.scheduler: Scheduler | DataParallelScheduler = schedulers[0]
        if self.data_parallel_size > 1:
            self.scheduler = DataParallelScheduler(schedulers)
        self.requests: dict[str, Request] = {}
        self.async_scheduling = args.async_scheduling
        self.speculative: SpeculativeDecoding | None = None
        if drafter is not None:
            self.speculative = SpeculativeDecoding(drafter, self.model.vocab_size, self.generator)
            if self.async_scheduling:
                logger.info("speculative decoding runs its steps one after another (no async "
                            "scheduling yet)")  # fmt: skip
            self.async_scheduling = False
        self._in_flight: _Launched | None = None
        self._step_tokens: list[int] = []  # per launched step, until the next stats()
        load_tokenizer = partial(line.load_tokenizer, tokenizer_dir)
        self.grammars = Grammars(load_tokenizer, self.config.vocab_size)
        release_start_up_memory(device)
        self._startup.mark("engine ready")

    def _drafter(self, args: EngineArgs, line: ModelLine, context: ModelContext) -> Drafter:
        """The drafter `--speculative-method` names, or why this line cannot speculate."""
        k = args.speculative_tokens
        if args.speculative_method == "self":
            if self.model.state_arenas():
                raise ConfigError(
                    f"--speculative-method self does not work with the {line.name!r} line: its "
                    "draft forwards would advance the recurrent state past the last accepted "
                    "token"
                )
            return SelfDrafter(self.runner, k, self.model.vocab_size, self.generator)
        drafter = line.build_drafter(self.model, context, k, self.runner)
        if drafter is None:
            raise ConfigError(
                f"the {line.name!r} line has no MTP drafter (--speculative-method mtp); "
                "--speculative-method self drafts with the model itself (for measurements)"
            )
        return drafter

    @staticmethod
    def _host_tier(
        args: EngineArgs,
        specs: list[ArenaSpec],
        states: list[StateSpec],
        checkpoints: int,
        device: torch.device,
    ) -> HostMemoryTier:
        """The host tier: `--kv-offload-gib` of pinned memory. With recurrent state a quarter
        of it (at most 4x the device's checkpoints) holds state checkpoints, the rest blocks."""
        budget = int(args.kv_offload_gib * _GIB)
        host_checkpoints = 0
        if states:
            if not checkpoints:
                raise ConfigError(
                    "--kv-offload with a recurrent model needs prefix caching with state "
                    "checkpoints (--state-checkpoints > 0)"
                )
            per_checkpoint = sum(spec.bytes_per_slot for spec in states)
            host_checkpoints = min(4 * checkpoints, budget // 4 // per_checkpoint)
            budget -= host_checkpoints * per_checkpoint
        tier = HostMemoryTier(
            specs, budget // bytes_per_block(specs), device, states, host_checkpoints
        )
        logger.info(
            "KV offload: a host tier of %d blocks%s (%.2f GiB)",
            tier.capacity,
            f" and {host_checkpoints} state checkpoints" if states else "",
            tier.nbytes / _GIB,
        )
        return tier

    def capture_pending_graph(self) -> bool:
        """Capture one decode graph or mixed step's pieces not captured yet (an idle loop's
        work; steps capture the bucket they need themselves); whether there was one."""
        return self.runner is not None and self.runner.capture_pending()

    def notify_on_rank_failure(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from another thread) if a parallel rank fails mid-run."""
        if self.ranks is not None:
            self.ranks.notify_on_failure(callback)

    def check_ranks(self) -> None:
        """Raise `RankFailedError` if a parallel rank has failed (even with nothing to run)."""
        if self.ranks is not None:
            self.ranks.check()

    def shutdown(self) -> None:
        """Stop the parallel workers, if any, and the KV-event publishers, and drop the CUDA
        graphs with their private memory pools (the engine is unusable afterwards). The
        weights and the KV cache go with the engine object: a process that builds another
        engine drops this one (`LLM.close`)."""
        if self.precompile is not None:  # a start that failed while compiling
            self.precompile.cancel()
        for publisher, _ in self.kv_events:
            publisher.close()
        self.kv_events = []
        # Graphs hold captured collectives: they go before the communicator does.
        if self.runner is not None:
            self.runner.release_graphs()
        gc.collect()
        if self.ranks is not None:
            self.ranks.shutdown()

    def _default_num_blocks(
        self,
        args: EngineArgs,
        specs: list[ArenaSpec],
        device: torch.device,
        max_model_len: int,
        num_slots: int,
        mixed_step_tokens: tuple[int, ...],
    ) -> int:
        given = args.kv_cache_memory_bytes
        if device.type == "cpu":
            if args.cpu_kv_cache_gib is not None:
                given = int(args.cpu_kv_cache_gib * _GIB)
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
            return cpu_kv_blocks(specs, args.block_size, args.max_num_seqs, max_model_len,
                                 weights, given)  # fmt: skip
        if given is not None:
            state_bytes = num_slots * sum(s.bytes_per_slot for s in self.model.state_arenas())
            return given_gpu_kv_blocks(specs, state_bytes, given, device)
        sizing = KVSizing(args.block_size, args.max_num_batched_tokens, args.max_num_seqs,
                          max_model_len, args.gpu_memory_utilization, num_slots,
                          mixed_step_tokens)  # fmt: skip

        def fit() -> int:
            return fit_kv_blocks(self.model, sizing, device)

        return fit() if self.ranks is None else self.ranks.size_kv(sizing, fit)

    def check_request(self, msg: EngineRequest) -> int:
        """Validate a request against the model; return its resolved max_tokens."""
        max_tokens = RequestLimits(self.config.vocab_size, self.config.max_model_len).check(msg)
        if msg.params.structured is not None:
            self._matcher(msg)
        return max_tokens

    def check_grammar(self, structured: StructuredOutput, eos_token_ids: list[int]) -> None:
        """Compile `structured` against the tokenizer (kept for the requests that use it), or
        raise `InvalidRequestError` saying why it cannot be served."""
        self.grammars.matcher(structured, eos_token_ids)

    def _matcher(self, msg: EngineRequest) -> llguidance.LLMatcher:
        """A fresh matcher of the request's grammar. Text the grammar forces is offered in
        its canonical tokens only, unless the request keeps tokens from the sampler: those
        may be the canonical ones, and the text is then written in others."""
        assert msg.params.structured is not None
        return self.grammars.matcher(msg.params.structured, msg.eos_token_ids,
                                     force_tokens=not msg.params.restricts_tokens)  # fmt: skip

    def add_request(self, msg: EngineRequest) -> None:
        if msg.request_id in self.requests:
            raise InvalidRequestError(f"request id {msg.request_id!r} is already in use")
        max_tokens = self.check_request(msg)
        generator = None
        if msg.params.seed is not None:
            generator = torch.Generator(self.runner.device).manual_seed(msg.params.seed)
        request = Request(msg, max_tokens, generator)
        if msg.params.structured is not None:
            request.grammar = self._matcher(msg)
        self.requests[msg.request_id] = request
        self.scheduler.add(request)

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """Stop requests now; their blocks return to the pool."""
        outputs = []
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is not None and self.scheduler.abort(request_id) is not None:
                outputs.append(self._output(request, []))
        if not self.requests and self._in_flight is not None:
            # Nothing left to serve: the step in flight comes home now (its tokens go nowhere),
            # so the engine reports no unfinished work.
            self._commit(self._in_flight)
            self._in_flight = None
        return outputs

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch and report what each touched request produced.

        With async scheduling the step launched here is reported by the next call: this call
        schedules and launches step N+1, then waits for step N's tokens while the GPU runs
        N+1, so the host's work for a step overlaps the GPU's work for the one before.
        """
        early: list[RequestOutput] = []
        if self._in_flight is not None and any(
            r.needs_known_tokens for r in self.scheduler.running
        ):
            # Penalties and grammars follow every sampled token: bring pending ones home first.
            early, self._in_flight = self._commit(self._in_flight), None
        step = self.scheduler.schedule()
        for request, blocks, states in step.restores:
            request.restore = self.offload.load(blocks, self.kv_cache, states)
            self._landing.update(dict.fromkeys((block for _, block in blocks), request))
        if self.offload is not None:
            self._await_restores(step)
        if self.speculative is not None:
            if step.chunks:
                self._step_tokens.append(step.num_tokens)
            outputs = self._speculative_step(step) if step.chunks else []
            self._publish_kv_events()
            return outputs
        launched = self._launch(step) if step.chunks else None
        if launched is not None:
            self._step_tokens.append(sum(chunk.num_tokens for chunk in step.chunks))
        if not self.async_scheduling:
            outputs = self._commit(launched) if launched is not None else []
        else:
            outputs = early
            if self._in_flight is not None:
                outputs += self._commit(self._in_flight)
            self._in_flight = launched
        self._publish_kv_events()
        return outputs

    def _publish_kv_events(self) -> None:
        """Hand this step's prefix-cache changes to the publishers' threads."""
        for publisher, blocks in self.kv_events:
            events = blocks.take_events()
            if events:
                publisher.publish(events)

    def _await_restores(self, step: SchedulerStep) -> None:
        """Order each chunk after the host-tier copies it reads, on the device: its own
        request's, when it computes in the step that restores it (nothing else ran), and
        another request's, when its prompt hit blocks still landing (restored blocks join the
        prefix cache at admission). A restore waited for is settled: later work comes after it."""
        for chunk in step.chunks:
            readers = [chunk.request]
            if self._landing:
                readers += [self._landing[b] for b in chunk.request.block_ids if b in self._landing]
            for owner in readers:
                if owner.restore is not None:
                    self.offload.wait(owner.restore)
                    owner.restore = None
        if self._landing:  # entries go once their restore has settled
            self._landing = {b: r for b, r in self._landing.items() if r.restore is not None}

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._in_flight is not None

    def _launch(self, step: SchedulerStep) -> _Launched:
        """Queue the step's forward and sampling on the device; nothing waits for the GPU."""
        fed = self._in_flight is not None and any(c.request.num_pending for c in step.chunks)
        feeds = _feeds(step) if fed else None
        plan, rows = self._plans(step, feeds)
        fed_ids = None
        if feeds is not None:
            fed_ids = self._in_flight.fed_ids(step)
            if self.ranks is not None:  # the other ranks' batches lack them
                self.ranks.share_inputs(fed_ids)
        batch = self.runner.batch(plan, feeds and feeds[0], fed_ids)
        if rows is None:
            rows = batch
        if self.offload is not None:
            self.offload.before_step(
                self.block_manager.take_handed_out(), self.scheduler.take_reused_checkpoint_slots()
            )
        logits = self.runner.forward(batch)
        prompt_logprobs = self._score_prompts(step, rows, logits)
        if rows.sample_rows is not None:
            sample_rows = rows.sample_rows
            if sample_rows.device != logits.device:  # data-parallel attention: from the plans
                sample_rows = to_device(sample_rows.tolist(), logits.device)
            logits = logits[sample_rows]
        samplers = [c.request for c in step.chunks if c.samples]
        tokens = sample_requests(logits, samplers, self.config.vocab_size, self.generator)
        logprobs = ScoredTokens.sampled(logits, tokens, samplers)
        self.scheduler.advance(step)
        if self.offload is not None:  # checkpoints this step writes, copied out after it
            self.offload.store_states(self.scheduler.take_pending_state_stores(), self.kv_cache)
        rows = {id(r): row for row, r in enumerate(samplers)}
        return _Launched(step, tokens, rows, logprobs, prompt_logprobs)

    def _speculative_step(self, step: SchedulerStep) -> list[RequestOutput]:
        """A step with speculative decoding, start to end: the forward (each decoding request
        feeds its last token and drafts), verification, the commit of each request's accepted
        run, then the drafts for the next step of every request that sampled and runs on."""
        batch = self.runner.batch(self._plan(step.chunks))
        logits = self.runner.forward(batch)
        prompt_logprobs = self._score_prompts(step, batch, logits)
        if batch.sample_rows is not None:
            logits = logits[batch.sample_rows]
        samplers = [chunk for chunk in step.chunks if chunk.samples]
        verified, scores = self.speculative.verify(logits, samplers)
        self.scheduler.advance(step)
        runs = verified.runs()  # the step's one wait for the device
        self.speculative.record(samplers, runs)
        self._store_prompt_logprobs(prompt_logprobs)
        logprobs = {}
        for i, scored in scores:
            width = samplers[i].num_drafts + 1
            logprobs[i] = scored.to_host(verified.tokens[i, :width].tolist())
        index = {id(chunk.request): i for i, chunk in enumerate(samplers)}
        outputs: list[RequestOutput] = []
        for request, taken in self.scheduler.commit_verified(step, runs):
            i = index[id(request)]
            output = self._output(request, runs[i][:taken])
            if i in logprobs:
                output.logprobs = logprobs[i][:taken]
            self._deliver(request, output, outputs)
        self._roll_back(samplers, runs)
        accepted = {id(chunk.request): len(run) - 1 for chunk, run in zip(samplers, runs,
                                                                        strict=True)}  # fmt: skip
        inputs = DraftInputs.of(step.chunks, batch, accepted)
        if inputs.requests:  # (a drafter with a cache fills it for prompt chunks too)
            self.speculative.drafter.propose(inputs).assign(inputs.drafted)
        return outputs

    def _roll_back(self, samplers: list[ScheduledChunk], runs: list[list[int]]) -> None:
        """Recurrent state of each running sequence that had drafts rejected goes back to
        before its drafts (kept aside by the step: `ScheduledChunk.rollback`)."""
        pairs = [(chunk.rollback[1], chunk.request.slot)
                 for chunk, run in zip(samplers, runs, strict=True)
                 if chunk.rollback is not None and len(run) - 1 < chunk.num_drafts
                 and chunk.request.status is RequestStatus.RUNNING]  # fmt: skip
        if pairs:
            device = self.runner.device
            sources, targets = (to_device(list(s), device) for s in zip(*pairs, strict=True))
            self.kv_cache.copy_states(sources, targets)

    def _store_prompt_logprobs(
        self, scored: list[tuple[Request, int, list[int], ScoredTokens]]
    ) -> None:
        for request, position, targets, scores in scored:
            if request.prompt_logprobs is not None:  # not yet sent
                for i, entry in enumerate(scores.to_host(targets)):
                    request.prompt_logprobs[position + i] = entry

    def _deliver(
        self, request: Request, output: RequestOutput, outputs: list[RequestOutput]
    ) -> None:
        """Add a request's output of this step (with its prompt's logprobs, the first time);
        forget the request once it finished."""
        if request.prompt_logprobs is not None:  # its first token: the prompt is scored
            output.prompt_logprobs = [request.prompt_logprobs[p]
                                      for p in sorted(request.prompt_logprobs)]  # fmt: skip
            request.prompt_logprobs = None
        outputs.append(output)
        if request.finished:
            self.requests.pop(request.request_id, None)

    @staticmethod
    def _score_prompts(
        step: SchedulerStep, batch: ForwardBatch | LogitsRows, logits: torch.Tensor
    ) -> list[tuple[Request, int, list[int], ScoredTokens]]:
        """Each prompt-logprobs chunk's rows score the prompt tokens after them."""
        scored = []
        for chunk, first_row in zip(step.chunks, batch.chunk_logits_cpu, strict=True):
            if first_row is None:
                continue
            request = chunk.request
            start = request.num_computed_tokens
            end = min(start + chunk.num_tokens, request.num_prompt_tokens - 1)
            targets = request.token_ids[start + 1 : end + 1]
            rows = torch.arange(first_row, first_row + len(targets), device=logits.device)
            count = request.params.prompt_logprobs or 0
            target_ids = to_device(targets, logits.device)
            scores = ScoredTokens.of(logits, rows, target_ids, [count] * len(targets))
            scored.append((request, start + 1, targets, scores))
        return scored

    def _commit(self, launched: _Launched) -> list[RequestOutput]:
        """Bring a launched step's tokens to the host (the step's one device-to-host copy) and
        report them."""
        token_ids = launched.token_ids()
        logprobs = {}
        if launched.logprobs is not None:
            rows, scores = launched.logprobs
            logprobs = dict(zip(rows, scores.to_host([token_ids[r] for r in rows]), strict=True))
        self._store_prompt_logprobs(launched.prompt_logprobs)
        outputs: list[RequestOutput] = []
        for request in self.scheduler.commit(launched.step, token_ids):
            row = launched.rows[id(request)]
            output = self._output(request, [token_ids[row]])
            if row in logprobs:
                output.logprobs = [logprobs[row]]
            self._deliver(request, output, outputs)
        if self.offload is not None:
            # After this step's forward on the GPU; before the next step reuses the blocks.
            self.offload.store(self.scheduler.take_pending_stores(), self.kv_cache)
        return outputs

    def _plans(
        self, step: SchedulerStep, feeds: list[Feed] | None = None
    ) -> tuple[StepPlan, LogitsRows | None]:
        """Rank 0's plan for the step, and what the rows of the logits its forward returns are
        when they are not its own batch's (data-parallel attention: every rank's rows in rank
        order). With parallel ranks the plans go to the others first (`feeds`: each rank's
        rows whose ids the step in flight samples, which follow by broadcast)."""
        if self.data_parallel_size == 1:
            plan = self._plan(step.chunks)
            if self.ranks is not None:
                self.ranks.run(plan, feeds and feeds[0])
            return plan, None
        parts = [self._plan(part.chunks) for part in step.parts]
        plans = rank_plans(parts, self.kv_cache.num_blocks - 1, self.runner.graphs)
        self.ranks.run_each(plans[1:], feeds and feeds[1:])
        return plans[0], LogitsRows.of(parts)

    @staticmethod
    def _plan(step_chunks: list[ScheduledChunk]) -> StepPlan:
        chunks, starts = [], []
        for chunk in step_chunks:
            request, drafts = chunk.request, chunk.num_drafts
            start = request.num_computed_tokens
            end = start + chunk.num_tokens - drafts
            chunks.append(request.token_ids[start:end] + request.draft_token_ids[:drafts])
            starts.append(start)
        return StepPlan(
            token_chunks=chunks,
            start_positions=starts,
            block_tables=[c.request.block_ids for c in step_chunks],
            sample_mask=[c.samples for c in step_chunks],
            every_row=[
                c.request.prompt_logprobs is not None
                and c.request.num_computed_tokens < c.request.num_prompt_tokens - 1
                for c in step_chunks
            ],
            state_slots=[c.request.slot for c in step_chunks],
            state_restore=[c.restore_from for c in step_chunks],
            state_snapshot=[c.rollback or (c.snapshot and c.snapshot[:2]) for c in step_chunks],
            num_drafts=[c.num_drafts for c in step_chunks]
            if any(c.num_drafts for c in step_chunks)
            else [],
        )

    def stats(self) -> EngineStats:
        """The engine's state now; the tokens of the steps launched since the last call."""
        counters = self.scheduler.counters
        step_tokens, self._step_tokens = self._step_tokens, []
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.scheduler.kv_usage,
            prefix_cache_queries=counters.prefix_queries,
            prefix_cache_hits=counters.prefix_hits,
            prefix_cache_hits_host=counters.prefix_hits_host,
            num_preemptions=counters.preemptions,
            step_tokens=step_tokens,
            spec_decode=None if self.speculative is None else self.speculative.snapshot(),
        )

    @staticmethod
    def _output(request: Request, new_token_ids: list[int]) -> RequestOutput:
        now = time.time()
        if new_token_ids and request.first_token_time is None:
            request.first_token_time = now
        timing = None
        if request.finished and request.first_scheduled_time is not None:
            scheduled = request.first_scheduled_time
            first = request.first_token_time if request.first_token_time is not None else now
            timing = RequestTiming(
                queue=max(scheduled - request.arrival_time, 0.0),
                prefill=max(first - scheduled, 0.0),
                decode=max(now - first, 0.0),
                inference=max(now - scheduled, 0.0),
                num_preemptions=request.num_preemptions,
            )
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            finish_reason=request.finish_reason,
            stop_token_id=request.stop_token_id,
            error=request.error,
            timing=timing,
        )


def _start_precompile(
    args: EngineArgs, line: ModelLine, context: ModelContext, imports: threading.Thread | None
) -> Precompile | None:
    """Start compiling what the engine's steps will launch (`kernels/precompile.py`); None for
    a line with nothing to compile, or whose plan could not be made (the steps then compile
    what they launch, as without a plan: logged, not fatal)."""
    buckets = () if args.enforce_eager else graph_buckets(args.max_num_seqs)
    bounds = StepBounds(args.block_size, args.max_num_batched_tokens, args.max_num_seqs, buckets,
                        args.decode_attention_tensor_cores, args.small_batch_gemv)  # fmt: skip
    try:
        plan = line.kernel_plan(context, bounds)
    except Exception:
        logger.warning("no kernel plan: the steps compile what they launch", exc_info=True)
        return None
    if max(context.parallel.world_size, context.data_parallel.world_size) > 1:
        # A model whose forward exchanges tensors between ranks cannot run it alone on the
        # meta device (its collectives would reach the other ranks): attention modules only.
        plan = KernelPlan(None, plan.attention)
    if plan.launches is None and plan.attention is None:
        return None
    # What the plan depends on besides the code (`plan_store`).
    ranks = [(group.rank, group.world_size) for group in (context.parallel, context.data_parallel)]
    inputs = repr((line.name, json.dumps(context.config, sort_keys=True), str(context.dtype),
                   ranks, context.expert_parallel, bounds))  # fmt: skip
    return Precompile.start(plan, bounds, context.device, inputs, imports)


def _import_in_background(modules: tuple[str, ...], startup: StartupLog) -> threading.Thread:
    """Import `modules` in order on a thread of its own (an import of one elsewhere meanwhile
    waits for this one: the import lock), each marked in the start-up log when done; a failure
    is left to the later import that needs the module to raise."""

    def run() -> None:
        for module in modules:
            with contextlib.suppress(ImportError):
                importlib.import_module(module)
                startup.mark(f"{module} imported (on a thread)")

    thread = threading.Thread(target=run, name="pegainfer-imports", daemon=True)
    thread.start()
    return thread


def _check_forward(line: ModelLine, runner: ModelRunner, block_size: int, states: bool) -> None:
    """One eager forward of a two-token sequence on the new cache, checked against the
    contract (`Model.forward`: float32 logits of the sampled rows, here the last, over the
    vocabulary), so a line that breaks it is refused by name when it loads instead of being
    served. It writes only what a later sequence's prefill overwrites (its blocks, slot 0)."""
    table = list(range(-(-2 // block_size)))  # two blocks when a block holds one token
    batch = ForwardBatch.build([[0, 0]], [0], [table], [True], block_size, runner.device,
                               state_slots=[0] if states else None)  # fmt: skip
    with torch.inference_mode():
        logits = runner.forward(batch)
    expected = (1, runner.model.vocab_size)
    if tuple(logits.shape) != expected or logits.dtype != torch.float32:
        raise ModelLineError(
            f"the {line.name!r} model line's forward returned {logits.dtype} logits of shape "
            f"{tuple(logits.shape)}; the contract is float32 logits of shape {expected} (one "
            "row per sampled row of the batch, batch.logits_indices, over the vocabulary)"
        )
