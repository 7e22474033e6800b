"""The host tier through the engine (Qwen3 on CPU): restored prefixes give cold-run outputs."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.kv.kv_offload import OffloadBackend, Transfer
from tests.engine_harness import (
    both_schedulers,  # noqa: F401 (a fixture)
    drain,
    greedy,
    make_engine,
    submit,
)
from tests.qwen3.hf_reference import VOCAB

pytestmark = pytest.mark.usefixtures("both_schedulers")

BLOCK = 4
NEW = 8


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def setup(hf_checkpoints):
    """The checkpoint, prompts, and each prompt's output from a cold engine."""
    path = hf_checkpoints(False)
    prompts = {name: prompt(n, seed) for seed, (name, n) in enumerate(
        [("p", 41), ("q", 37), ("r", 50), ("s", 45)])}  # fmt: skip
    cold = make_engine(path, enable_prefix_caching=False)
    for name, tokens in prompts.items():
        submit(cold, name, tokens, greedy(NEW))
    return path, prompts, drain(cold)


def offload_engine(path, **overrides):
    # 40 device blocks of 4 tokens (two of the prompts at a time); a host tier of 64 blocks.
    args = dict(num_kv_blocks=40, max_model_len=128, kv_offload=True,
                kv_offload_gib=64 * 4096 / 2**30)  # fmt: skip
    return make_engine(path, **(args | overrides))


def run(engine, name, tokens) -> tuple[list[int], int]:
    """Serve one request alone; its outputs and its cached tokens."""
    submit(engine, name, tokens, greedy(NEW))
    first = engine.step()
    cached = engine.requests[name].num_cached_tokens if name in engine.requests else None
    out = [t for o in first for t in o.new_token_ids] + drain(engine).get(name, [])
    return out, cached


def test_a_prefix_evicted_from_the_device_comes_back_from_the_host(setup):
    path, prompts, cold = setup
    engine = offload_engine(path)
    assert engine.offload.capacity == 64
    run(engine, "p1", prompts["p"])
    for name in ("q", "r", "s"):  # push p's blocks out of the 40-block device pool
        run(engine, name, prompts[name])
    hits_before = engine.scheduler.counters.prefix_hits_host
    out, cached = run(engine, "p2", prompts["p"])
    assert out == cold["p"]
    assert cached == 40 and engine.scheduler.counters.prefix_hits_host - hits_before > 0
    assert len(engine.offload) <= engine.offload.capacity
    engine.block_manager.check_invariants()


def test_host_tier_alone_with_the_device_cache_off(setup):
    path, prompts, cold = setup
    engine = offload_engine(path, enable_prefix_caching=False)
    run(engine, "p1", prompts["p"])
    out, cached = run(engine, "p2", prompts["p"])
    assert out == cold["p"] and cached == 40
    assert engine.scheduler.counters.prefix_hits_host == 40


def test_two_requests_restoring_the_same_prefix_at_once(setup):
    path, prompts, cold = setup
    engine = offload_engine(path, enable_prefix_caching=False)
    run(engine, "p1", prompts["p"])
    submit(engine, "a", prompts["p"], greedy(NEW))
    submit(engine, "b", prompts["p"], greedy(NEW))
    assert drain(engine) == {"a": cold["p"], "b": cold["p"]}
    assert engine.scheduler.counters.prefix_hits_host == 2 * 40


def test_a_restore_racing_an_eviction_of_its_host_blocks(setup):
    """A host tier that holds one prompt: p's blocks are restored in the step whose new blocks
    (r's) evict them from the tier; the restore still reads p's blocks."""
    path, prompts, cold = setup
    engine = offload_engine(path, enable_prefix_caching=False, kv_offload_gib=12 * 4096 / 2**30)
    run(engine, "p1", prompts["p"])
    submit(engine, "p2", prompts["p"], greedy(NEW))
    submit(engine, "r", prompts["r"], greedy(NEW))
    out = drain(engine)
    assert out == {"p2": cold["p"], "r": cold["r"]}
    assert engine.scheduler.counters.prefix_hits_host > 0
    assert len(engine.offload) <= 12


