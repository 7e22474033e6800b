"""The piecewise graphs' bucket plan (`runner/mixed_buckets.py`) and what the runner does with
a step whose bucket is captured, missing or past the cap (the pieces themselves need CUDA: see
the lines' GPU tests, `assert_pieces_match_eager`, and `test_big_step_budget_gpu.py`)."""

from __future__ import annotations

import bisect
import math

import pytest
import torch

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.errors import ConfigError
from pegainfer.core.matmul_weights import MatmulWeights, matmul_flops_per_token
from pegainfer.core.runner.forward_batch import ForwardBatch
from pegainfer.core.runner.mixed_buckets import (
    EAGER_STEP_HOST_S,
    FIRST_MAX_TOKENS,
    MATMUL_RATE,
    first_token_buckets,
    graph_token_cap,
    launch_bound_tokens,
    token_buckets,
)
from pegainfer.core.runner.model_runner import ModelRunner
from pegainfer.core.runner.piecewise_graphs import MixedGraphs, held_bytes_per_token
from pegainfer.models.qwen3.line import Qwen3Line
from pegainfer.server.bench.make_checkpoint import SHAPES
from pegainfer.server.bench.memory_plan import Layout, build_on_meta, shape_config
from tests.engine_harness import make_engine

# Qwen3-4B's config.json (`make-checkpoint qwen3-4b` would write its 8 GB of weights too).
QWEN3_4B = SHAPES["qwen3-4b"] | {"model_type": "qwen3", "vocab_size": 151936}


@pytest.mark.parametrize("cap", [1, 16, 100, 256, 384, 1000, 1536, 2048, 8192, 16384])
def test_every_step_up_to_the_cap_pads_by_at_most_2x_below_256_and_1_5x_above(cap):
    buckets = token_buckets(cap)
    assert buckets == tuple(sorted(set(buckets))) and buckets[-1] == cap
    for tokens in range(1, cap + 1):
        bucket = buckets[bisect.bisect_left(buckets, tokens)]
        limit = max(2 * tokens, 16) if tokens <= FIRST_MAX_TOKENS else math.ceil(1.5 * tokens)
        assert tokens <= bucket <= limit, (tokens, bucket)


def test_the_bucket_count_grows_with_the_log_of_the_cap():
    # 16..256 by doubling (5), then 2^k and 3 * 2^(k-1) (2 a doubling): where every 256
    # tokens up to 8,192 made 37 buckets.
    assert token_buckets(2048) == (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
    assert len(token_buckets(8192)) == 15 and len(token_buckets(16384)) == 17
    assert token_buckets(1000) == (16, 32, 64, 128, 256, 384, 512, 768, 1000)
    with pytest.raises(ValueError, match="positive"):
        token_buckets(0)


def test_the_first_buckets_are_the_short_steps():
    assert first_token_buckets(token_buckets(8192)) == (16, 32, 64, 128, 256)
    assert first_token_buckets(token_buckets(100)) == (16, 32, 64, 100)
    assert first_token_buckets((512, 1024)) == (512,)  # the smallest at least


def test_the_cap_is_where_the_matmuls_outlast_an_eager_steps_launches():
    # Qwen3-4B: 3.633 G weight elements outside the embedding and LM head (the engine-step
    # benchmark's figure), 7.27 GFLOP a token: 30 ms at 400 TFLOP/s is ~1,650 tokens.
    model = build_on_meta(QWEN3_4B, Layout())
    flops = matmul_flops_per_token(model)
    assert flops == 2 * MatmulWeights.of(model).elements
    assert 3.63e9 < flops / 2 < 3.64e9
    bound = launch_bound_tokens(flops)
    assert bound == int(EAGER_STEP_HOST_S * MATMUL_RATE / flops)
    assert 1536 <= bound < 2048
    # The largest bucket within it, and never past the step's budget.
    assert graph_token_cap(model, 8192) == graph_token_cap(model, 16384) == 1536
    assert graph_token_cap(model, 1024) == 1024 and graph_token_cap(model, 1000) == 1000
    assert graph_token_cap(model, 8192, requested=4096) == 4096
    # Twice the FLOPs per token (Qwen3-8B has 1.9x): a bound half as large.
    assert abs(launch_bound_tokens(2 * flops) - bound / 2) <= 1


def test_routed_experts_count_for_the_ones_a_token_chooses():
    model = build_on_meta(shape_config("deepseek-v2-lite"), Layout())
    weights = MatmulWeights.of(model)
    routing = next(m.routing for m in model.modules() if hasattr(m, "routing"))
    chosen = weights.routed * routing.top_k / routing.num_experts
    active = weights.elements - weights.routed + chosen
    assert 0 < weights.routed < weights.elements
    assert matmul_flops_per_token(model) == pytest.approx(2 * active)


def test_a_tiny_model_captures_up_to_the_budget():
    tiny = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "num_hidden_layers": 2,
    }
    model = build_on_meta(QWEN3_4B | tiny, Layout())
    assert graph_token_cap(model, 8192) == 8192


