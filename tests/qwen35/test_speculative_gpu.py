"""Speculative decoding of Qwen3.5 on CUDA (bf16: the DeltaNet kernels keep each verify
chunk's state before its drafts through their mid-chunk checkpoint, the MTP layer attends
through FlashInfer): greedy output follows plain decoding's. bf16 verify chunks (the chunked
delta rule) and plain decodes (the recurrent one) round differently, so a near tie may part
them late; a rollback that left a rejected draft in the state would part them at once."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.models.qwen35.line import Qwen35Line
from tests.engine_harness import generate, greedy
from tests.speculative_harness import OracleDrafter

pytestmark = pytest.mark.gpu
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen35-speculative-gpu")
    Qwen35Line().write_tiny_checkpoint(path, seed=6)
    return path


def run(path: Path, batch: list[list[int]], sequences=None, **overrides) -> list[list[int]]:
    engine = EngineCore(EngineArgs(model=str(path), device="cuda", dtype="bfloat16",
                                   max_model_len=512, max_num_seqs=8, num_kv_blocks=256,
                                   **overrides))  # fmt: skip
    if sequences is not None:
        k = overrides["speculative_tokens"]
        engine.speculative.drafter = OracleDrafter(k, sequences, vocab=1000)
    outputs = generate(engine, batch, greedy(NEW_TOKENS))
    if engine.speculative is not None:
        assert engine.speculative.counters.num_draft_tokens > 0
    engine.block_manager.check_invariants()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return outputs


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


@pytest.mark.parametrize("oracle", [False, True], ids=["mtp", "oracle"])
def test_greedy_output_follows_plain_decoding(path, oracle):
    g = torch.Generator().manual_seed(2)
    batch = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (3, 17, 64, 130, 9, 40)]
    plain = run(path, batch)
    sequences = {str(i): p + o for i, (p, o) in enumerate(zip(batch, plain, strict=True))}
    speculative = run(path, batch, sequences if oracle else None, speculative_tokens=3)
    agree = [common_prefix(s, p) for s, p in zip(speculative, plain, strict=True)]
    assert sum(agree) >= 0.75 * NEW_TOKENS * len(batch), agree
    assert min(agree) >= 4, agree
