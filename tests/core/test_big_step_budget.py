"""Step budgets of 8,192 and 16,384 tokens, past max_model_len (issue 19): every buffer a line
sizes by the budget (packed inputs, Qwen3.5's chunked DeltaNet rows, the MoE's, the final
hidden states) takes a step of several prompts at once, and the tokens equal those of 64-token
steps that chunk every prompt. Tiny Qwen3, Qwen3.5 and DeepSeek checkpoints on the CPU."""

from __future__ import annotations

import random

import pytest

from pegainfer.core.plugins import model_lines
from tests.engine_harness import generate, greedy, make_engine

LINES = ("qwen3", "qwen35", "deepseek")


@pytest.fixture(scope="module", params=LINES)
def checkpoint(request, tmp_path_factory):
    lines = {line.name: line for line in model_lines()}
    if request.param not in lines:
        pytest.skip(f"the {request.param} line is not installed")
    path = tmp_path_factory.mktemp(f"budget-{request.param}")
    lines[request.param].write_tiny_checkpoint(path, seed=7)
    return path


def test_big_budgets_give_the_tokens_of_small_chunked_steps(checkpoint):
    rng = random.Random(5)
    # 2,600 prompt tokens in all: one step at the big budgets, 41 chunks at 64 tokens.
    lengths = [500, 480, 300, 300, 250, 250, 200, 120, 100, 60, 30, 7, 2, 1]
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in lengths]
    expected = generate(make_engine(checkpoint, max_num_batched_tokens=64), prompts, greedy(5))
    for budget in (8192, 16384):
        engine = make_engine(checkpoint, max_num_batched_tokens=budget, max_num_seqs=32)
        assert generate(engine, prompts, greedy(5)) == expected, budget
