"""Two tensor-parallel ranks on two GPUs (NCCL, decode CUDA graphs on both ranks) generate what
one GPU does (skipped without two CUDA devices).

The checkpoints follow the golden gate's recipe for peaked distributions, so greedy choices
stand far apart and the ranks' other order of bf16 sums cannot flip them."""

from __future__ import annotations

import gc

import pytest
import torch

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine import EngineCore
from tests.engine_harness import generate, greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def gpu_engine(path, **overrides) -> EngineCore:
    args = dict(model=str(path), device="cuda", dtype="bfloat16", max_model_len=2048,
                max_num_seqs=16, max_num_batched_tokens=256,
                gpu_memory_utilization=0.4)  # fmt: skip
    return EngineCore(EngineArgs(**(args | overrides)))


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 90, 300, 700)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.deepseek.hf_reference import SMALL as DEEPSEEK_STRUCTURE
    from tests.deepseek.test_engine_gpu import GATE_ROUTING, LITE_GEOMETRY, SMALL_LAYER_OUT
    from tests.deepseek.test_engine_gpu import write_gate_checkpoint as write_deepseek
    from tests.qwen3.golden_gate import write_gate_checkpoint as write_qwen3
    from tests.qwen3.test_engine_gpu import SMALL
    from tests.qwen3.test_engine_gpu import SMALL_LAYER_OUT as QWEN3_LAYER_OUT

    qwen3 = tmp_path_factory.mktemp("tp-qwen3")
    write_qwen3(qwen3, SMALL, QWEN3_LAYER_OUT, seed=11)
    deepseek = tmp_path_factory.mktemp("tp-deepseek")
    write_deepseek(deepseek, DEEPSEEK_STRUCTURE | LITE_GEOMETRY | GATE_ROUTING, SMALL_LAYER_OUT,
                   seed=3)  # fmt: skip
    return {"qwen3": (qwen3, SMALL["vocab_size"]),
            "deepseek": (deepseek, LITE_GEOMETRY["vocab_size"])}  # fmt: skip


@pytest.mark.parametrize(("line", "async_scheduling"),
                         [("qwen3", False), ("qwen3", True), ("deepseek", False)])  # fmt: skip
def test_two_gpus_generate_what_one_does(checkpoints, line, async_scheduling):
    path, vocab = checkpoints[line]
    one = gpu_engine(path)
    expected = generate(one, prompts(vocab), greedy(24))
    del one
    gc.collect()
    torch.cuda.empty_cache()
    two = gpu_engine(path, tensor_parallel_size=2, async_scheduling=async_scheduling)
    try:
        assert two.graphs is not None  # decode steps replay graphs on both ranks
        assert generate(two, prompts(vocab), greedy(24)) == expected
    finally:
        two.shutdown()
