"""Continuous batching under a token budget, with chunked prefill and recompute preemption.

Each step the scheduler first serves running requests in admission order (a decode costs one
token; a request still prefilling gets its next chunk), then admits waiting requests while
budget, sequence slots and blocks last. A prompt's leading full blocks that are already cached
are reused instead of recomputed. When blocks run out, the most recently admitted request is
preempted: its blocks go back and it later recomputes (mostly from the prefix cache).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pegainfer.core.engine.request import Request, RequestStatus
from pegainfer.core.kv.block_manager import BlockManager
from pegainfer.core.kv.kv_offload import OffloadBackend
from pegainfer.core.kv.state_checkpoints import StateCheckpoints
from pegainfer.core.sampling.structured_output import consume_tokens


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    #: Checkpoints of recurrent state kept for prefix-cache hits (models with state slots).
    num_state_checkpoints: int = 0
    #: Speculative decoding's k: a decoding request feeds its drafts (up to k) after its last
    #: token, and a sampling chunk's blocks leave room for k positions more, where the
    #: drafter writes while proposing the next step's drafts.
    num_speculative_tokens: int = 0
    #: Speculative decoding with recurrent state: the first of the slots (one per sequence
    #: slot) where a verify step keeps each sequence's state as it was before its drafts, to
    #: roll back to when some are rejected (None: no recurrent state).
    rollback_slots: int | None = None


@dataclass
class ScheduledChunk:
    """`num_tokens` of `request` computed this step; `samples` when they reach its last token.
    Speculative decoding: the last `num_drafts` of them are its drafts, each sampling row
    verified (the chunk samples 1 + num_drafts rows)."""

    request: Request
    num_tokens: int
    samples: bool
    num_drafts: int = 0
    #: Recurrent models: the checkpoint slot the sequence's state starts from (a prefix hit).
    restore_from: int | None = None
    #: Recurrent models with drafts: (tokens into this chunk, slot) where the state before the
    #: drafts is kept, restored when a draft is rejected.
    rollback: tuple[int, int] | None = None
    #: Recurrent models: (tokens into this chunk, checkpoint slot, block hash) where the state
    #: is to be checkpointed for later prompts.
    snapshot: tuple[int, int, bytes] | None = None


@dataclass
class SchedulerStep:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    #: Requests admitted with blocks (and, for recurrent models, a state checkpoint) to copy
    #: back from the host tier: (prefix hash, device block) and (prefix hash, checkpoint slot)
    #: pairs. They compute in a later step, once the copies have landed, or, when nothing
    #: else runs, in this one, ordered after the copies on the device.
    restores: list[tuple[Request, list[tuple[bytes, int]], list[tuple[bytes, int]]]] = field(
        default_factory=list
    )
    #: With data-parallel attention, each rank's own step (`chunks` is theirs in rank order).
    parts: list[SchedulerStep] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass
class _PrefixHit:
    """What an admitted request reuses: cached device blocks, then the host tier's blocks
    (their hashes, and the fresh device blocks they are copied into); for recurrent models, the
    checkpoint slot its state restarts from and, when that checkpoint comes from the host tier,
    (its key, the slot) to copy it into."""

    blocks: list[int] = field(default_factory=list)
    host: list[bytes] = field(default_factory=list)
    host_blocks: list[int] = field(default_factory=list)
    restore_from: int | None = None
    state_load: tuple[bytes, int] | None = None


@dataclass
class SchedulerCounters:
    """Cumulative counts for metrics. Prefix-cache figures are in tokens, counted once per
    request at its first admission (retries and recomputes after preemption do not count)."""

    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_hits_host: int = 0  # of prefix_hits, restored from the host tier
    preemptions: int = 0


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        offload: OffloadBackend | None = None,
    ) -> None:
        self.config = config
        self.blocks = block_manager
        self.block_size = block_manager.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.counters = SchedulerCounters()
        # One state slot per running sequence; at most max_num_seqs run, so one is always free.
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        # The host tier: sealed blocks are stored there, prefixes that left the device come back.
        self.offload = offload
        self.pending_stores: list[tuple[bytes, int]] = []
        self.pending_state_stores: list[tuple[bytes, int]] = []
        self.checkpoints: StateCheckpoints | None = None
        if config.num_state_checkpoints and block_manager.enable_prefix_caching:
            self.checkpoints = StateCheckpoints(config.num_state_checkpoints, config.max_num_seqs)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def kv_usage(self) -> float:
        """The fraction of KV blocks in use."""
        return self.blocks.usage

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Drop a request wherever it is and free its blocks; None if it is not here."""
        for queue in (self.running, self.waiting):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self._finish(request, "abort")
                    return request
        return None

    def schedule(self) -> SchedulerStep:
        step = SchedulerStep()
        budget = self.config.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.restore is not None:
                if not self.offload.ready(request.restore):
                    i += 1  # its blocks are still arriving from the host tier
                    continue
                request.restore = None
            # A request whose pending tokens reach its length limit has nothing left to run.
            capped = request.num_pending and request.at_limit(self.config.max_model_len)
            num_new = 0 if capped else self._chunk_size(request, budget)
            if num_new == 0:
                i += 1
                continue
            num_drafts = self._num_drafts(request, num_new, budget)
            num_new += num_drafts
            while not self._allocate(request, num_new, self._lookahead(request, num_new)):
                victim = self.running.pop()
                self._preempt(victim)
                step.preempted.append(victim)
                if victim is request:
                    break
            else:
                step.chunks.append(self._chunk(request, num_new, num_drafts))
                budget -= num_new
                i += 1

        while (
            self.waiting
            and not step.preempted
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            if self._prefill_in_flight_covers(request):
                break  # next step its prompt blocks are cached: it computes only the rest
            hit = self._match_prefix(request)  # its blocks are held from here on
            restores = list(zip(hit.host, hit.host_blocks, strict=True))
            request.block_ids = [*hit.blocks, *hit.host_blocks]
            request.num_sealed_blocks = len(request.block_ids)
            request.num_computed_tokens = len(request.block_ids) * self.block_size
            num_new = self._chunk_size(request, budget)
            lookahead = self._lookahead(request, num_new)
            if num_new == 0 or not self._allocate(request, num_new, lookahead):
                self.blocks.release(request.block_ids)
                if hit.state_load is not None:
                    self.checkpoints.cancel(*hit.state_load)
                self._reset(request)
                break
            self.waiting.popleft()
            for index in range(len(hit.blocks), len(hit.blocks) + len(restores)):
                self._seal(request, index)  # a restored block is cached on the device again
            request.state_source = hit.restore_from
            if hit.restore_from is not None:  # kept from eviction until its step launches
                self.checkpoints.hold(hit.restore_from)
            request.loaded_checkpoint = hit.state_load
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = request.num_computed_tokens
                request.first_scheduled_time = time.time()
                self.counters.prefix_queries += request.num_tokens
                self.counters.prefix_hits += request.num_computed_tokens
                self.counters.prefix_hits_host += len(restores) * self.block_size
            request.status = RequestStatus.RUNNING
            request.slot = self._free_slots.pop()
            self.running.append(request)
            if restores or hit.state_load:
                states = [hit.state_load] if hit.state_load else []
                step.restores.append((request, restores, states))
                if step.chunks or len(self.running) > 1 or self.waiting:
                    continue  # it waits for its copies while the others run
                # Alone: its step runs after the copies on the device (the engine orders it),
                # so the host prepares and launches the step while the copies land.
            step.chunks.append(self._chunk(request, num_new))
            budget -= num_new
        # One-token chunks (decodes) first: attention runs them apart from the prefill rows.
        step.chunks.sort(key=lambda chunk: chunk.num_tokens != 1)
        return step

    def update(self, step: SchedulerStep, sampled: Iterable[int]) -> list[Request]:
        """Advance every scheduled request; return those that got a token or finished."""
        self.advance(step)
        return self.commit(step, sampled)

    def _num_drafts(self, request: Request, num_new: int, budget: int) -> int:
        """How many of its drafts a request feeds after its last token: those the budget
        holds, and no more than could be kept (max_tokens, the context)."""
        if (
            not request.draft_token_ids
            or request.num_computed_tokens + num_new != request.num_tokens
        ):
            return 0
        room = min(
            request.max_tokens - request.num_output_tokens,
            self.config.max_model_len - request.num_tokens + 1,
        )
        return max(0, min(len(request.draft_token_ids), budget - num_new, room - 1))

    def _lookahead(self, request: Request, num_new: int) -> int:
        """Positions past the chunk its blocks must hold: a sampling chunk's drafter writes k
        (speculative decoding)."""
        k = self.config.num_speculative_tokens
        samples = request.num_computed_tokens + num_new >= request.num_tokens
        return k if k and samples else 0

    def advance(self, step: SchedulerStep) -> None:
        """The step was launched: its tokens count as computed and each sampling request has a
        pending token, so the next step can be scheduled before the ids reach the host."""
        for chunk in step.chunks:
            chunk.request.num_computed_tokens += chunk.num_tokens
            if chunk.restore_from is not None:
                self.checkpoints.release(chunk.restore_from)
                self._publish_loaded_checkpoint(chunk.request)
            if chunk.snapshot is not None and self.checkpoints is not None:
                _, slot, block_hash = chunk.snapshot
                self.checkpoints.publish(block_hash, slot)
                if self.offload is not None:
                    self.pending_state_stores.append((block_hash, slot))
            if chunk.samples:
                chunk.request.reserve_token()

    def commit(self, step: SchedulerStep, sampled: Iterable[int]) -> list[Request]:
        """The step's sampled ids arrived (one per sampling chunk): record them, finish the
        requests they end; return the requests that got a token. A request aborted or finished
        while the step was in flight drops its token."""
        sampled = list(sampled)
        if any(chunk.request.grammar is not None for chunk in step.chunks):
            self._advance_grammars(step, sampled)
        runs = self._commit_runs(step, [[t] for t in sampled], consume=False)
        return [request for request, _ in runs]

    def commit_verified(
        self, step: SchedulerStep, runs: list[list[int]]
    ) -> list[tuple[Request, int]]:
        """A speculative step's tokens arrived: per sampling chunk, its accepted drafts and the
        token after them. The rejected drafts' KV is dropped (their positions are computed
        again), the tokens committed until one ends the request, each consumed by the
        request's grammar first; returns the requests that got tokens, with how many they
        kept."""
        return self._commit_runs(step, runs, consume=True)

    def _commit_runs(
        self, step: SchedulerStep, runs: list[list[int]], consume: bool
    ) -> list[tuple[Request, int]]:
        """`consume`: grammars consume each token as it is committed (else they did already)."""
        tokens = iter(runs)
        touched: list[tuple[Request, int]] = []
        for chunk in step.chunks:
            request = chunk.request
            run = next(tokens) if chunk.samples else None
            if request.status is RequestStatus.FINISHED:
                continue
            if run is not None:
                rejected = chunk.num_drafts - (len(run) - 1)
                # Recurrent state goes back to before the drafts (the engine restores it): the
                # accepted ones are computed again with the token after them.
                rolled_back = chunk.rollback is not None and rejected > 0
                request.num_computed_tokens -= chunk.num_drafts if rolled_back else rejected
                taken = request.commit_tokens(run, self.config.max_model_len, consume)
                touched.append((request, taken))
            if request.status is RequestStatus.RUNNING:
                self._seal_full_blocks(request)
            if request.finish_reason is not None:
                queue = self.running if request.status is RequestStatus.RUNNING else self.waiting
                queue.remove(request)
                self._finish(request, request.finish_reason)
        return touched

    @staticmethod
    def _advance_grammars(step: SchedulerStep, sampled: list[int]) -> None:
        """The step's grammars consume their sampled tokens together, in parallel, before
        each request's token is committed (which asks its grammar whether it is done)."""
        samplers = [chunk.request for chunk in step.chunks if chunk.samples]
        consume_tokens([(r.grammar, token) for r, token in zip(samplers, sampled, strict=True)
                        if r.grammar is not None
                        and r.status is not RequestStatus.FINISHED])  # fmt: skip

    def _chunk_size(self, request: Request, budget: int) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining <= budget:
            return remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _chunk(self, request: Request, num_new: int, num_drafts: int = 0) -> ScheduledChunk:
        start = request.num_computed_tokens
        samples = start + num_new - num_drafts == request.num_tokens
        chunk = ScheduledChunk(request, num_new, samples, num_drafts)
        chunk.restore_from, request.state_source = request.state_source, None
        if num_drafts and self.config.rollback_slots is not None:
            chunk.rollback = (num_new - num_drafts, self.config.rollback_slots + request.slot)
        elif self.checkpoints is not None:
            # Checkpoint the state where the last full block before the final token ends: the
            # longest prefix a later prompt (the next turn of a chat) can reuse.
            boundary = (request.num_tokens - 1) // self.block_size * self.block_size
            # (After a speculative rollback the block may not be hashed yet: no checkpoint.)
            hashed = boundary // self.block_size <= len(request.block_hashes)
            if start < boundary <= start + num_new and hashed:
                block_hash = request.block_hashes[boundary // self.block_size - 1]
                slot = self.checkpoints.reserve(block_hash)
                if slot is not None:
                    chunk.snapshot = (boundary - start, slot, block_hash)
        return chunk

    def _prefill_in_flight_covers(self, request: Request) -> bool:
        """Whether a running request is still computing blocks this one would reuse beyond
        what the cache holds now (the n choices of one prompt, identical prompts sent together):
        waiting until they are sealed turns that prefill into a prefix hit."""
        if not self.blocks.enable_prefix_caching or request.prompt_logprobs is not None:
            return False
        self.blocks.extend_block_hashes(request.token_ids, request.block_hashes, request.cache_salt)
        reusable = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
        cached = len(self.blocks.match_prefix(reusable, len(reusable)))
        for other in self.running:  # its blocks count once sealed (cached), not when launched
            shared = 0
            for mine, theirs in zip(reusable, other.block_hashes, strict=False):
                if mine != theirs:
                    break
                shared += 1
            if shared > cached:
                return True
        return False

    def _match_prefix(self, request: Request) -> _PrefixHit:
        """The cached blocks the request reuses, acquired: on the device, then in the host tier
        (fresh device blocks to copy them into). For recurrent models the reused prefix must
        end where a state checkpoint exists (on the device, or in the host tier: a device slot
        is then reserved to bring it back)."""
        self.blocks.extend_block_hashes(request.token_ids, request.block_hashes, request.cache_salt)
        if request.prompt_logprobs is not None:  # every prompt position's logits are needed
            return _PrefixHit()
        # Leave at least one token to compute: its logits give the next token.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes
        device = self.blocks.match_prefix(hashes, max_blocks)
        host: list[bytes] = []
        slot: int | None = None
        state_load: tuple[bytes, int] | None = None
        if self.offload is not None:
            for block_hash in hashes[len(device) : max_blocks]:
                if not self.offload.contains(block_hash):
                    break
                host.append(block_hash)
        if self.checkpoints is not None:
            for blocks in range(len(device) + len(host), 0, -1):
                key = hashes[blocks - 1]
                slot, state_load = self.checkpoints.get(key), None
                if slot is None and self.offload is not None and self.offload.contains_state(key):
                    slot = self.checkpoints.reserve(key)
                    state_load = None if slot is None else (key, slot)
                if slot is not None:
                    device, host = device[:blocks], host[: max(blocks - len(device), 0)]
                    break
            else:
                return _PrefixHit()
        # Taken before allocating, which may evict unreferenced cached blocks.
        self.blocks.acquire(device)
        host_blocks = self.blocks.allocate(len(host)) if host else []
        if host_blocks is None:  # the pool is short: no restore from the host tier
            if self.checkpoints is None:
                return _PrefixHit(device)
            # A device-only hit might not end at a checkpoint: compute it all.
            self.blocks.release(device)
            if state_load is not None:
                self.checkpoints.cancel(*state_load)
            return _PrefixHit()
        if self.checkpoints is None:
            return _PrefixHit(device, host, host_blocks)
        return _PrefixHit(device, host, host_blocks, slot, state_load)

    def take_pending_state_stores(self) -> list[tuple[bytes, int]]:
        """Checkpoints published by the step just launched, for the host tier (stored after
        that step, before a later step writes their slots)."""
        stores, self.pending_state_stores = self.pending_state_stores, []
        return stores

    def take_reused_checkpoint_slots(self) -> list[int]:
        return [] if self.checkpoints is None else self.checkpoints.take_handed_out()

    def _publish_loaded_checkpoint(self, request: Request) -> None:
        """A checkpoint brought back from the host tier for this request is in its slot (or
        will be before any later GPU work): other prompts may restore from it too."""
        if request.loaded_checkpoint is not None:
            self.checkpoints.publish(*request.loaded_checkpoint)
            request.loaded_checkpoint = None

    def take_pending_stores(self) -> list[tuple[bytes, int]]:
        """Blocks sealed since the last call, for the host tier (a full block is stored once
        its step ran, before its device block can be reused)."""
        stores, self.pending_stores = self.pending_stores, []
        return stores

    def _allocate(self, request: Request, num_new: int, lookahead: int = 0) -> bool:
        total = request.num_computed_tokens + num_new + lookahead
        needed = -(-total // self.block_size) - len(request.block_ids)
        if needed <= 0:
            return True
        fresh = self.blocks.allocate(needed)
        if fresh is None:
            return False
        request.block_ids.extend(fresh)
        return True

    def _seal_full_blocks(self, request: Request) -> None:
        """Publish blocks whose every token now has KV, so later prompts can reuse them."""
        if not self.blocks.hash_blocks:
            return
        known = min(request.num_computed_tokens, request.num_known_tokens)
        num_full = known // self.block_size
        if num_full <= request.num_sealed_blocks:
            return
        ids = request.token_ids
        if request.num_pending:
            ids = ids[: request.num_known_tokens]
        self.blocks.extend_block_hashes(ids, request.block_hashes, request.cache_salt)
        for index in range(request.num_sealed_blocks, num_full):
            self._seal(request, index)
            if self.offload is not None:
                self.pending_stores.append((request.block_hashes[index], request.block_ids[index]))
        request.num_sealed_blocks = num_full

    def _seal(self, request: Request, index: int) -> None:
        """Seal the request's `index`-th block (full and computed) into the prefix cache."""
        bs = self.block_size
        self.blocks.seal(
            request.block_ids[index],
            request.block_hashes[index],
            request.block_hashes[index - 1] if index else None,
            request.token_ids[index * bs : (index + 1) * bs],
        )

    def _settle_restore(self, request: Request) -> None:
        """A request leaving while its blocks arrive: later GPU work waits for the copies, so
        the blocks can be handed out again at once."""
        if request.restore is not None:
            self.offload.wait(request.restore)
            request.restore = None
        self._publish_loaded_checkpoint(request)
        if request.state_source is not None:
            self.checkpoints.release(request.state_source)
        request.state_source = None

    def _preempt(self, request: Request) -> None:
        self._settle_restore(request)
        self.blocks.release(request.block_ids)
        self._release_slot(request)
        self._reset(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(request)

    def _reset(self, request: Request) -> None:
        request.clear_drafts()
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_sealed_blocks = 0

    def _release_slot(self, request: Request) -> None:
        if request.slot is not None:
            self._free_slots.append(request.slot)
            request.slot = None

    def _finish(self, request: Request, reason: str) -> None:
        self._settle_restore(request)
        self.blocks.release(request.block_ids)
        self._release_slot(request)
        request.block_ids = []
        request.finish_reason = reason
        request.status = RequestStatus.FINISHED
