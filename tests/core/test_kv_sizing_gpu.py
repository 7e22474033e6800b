"""`--kv-cache-memory-bytes` on a GPU: the cache takes exactly that (no profiling step), and
more than is free is refused by name (CUDA; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.errors import ConfigError

pytestmark = pytest.mark.gpu

MIB = 1 << 20


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from tests.qwen3.golden_gate import write_gate_checkpoint
    from tests.qwen3.test_engine_gpu import SMALL, SMALL_LAYER_OUT

    path = tmp_path_factory.mktemp("kv-sizing-gpu")
    write_gate_checkpoint(path, SMALL, SMALL_LAYER_OUT, seed=2)
    return path


def args(path, **overrides) -> EngineArgs:
    return EngineArgs(model=str(path), device="cuda", dtype="bfloat16", max_model_len=2048,
                      max_num_seqs=8, enforce_eager=True, **overrides)  # fmt: skip


def test_the_cache_takes_the_bytes_given(small):
    engine = EngineCore(args(small, kv_cache_memory_bytes=96 * MIB))
    per_block = engine.kv_cache.nbytes // engine.kv_cache.num_blocks
    # The blocks that fit, and the one padding rows use.
    assert engine.config.num_kv_blocks == 96 * MIB // per_block
    assert engine.kv_cache.num_blocks == engine.config.num_kv_blocks + 1


def test_more_than_is_free_is_refused(small):
    free, _ = torch.cuda.mem_get_info()
    with pytest.raises(ConfigError, match="--kv-cache-memory-bytes .* is more than"):
        EngineCore(args(small, kv_cache_memory_bytes=free + (1 << 30)))
