"""On CUDA, the engine's start-up release gives torch's cached page-locked host blocks back to
the system (they count in the process's RSS; torch keeps them once freed), and an engine
started on the GPU logs what it gave back. Skipped without CUDA."""

from __future__ import annotations

import logging

import pytest
import torch

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.process_info import rss_bytes
from pegainfer.core.runner.memory import release_start_up_memory
from pegainfer.models.qwen3.line import Qwen3Line

pytestmark = pytest.mark.gpu

_BLOCK = 256 << 20


def test_cached_page_locked_blocks_are_given_back():
    torch.cuda.init()
    block = torch.empty(_BLOCK, dtype=torch.uint8, pin_memory=True)
    block.fill_(1)  # resident
    del block  # back in torch's host cache: still resident
    cached = rss_bytes()
    release_start_up_memory(torch.device("cuda"))
    assert cached - rss_bytes() > _BLOCK * 0.9, (cached >> 20, rss_bytes() >> 20)


def test_an_engine_on_the_gpu_gives_start_up_memory_back(tmp_path, caplog):
    Qwen3Line().write_tiny_checkpoint(tmp_path, seed=2)
    with caplog.at_level(logging.INFO, logger="pegainfer.core.runner.memory"):
        engine = EngineCore(EngineArgs(model=str(tmp_path), max_model_len=256, max_num_seqs=8))
    try:
        assert engine.config.device.startswith("cuda")
        assert any("start-up memory given back" in r.getMessage() for r in caplog.records)
    finally:
        engine.shutdown()
