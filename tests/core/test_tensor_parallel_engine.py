"""An engine with two tensor-parallel ranks (CPU, gloo) generates what one process does, and
a worker that dies fails the engine with a clear error instead of hanging it."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.errors import ConfigError
from pegainfer.core.tensor_parallel import RankFailedError
from tests.engine_harness import drain, generate, greedy, make_engine, submit
from tests.qwen3.hf_reference import VOCAB, write_hf_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("tp-engine"), tie=False)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 17, 40)]


def test_two_ranks_generate_what_one_does(checkpoint):
    expected = generate(make_engine(checkpoint), prompts(), greedy(12))
    engine = make_engine(checkpoint, tensor_parallel_size=2, max_num_batched_tokens=24)
    try:
        assert generate(engine, prompts(), greedy(12)) == expected
    finally:
        engine.shutdown()


def test_a_dead_rank_fails_the_engine(checkpoint):
    engine = make_engine(checkpoint, tensor_parallel_size=2)
    try:
        submit(engine, "a", prompts()[1], greedy(4))
        drain(engine)
        engine.ranks.workers[0].kill()
        engine.ranks.workers[0].join()
        submit(engine, "b", prompts()[2], greedy(4))
        with pytest.raises(RankFailedError, match="rank 1 exited"):
            engine.step()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("flag", ["async_scheduling", "kv_offload"])
def test_what_tensor_parallelism_does_not_cover_yet_is_refused(checkpoint, flag):
    with pytest.raises(ConfigError, match="tensor parallelism"):
        make_engine(checkpoint, tensor_parallel_size=2, **{flag: True})
