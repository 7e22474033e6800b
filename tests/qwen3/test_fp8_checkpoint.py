"""Qwen3 in the `Qwen/Qwen3-8B-FP8` layout (linear layers in FP8 e4m3 with block scales
`weight_scale_inv`; embeddings, norms and LM head unquantized): our model equals transformers
reading the same files, and our model on the exactly dequantized weights, on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pegainfer import LLM, SamplingParams
from pegainfer.core.errors import ConfigError, WeightLoadError
from pegainfer.core.quant.linear import QuantLinear
from pegainfer.models.qwen3.line import Qwen3Line
from tests.paged_runner import (
    PagedRunner,
    assert_close,
    check_chunked_prefill,
    check_mixed_batch,
    check_token_by_token_decode,
    hf_logits,
    random_tokens,
)
from tests.quant_checkpoints import FP8_BLOCK_CONFIG, hf_fp8_ceil_blocks, quantize_checkpoint
from tests.qwen3.hf_reference import VOCAB, load_ours, write_hf_checkpoint

# 32-row blocks split q (128 rows), k and v (64 each) and gate/up (128 each) on block rows;
# 48-column blocks leave a partial block at the end of every 64-wide input.
BLOCK = [32, 48]


def is_linear(module: str) -> bool:
    return module.startswith("model.layers.") and module.endswith("_proj")


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("qwen3-fp8")
    source = write_hf_checkpoint(root / "bf16", tie=False)
    config = FP8_BLOCK_CONFIG | {"weight_block_size": BLOCK}
    quantize_checkpoint(source, root / "fp8", config, is_linear, dequantized=root / "dequant")
    return root / "fp8", root / "dequant"


@pytest.fixture(scope="module")
def models(fp8_dirs):
    fp8, _ = fp8_dirs
    with hf_fp8_ceil_blocks():
        hf = transformers.Qwen3ForCausalLM.from_pretrained(fp8, dtype=torch.float32).eval()
    return load_ours(fp8), hf


def test_layers_load_quantized(models):
    ours, _ = models
    layer = ours.layers[0]
    for weight in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
        assert isinstance(weight, QuantLinear)
        assert weight.weight.dtype == torch.float8_e4m3fn
        assert weight.weight_scale_inv.dtype == torch.float32
    assert layer.qkv_proj.weight_scale_inv.shape == (256 // 32, 2)  # q 128, k and v 64 rows
    assert ours.lm_head.dtype == torch.float32


@pytest.mark.parametrize("length", [1, 17, 40])
def test_prefill_equals_transformers(models, length):
    ours, hf = models
    tokens = random_tokens(length, length, VOCAB)
    assert_close(PagedRunner(ours).step({"a": tokens})["a"], hf_logits(hf, tokens))


def test_chunked_decode_and_mixed_equal_transformers(models):
    check_chunked_prefill(*models, random_tokens(40, 7, VOCAB), (7, 16, 1, 16))
    check_token_by_token_decode(*models, random_tokens(20, 3, VOCAB), prefill=10)
    check_mixed_batch(*models, VOCAB)


def test_equals_the_dequantized_weights_exactly(models, fp8_dirs):
    ours, _ = models
    plain = load_ours(fp8_dirs[1])
    assert not isinstance(plain.layers[0].qkv_proj, QuantLinear)
    tokens = random_tokens(33, 5, VOCAB)
    a = PagedRunner(ours).step({"a": tokens})["a"]
    b = PagedRunner(plain).step({"a": tokens})["a"]
    assert torch.equal(a, b)


def test_quantization_changes_the_logits(models, fp8_dirs):
    """Guard: the FP8 weights are not the original ones (the comparisons above could not pass
    by loading the unquantized checkpoint)."""
    ours, _ = models
    original = load_ours(fp8_dirs[0].parent / "bf16")
    tokens = random_tokens(16, 9, VOCAB)
    quantized = PagedRunner(ours).step({"a": tokens})["a"]
    assert (quantized - PagedRunner(original).step({"a": tokens})["a"]).abs().max() > 1e-3


def test_serves_greedy_like_the_dequantized_checkpoint(tmp_path):
    """The offline API on an FP8 tiny checkpoint (tokenizer included) generates what it
    generates on the dequantized weights."""
    source = tmp_path / "tiny"
    Qwen3Line().write_tiny_checkpoint(source, seed=4, num_hidden_layers=2)
    config = FP8_BLOCK_CONFIG | {"weight_block_size": [32, 32]}
    quantize_checkpoint(source, tmp_path / "fp8", config, is_linear, tmp_path / "dequant")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = []
    for path in (tmp_path / "fp8", tmp_path / "dequant"):
        llm = LLM(str(path), max_model_len=128, block_size=8, device="cpu", dtype="float32")
        outputs.append(llm.generate(["Hello there", "1 2 3"], params))
    fp8, dequant = ([result.token_ids for result in out] for out in outputs)
    assert fp8 == dequant and all(len(ids) == 12 for ids in fp8)


def test_a_block_split_the_fused_qkv_cannot_take_is_refused(tmp_path):
    """128-row blocks: q (64 rows) would end mid-block with k starting inside it."""
    source = write_hf_checkpoint(tmp_path / "bf16", tie=False)
    quantize_checkpoint(source, tmp_path / "fp8", FP8_BLOCK_CONFIG, is_linear)
    with pytest.raises(WeightLoadError, match="cut its quantization blocks of 128"):
        load_ours(tmp_path / "fp8")


def test_a_quantized_lm_head_is_refused(tmp_path):
    source = write_hf_checkpoint(tmp_path / "bf16", tie=False)
    config = FP8_BLOCK_CONFIG | {"modules_to_not_convert": ["embed_tokens"]}
    quantize_checkpoint(source, tmp_path / "fp8", config, lambda m: m == "lm_head")
    with pytest.raises(ConfigError, match="quantized LM head"):
        load_ours(tmp_path / "fp8")
