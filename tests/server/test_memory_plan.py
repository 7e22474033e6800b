"""`pegainfer-bench memory-plan`: one GPU's bytes of Kimi-K2 and GLM-5 under a parallel layout,
from each line's own model built on the meta device, checked against the checkpoint writer's
independent size formula and the storage formats' bytes per weight; and the tables of
docs/full-size-8xh200.md are what it computes."""

from __future__ import annotations

from pathlib import Path

import pytest

from pegainfer.server.bench import make_checkpoint as mc
from pegainfer.server.bench.memory_plan import (
    DOC_BUDGETS,
    DOC_PLANS,
    Budget,
    Layout,
    markdown_tables,
    rank_bytes,
    shape_config,
)

ROOT = Path(__file__).parents[2]
KIMI = pytest.mark.line("kimi_k2")
GLM5 = pytest.mark.line("glm5")


@pytest.mark.parametrize("shape", [pytest.param("kimi-k2", marks=KIMI),
                                   pytest.param("glm5", marks=GLM5)])  # fmt: skip
def test_one_gpu_holds_what_the_bf16_checkpoint_stores(shape):
    config = shape_config(shape)
    plan = rank_bytes(config, Layout())
    assert plan.total == mc.latent_moe_bytes(config)
    # The latent (512) and rope key (64) of every layer, bf16; GLM-5's indexer key (128) too.
    index = 128 if shape == "glm5" else 0
    assert plan.kv_per_token == config["num_hidden_layers"] * 2 * (512 + 64 + index)


@pytest.mark.parametrize("shape", [pytest.param("kimi-k2-int4", marks=KIMI),
                                   pytest.param("glm5-fp8", marks=GLM5)])  # fmt: skip
def test_data_parallel_ranks_divide_only_the_routed_experts(shape):
    config = shape_config(shape)
    whole, rank = rank_bytes(config, Layout()), rank_bytes(config, Layout(data_parallel=8))
    assert rank.weights["routed_experts"] * 8 == whole.weights["routed_experts"]
    for group, size in whole.weights.items():
        assert group == "routed_experts" or rank.weights[group] == size
    assert rank.kv_per_token == whole.kv_per_token  # each rank's own sequences, whole


@KIMI
def test_tensor_parallel_ranks_split_the_rest_but_keep_the_whole_latent():
    config = shape_config("kimi-k2-int4")
    whole, rank = rank_bytes(config, Layout()), rank_bytes(config, Layout(tensor_parallel=8))
    assert rank.weights["routed_experts"] * 8 == whole.weights["routed_experts"]
    assert rank.weights["embedding"] * 8 == whole.weights["embedding"]
    assert rank.weights["shared_experts"] * 8 == whole.weights["shared_experts"]
    # The q and kv LoRA down-projections stay whole on every rank; the heads divide.
    assert whole.weights["attention"] / 8 < rank.weights["attention"] < whole.weights["attention"]
    assert rank.kv_per_token == whole.kv_per_token


@KIMI
def test_routed_experts_take_the_bytes_their_formats_store():
    plain = rank_bytes(shape_config("kimi-k2"), Layout()).weights["routed_experts"]
    weights = plain // 2
    int4 = rank_bytes(shape_config("kimi-k2-int4"), Layout()).weights["routed_experts"]
    assert int4 == weights // 2 + weights // 32 * 2  # nibbles, a bf16 scale per 32
    fp8 = rank_bytes(shape_config("kimi-k2-fp8"), Layout()).weights["routed_experts"]
    assert fp8 == weights + weights // (128 * 128) * 4  # e4m3, a float32 scale per block


def test_the_kv_budget_is_what_the_engine_leaves():
    budget = Budget(gpu_gib=100.0, utilization=0.9, step_peak_gib=4.0, context_gib=1.0,
                    graph_reserve_gib=1.0)  # fmt: skip
    assert budget.kv_bytes(50 * 2**30) == 34 * 2**30


@KIMI
@GLM5
def test_the_doc_tables_are_the_plan():
    doc = (ROOT / "docs" / "full-size-8xh200.md").read_text()
    for table in markdown_tables(DOC_PLANS, DOC_BUDGETS):
        assert table in doc