class SlowLoads(OffloadBackend):
    """The engine's host tier, except that a load lands only after `delay` polls."""

    def __init__(self, inner: OffloadBackend, delay: int) -> None:
        self.inner, self.delay, self.polls = inner, delay, {}

    def contains(self, block_hash):
        return self.inner.contains(block_hash)

    def store(self, blocks, cache):
        self.inner.store(blocks, cache)

    def contains_state(self, block_hash):
        return self.inner.contains_state(block_hash)

    def store_states(self, checkpoints, cache):
        self.inner.store_states(checkpoints, cache)

    def load(self, blocks, cache, states=()):
        return self.inner.load(blocks, cache, states)

    def ready(self, transfer):
        self.polls[id(transfer)] = self.polls.get(id(transfer), 0) + 1
        return self.polls[id(transfer)] > self.delay and self.inner.ready(transfer)

    def wait(self, transfer):
        self.inner.wait(transfer)

    def evict(self, block_hash):
        self.inner.evict(block_hash)

    def before_step(self, reused_blocks, reused_slots=()):
        self.inner.before_step(reused_blocks, reused_slots)


class DeferredLoads(SlowLoads):
    """As on a GPU: a load's copy happens only when it lands (the `delay`-th poll, or a wait
    ordering later work after it); until then its target blocks hold garbage."""

    def __init__(self, inner: OffloadBackend, delay: int) -> None:
        super().__init__(inner, delay)
        self.pending = {}

    def load(self, blocks, cache, states=()):
        for name in cache.arenas:
            for _, block in blocks:
                cache[name][:, block].fill_(1e3)
        transfer = Transfer()
        self.pending[id(transfer)] = (blocks, cache, states)
        return transfer

    def _land(self, transfer) -> None:
        if (pending := self.pending.pop(id(transfer), None)) is not None:
            self.inner.load(*pending)

    def ready(self, transfer):
        if super().ready(transfer):
            self._land(transfer)
            return True
        return False

    def wait(self, transfer):
        self._land(transfer)


def slow(engine, delay: int, backend: type[SlowLoads] = SlowLoads) -> None:
    engine.offload = engine.scheduler.offload = backend(engine.offload, delay)


def test_other_requests_run_while_a_restore_is_in_flight(setup):
    path, prompts, cold = setup
    engine = offload_engine(path, enable_prefix_caching=False)
    run(engine, "p1", prompts["p"])
    slow(engine, delay=4)
    submit(engine, "restoring", prompts["p"], greedy(NEW))
    submit(engine, "fresh", prompts["q"], greedy(NEW))
    order, outputs = [], {}
    while engine.has_unfinished_requests:
        for output in engine.step():
            order.append(output.request_id)
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert outputs == {"restoring": cold["p"], "fresh": cold["q"]}
    assert order.index("fresh") < order.index("restoring")  # nobody waited for the copy
    assert engine.scheduler.counters.prefix_hits_host == 40


def test_a_lone_restore_computes_in_its_first_step_after_the_copy(setup):
    """Nothing else to run: the step is launched at once, ordered after the copy on the device
    (the host never polls the load)."""
    path, prompts, cold = setup
    engine = offload_engine(path, enable_prefix_caching=False)
    run(engine, "p1", prompts["p"])
    slow(engine, delay=100)
    out, cached = run(engine, "alone", prompts["p"])
    assert out == cold["p"] and cached == 40
    assert engine.offload.polls == {}


def test_abort_while_the_blocks_are_arriving(setup):
    path, prompts, cold = setup
    engine = offload_engine(path, enable_prefix_caching=False)
    run(engine, "p1", prompts["p"])
    slow(engine, delay=100)
    submit(engine, "restoring", prompts["p"], greedy(NEW))
    submit(engine, "other", prompts["r"], greedy(NEW))  # not alone: it polls for its copy
    other = [t for _ in range(2) for o in engine.step() if o.request_id == "other"
             for t in o.new_token_ids]  # fmt: skip
    assert engine.offload.polls
    engine.abort(["restoring"])
    assert other + drain(engine)["other"] == cold["r"]
    assert run(engine, "after", prompts["r"])[0] == cold["r"]
    assert engine.block_manager.usage == 0.0
    engine.block_manager.check_invariants()


def test_a_prompt_hitting_blocks_still_being_restored_waits_for_their_copy(setup):
    """Two prompts with p's prefix arrive together while p's blocks are only in the host tier:
    the first restores them (and they join the device prefix cache at once), the second hits
    them there; its step must run after the copy lands."""
    path, prompts, cold = setup
    engine = offload_engine(path)
    run(engine, "p1", prompts["p"])
    for name in ("q", "r", "s"):  # push p's blocks out of the 40-block device pool
        run(engine, name, prompts[name])
    slow(engine, delay=3, backend=DeferredLoads)
    submit(engine, "a", prompts["p"], greedy(NEW))
    submit(engine, "b", prompts["p"], greedy(NEW))
    assert drain(engine) == {"a": cold["p"], "b": cold["p"]}
    counters = engine.scheduler.counters
    assert counters.prefix_hits_host > 0 and counters.prefix_hits >= 2 * 40  # b hit a's blocks
