"""Drive `EngineCore` with token-id prompts and collect each request's output tokens."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import pytest
import torch

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.engine.messages import EngineRequest
from pegainfer.core.sampling.sampling_params import SamplingParams

# Engine arguments every test engine gets unless it overrides them; modules that run their
# tests under both schedulers set "async_scheduling" here (see `both_schedulers`).
DEFAULTS: dict[str, object] = {}


def make_engine(path: Path, **overrides) -> EngineCore:
    args = dict(model=str(path), device="cpu", dtype="float32", max_model_len=512, block_size=4)
    return EngineCore(EngineArgs(**(args | DEFAULTS | overrides)))


@contextlib.contextmanager
def closing_engine(args: EngineArgs) -> Iterator[EngineCore]:
    """An engine that is shut down on the way out, whether the block failed or not."""
    engine = EngineCore(args)
    try:
        yield engine
    finally:
        engine.shutdown()


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def both_schedulers(request, monkeypatch):
    """Run a test with the step-by-step scheduler and with async scheduling."""
    monkeypatch.setitem(DEFAULTS, "async_scheduling", request.param)
    return request.param


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def submit(engine: EngineCore, request_id: str, prompt: list[int], params: SamplingParams) -> None:
    engine.add_request(
        EngineRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=params,
            eos_token_ids=[],
            arrival_time=0.0,
        )
    )


def drain(engine: EngineCore, max_steps: int = 100_000) -> dict[str, list[int]]:
    """Step until every request finished; return output tokens by request id."""
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests:
            return tokens
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    raise AssertionError("the engine did not finish its requests")


def generate(
    engine: EngineCore, prompts: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        submit(engine, str(i), prompt, params)
    out = drain(engine)
    return [out[str(i)] for i in range(len(prompts))]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of exactly `n` tokens (EOS ignored): the reference."""
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def check_prefix_hit_equals_cold(path: Path, prompt: list[int], expected: list[int]) -> None:
    """A repeated prompt reuses the first request's blocks (all but the last token's) from the
    device prefix cache and continues as cold (greedy `expected`)."""
    engine = make_engine(path)
    submit(engine, "first", prompt, greedy(len(expected)))
    drain(engine)
    submit(engine, "again", prompt, greedy(len(expected)))
    assert drain(engine) == {"again": expected}
    block = engine.config.block_size
    assert engine.scheduler.counters.prefix_hits == (len(prompt) - 1) // block * block


def check_host_tier_hit_equals_cold(
    path: Path, prompt: list[int], expected: list[int], arenas: frozenset[str]
) -> None:
    """With the device prefix cache off, a repeated prompt's blocks come back from the host
    tier, which holds every one of the model's `arenas`, and it continues as cold."""
    engine = make_engine(path, enable_prefix_caching=False, kv_offload=True,
                         kv_offload_gib=64 * 4096 / 2**30)  # fmt: skip
    assert set(engine.offload.arenas) == arenas
    submit(engine, "first", prompt, greedy(len(expected)))
    drain(engine)
    submit(engine, "again", prompt, greedy(len(expected)))
    assert drain(engine) == {"again": expected}
    block = engine.config.block_size
    assert engine.scheduler.counters.prefix_hits_host == (len(prompt) - 1) // block * block


def reference_batch(
    hf_reference: ModuleType, folder: Path, lengths: tuple[int, ...], new_tokens: int
) -> tuple[Path, list[list[int]], list[list[int]]]:
    """A line's tiny checkpoint (its `hf_reference.write_hf_checkpoint`), random prompts of
    `lengths`, and transformers' greedy continuations of them."""
    path = hf_reference.write_hf_checkpoint(folder, seed=4)
    hf = hf_reference.load_hf(path)
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, hf_reference.VOCAB, (n,), generator=g).tolist() for n in lengths]
    return path, batch, [hf_greedy(hf, p, new_tokens) for p in batch]


class EngineMatchesTransformers:
    """Greedy continuations through the whole engine (scheduler, blocks, sampler) equal
    transformers' `generate`: batched, chunked beside decodes, from the device prefix cache and
    from the host tier. A line's test class sets `HOST_TIER_ARENAS` (what its host tier must
    hold); its module provides the `reference` fixture (`reference_batch`)."""

    HOST_TIER_ARENAS: ClassVar[frozenset[str]]

    def test_greedy_batch_equals_transformers(self, reference):
        path, batch, expected = reference
        assert generate(make_engine(path), batch, greedy(len(expected[0]))) == expected

    def test_chunked_prefill_beside_decodes(self, reference):
        path, batch, expected = reference
        engine = make_engine(path, max_num_batched_tokens=16, enable_chunked_prefill=True)
        assert generate(engine, batch, greedy(len(expected[0]))) == expected

    def test_prefix_cache_hit_equals_cold(self, reference):
        """The second request reuses the first one's blocks of every arena (all but the last
        token's)."""
        path, batch, expected = reference
        check_prefix_hit_equals_cold(path, batch[-1], expected[-1])

    def test_blocks_restored_from_the_host_tier_equal_cold(self, reference):
        """With the device prefix cache off, a repeated prompt's blocks of every arena come
        back from host memory."""
        path, batch, expected = reference
        check_host_tier_hit_equals_cold(path, batch[-1], expected[-1], self.HOST_TIER_ARENAS)
