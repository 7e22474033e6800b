"""The CPU KV cache's size: the user's budget, or by default the weights' size within bounds,
never more than every sequence at full length can use; and the engine's start with it."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.errors import ConfigError
from pegainfer.core.kv.kv_cache import ArenaSpec
from pegainfer.core.runner.memory import CPU_KV_DEFAULT_MAX, CPU_KV_DEFAULT_MIN, cpu_kv_blocks
from pegainfer.models.qwen3.line import Qwen3Line

MIB = 1 << 20
# 1 MiB a block: K and V of 2 layers, 16 tokens, 64 heads of 64 float32s.
SPECS = [ArenaSpec("kv", 2, (2, 16, 64, 64), torch.float32)]


def blocks(weight_bytes: int, budget: int | None = None, seqs: int = 256, length: int = 4096):
    return cpu_kv_blocks(SPECS, 16, seqs, length, weight_bytes, budget)


def test_block_is_one_mib():
    assert SPECS[0].bytes_per_block == MIB


def test_default_follows_the_weights_within_bounds():
    assert blocks(weight_bytes=2 * MIB) == CPU_KV_DEFAULT_MIN // MIB  # a tiny model: the floor
    assert blocks(weight_bytes=300 * MIB) == 300
    assert blocks(weight_bytes=40 << 30) == CPU_KV_DEFAULT_MAX // MIB  # a large one: the cap


def test_an_explicit_budget_wins_over_the_default():
    assert blocks(weight_bytes=2 * MIB, budget=10 * MIB) == 10
    assert blocks(weight_bytes=2 * MIB, budget=4 << 30) == 4096


def test_never_more_than_every_sequence_at_full_length():
    # 4 sequences of 64 tokens: 16 blocks, whatever the budget.
    assert blocks(weight_bytes=300 * MIB, seqs=4, length=64) == 16
    assert blocks(weight_bytes=2 * MIB, budget=1 << 30, seqs=4, length=50) == 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("cpu-kv-tiny")
    Qwen3Line().write_tiny_checkpoint(path, seed=3)
    return path


def test_engine_sizes_a_tiny_model_at_the_floor(tiny):
    engine = EngineCore(EngineArgs(model=str(tiny), device="cpu"))
    assert engine.kv_cache.nbytes == CPU_KV_DEFAULT_MIN


def test_engine_takes_the_flag_and_refuses_a_budget_below_one_sequence(tiny):
    engine = EngineCore(EngineArgs(model=str(tiny), device="cpu", cpu_kv_cache_gib=0.25))
    assert engine.kv_cache.nbytes == 256 * MIB
    engine = EngineCore(EngineArgs(model=str(tiny), device="cpu",
                                   kv_cache_memory_bytes=100 * MIB))  # fmt: skip
    assert engine.kv_cache.nbytes == 100 * MIB  # vLLM's flag, on the CPU too
    with pytest.raises(ConfigError, match="fewer than one sequence of max_model_len"):
        EngineCore(EngineArgs(model=str(tiny), device="cpu", cpu_kv_cache_gib=0.001))