class RecordingPieces(MixedGraphs):
    """`MixedGraphs` whose capture and replay (CUDA only) are recorded instead: the plan of
    which bucket a step captures, replays or leaves to an eager forward is the real one."""

    def __init__(self, buckets: tuple[int, ...], captured: tuple[int, ...]) -> None:
        self.buckets, self.kv_cache = buckets, FakeCache()
        self._pieces = dict.fromkeys(captured)
        self.calls: list[tuple[str, int]] = []

    def _capture_bucket(self, bucket: int) -> None:
        self.calls.append(("capture", bucket))
        self._pieces[bucket] = None

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        self.calls.append(("replay", self.bucket_for(batch.num_tokens)))
        return torch.zeros(1)


class FakeCache:
    num_slots = 0


class FakeModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.eager = 0

    def prepare(self, batch: ForwardBatch) -> None:
        pass

    def forward(self, batch: ForwardBatch, kv_cache: object) -> torch.Tensor:
        self.eager += 1
        return torch.ones(1)


def prompt(tokens: int) -> ForwardBatch:
    return ForwardBatch.build([[1] * tokens], [0], [list(range(-(-tokens // 16)))], [True], 16,
                              torch.device("cpu"))  # fmt: skip


def runner_with(pieces: RecordingPieces) -> tuple[ModelRunner, FakeModel]:
    model = FakeModel()
    runner = ModelRunner(model, torch.device("cpu"))
    runner.mixed_graphs, runner.kv_cache = pieces, FakeCache()
    return runner, model


def test_a_step_captures_its_missing_bucket_then_replays_it():
    pieces = RecordingPieces((16, 32, 64, 96), captured=(16, 32))
    runner, model = runner_with(pieces)
    runner.forward(prompt(20))
    runner.forward(prompt(70))  # bucket 96, missing: captured first
    runner.forward(prompt(90))
    assert pieces.calls == [("replay", 32), ("capture", 96), ("replay", 96), ("replay", 96)]
    assert model.eager == 0


def test_steps_past_the_cap_run_eagerly():
    pieces = RecordingPieces((16, 32, 64, 96), captured=(16, 32, 64, 96))
    runner, model = runner_with(pieces)
    runner.forward(prompt(97))
    runner.forward(prompt(5000))
    assert pieces.calls == [] and model.eager == 2


def test_the_warm_up_runs_a_missing_bucket_eagerly_instead_of_capturing_it():
    pieces = RecordingPieces((16, 32, 64, 96), captured=(16, 32))
    runner, model = runner_with(pieces)
    runner.forward(prompt(70), capture=False)
    runner.forward(prompt(30), capture=False)
    assert pieces.calls == [("replay", 32)] and model.eager == 1
    assert pieces.pending == [64, 96]


def test_an_idle_runner_captures_the_pieces_smallest_first_after_the_decode_graphs():
    pieces = RecordingPieces((16, 32, 64, 96), captured=(16, 32))
    runner, _ = runner_with(pieces)
    while runner.capture_pending():
        pass
    assert pieces.calls == [("capture", 64), ("capture", 96)]
    assert runner.capture_pending() is False


def test_the_cap_flag_is_refused_past_the_budget_and_where_no_pieces_are_captured(tmp_path):
    with pytest.raises(ConfigError, match="at most max_num_batched_tokens"):
        EngineArgs(model="m", max_num_batched_tokens=2048, max_mixed_graph_tokens=4096).validate()
    with pytest.raises(ConfigError, match="max_mixed_graph_tokens must be a positive"):
        EngineArgs(model="m", max_mixed_graph_tokens=0).validate()
    Qwen3Line().write_tiny_checkpoint(tmp_path, seed=3)
    with pytest.raises(ConfigError, match="does not capture"):
        EngineCore(EngineArgs(model=str(tmp_path), device="cpu", max_model_len=128,
                              max_mixed_graph_tokens=512))  # fmt: skip


def test_the_pieces_hold_each_cuts_inputs_and_the_final_states_per_token(tmp_path):
    """What KV sizing reserves for every bucket's pieces: a tiny Qwen3 (float32 on the CPU)
    holds each layer's queries and the two final states, per token."""
    Qwen3Line().write_tiny_checkpoint(tmp_path, seed=3)
    engine = make_engine(tmp_path)
    cfg, model = engine.model.cfg, engine.model
    batch = ForwardBatch.build([list(range(3, 40))], [0], [list(range(10))], [True], 4,
                               torch.device("cpu"))  # fmt: skip
    queries = cfg.num_layers * cfg.num_heads * cfg.head_dim * 4
    assert held_bytes_per_token(model, batch, engine.kv_cache) == queries + 2 * cfg.hidden_size * 4
    assert all(cut.split is None for cut in model.piecewise_cuts())
