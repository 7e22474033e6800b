"""GLM-5-FP8's layout on the CPU: every linear layer of the decoder and the indexer's query and
key projections stored as FP8 with block scales (the router and the indexer's head weights
not). Our model equals transformers reading the same files (its partial-block dequantization
fixed), and equals our model on the exactly dequantized weights bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pegainfer.core.quant.linear import QuantLinear
from tests.glm5.hf_reference import VOCAB, load_hf, load_ours, write_hf_checkpoint
from tests.paged_runner import (
    PagedRunner,
    assert_close,
    check_chunked_prefill,
    check_mixed_batch,
    check_token_by_token_decode,
    hf_logits,
    random_tokens,
)
from tests.quant_checkpoints import (
    FP8_BLOCK_CONFIG,
    assert_equals_the_dequantized_twin,
    hf_fp8_ceil_blocks,
    quantize_checkpoint,
)

# Blocks of 32 rows meet where a fused matrix's parts do (q_a 32 | kv_a 32 + 8: the last
# part ends in a partial block, as GLM-5's 576 rows over 128 do); whole blocks per expert.
FP8 = FP8_BLOCK_CONFIG | {"weight_block_size": [32, 32]}
LINEAR = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
          "up_proj", "down_proj", "wq_b", "wk"}  # fmt: skip


def is_linear(module: str) -> bool:
    return module.startswith("model.layers.") and module.rpartition(".")[2] in LINEAR


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """The directory holding `bf16` (unquantized), `fp8` and its `dequantized` twin."""
    root = tmp_path_factory.mktemp("glm5-fp8")
    shared = ["full", "full", "shared", "full", "shared"]
    source = write_hf_checkpoint(root / "bf16", q_lora_rank=32, indexer_types=shared)
    quantize_checkpoint(source, root / "fp8", FP8, is_linear, root / "dequantized")
    return root


@pytest.fixture(scope="module")
def models(checkpoints):
    with hf_fp8_ceil_blocks():
        hf = load_hf(checkpoints / "fp8")
    return load_ours(checkpoints / "fp8"), hf


def test_layers_load_in_the_checkpoints_format(models):
    ours, _ = models
    attn = ours.layers[3].self_attn
    assert isinstance(attn.q_kv_a_proj, QuantLinear) and isinstance(attn.o_proj, QuantLinear)
    assert isinstance(attn.indexer.wq_b, QuantLinear) and isinstance(attn.indexer.wk, QuantLinear)
    assert attn.indexer.weights_proj.dtype == torch.float32
    assert isinstance(ours.layers[3].mlp.experts.gate_up_proj, QuantLinear)
    assert not isinstance(attn.kv_b_proj, QuantLinear)  # dequantized for absorbed attention


@pytest.mark.parametrize("length", [5, 17, 40])
def test_prefill_equals_transformers(models, length):
    ours, hf = models
    tokens = random_tokens(length, length, VOCAB)
    assert_close(PagedRunner(ours).step({"a": tokens})["a"], hf_logits(hf, tokens))


def test_chunked_decode_and_mixed_equal_transformers(models):
    check_chunked_prefill(*models, random_tokens(40, 7, VOCAB), (7, 16, 1, 16))
    check_token_by_token_decode(*models, random_tokens(20, 3, VOCAB), prefill=10)
    check_mixed_batch(*models, VOCAB)


def test_equals_the_dequantized_weights_exactly(checkpoints, models):
    ours, _ = models
    twin, original = load_ours(checkpoints / "dequantized"), load_ours(checkpoints / "bf16")
    assert_equals_the_dequantized_twin(ours, twin, original, random_tokens(33, 5, VOCAB))
