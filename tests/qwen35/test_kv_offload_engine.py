"""The host tier for Qwen3.5: KV blocks and DeltaNet state checkpoints come back from host
memory, and what follows equals a cold run token for token."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.errors import ConfigError
from tests.engine_harness import (
    both_schedulers,  # noqa: F401 (a fixture)
    drain,
    greedy,
    make_engine,
    submit,
)
from tests.qwen35.hf_reference import VOCAB, write_hf_checkpoint

pytestmark = pytest.mark.usefixtures("both_schedulers")
NEW = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The checkpoint, four prompts of 41-50 tokens, and each one's cold output."""
    path = write_hf_checkpoint(tmp_path_factory.mktemp("qwen35-offload"), tie=True, seed=5)
    g = torch.Generator().manual_seed(1)
    prompts = {name: torch.randint(0, VOCAB, (n,), generator=g).tolist()
               for name, n in (("p", 41), ("q", 37), ("r", 50), ("s", 45))}  # fmt: skip
    cold = make_engine(path, enable_prefix_caching=False)
    for name, tokens in prompts.items():
        submit(cold, name, tokens, greedy(NEW))
    return path, prompts, drain(cold)


def run(engine, name, tokens) -> tuple[list[int], int]:
    """Serve one request alone: its output and its cached prompt tokens."""
    submit(engine, name, tokens, greedy(NEW))
    out = drain(engine)[name]
    return out, engine.scheduler.counters.prefix_hits


def offload_engine(path, **overrides):
    # One device checkpoint; a host tier of 1 MiB (blocks and up to 4 checkpoints).
    args = dict(max_model_len=128, state_checkpoints=1, kv_offload=True, kv_offload_gib=2**-10)
    return make_engine(path, **(args | overrides))


def test_blocks_and_state_come_back_from_the_host(setup):
    """A 40-block device pool holds two prompts at a time: p's blocks and its checkpoint are
    pushed out by the others, and both return from the host tier."""
    path, prompts, cold = setup
    engine = offload_engine(path, num_kv_blocks=40)
    assert engine.offload.state_capacity == 4
    run(engine, "p1", prompts["p"])
    for name in ("q", "r", "s"):
        run(engine, name, prompts[name])
    host_before = engine.scheduler.counters.prefix_hits_host
    hits_before = engine.scheduler.counters.prefix_hits
    out, hits = run(engine, "p2", prompts["p"])
    assert out == cold["p"] and hits - hits_before == 40
    assert engine.scheduler.counters.prefix_hits_host > host_before
    engine.block_manager.check_invariants()


def test_only_the_checkpoint_comes_back_from_the_host(setup):
    """p's blocks stay on the device, but the one device checkpoint slot now holds q's: p's
    state returns from the host tier into a slot of its own."""
    path, prompts, cold = setup
    engine = offload_engine(path, num_kv_blocks=200)
    run(engine, "p1", prompts["p"])
    run(engine, "q", prompts["q"])
    loads, load = [], engine.offload.load
    engine.offload.load = lambda blocks, cache, states=(): (
        loads.append((len(blocks), len(states))) or load(blocks, cache, states)
    )
    hits_before = engine.scheduler.counters.prefix_hits
    out, hits = run(engine, "p2", prompts["p"])
    assert out == cold["p"] and hits - hits_before == 40
    assert loads == [(0, 1)] and engine.scheduler.counters.prefix_hits_host == 0
    # The restored checkpoint is published again: a third turn hits it on the device.
    out, hits_third = run(engine, "p3", prompts["p"])
    assert out == cold["p"] and hits_third - hits == 40 and loads == [(0, 1)]


def test_two_requests_restoring_the_same_state_at_once(setup):
    path, prompts, cold = setup
    engine = offload_engine(path, num_kv_blocks=200)
    run(engine, "p1", prompts["p"])
    run(engine, "q", prompts["q"])
    submit(engine, "a", prompts["p"], greedy(NEW))
    submit(engine, "b", prompts["p"], greedy(NEW))
    assert drain(engine) == {"a": cold["p"], "b": cold["p"]}


def test_offload_needs_state_checkpoints(setup):
    path, _, _ = setup
    with pytest.raises(ConfigError, match="state checkpoints"):
        make_engine(path, kv_offload=True, enable_prefix_caching=False)
