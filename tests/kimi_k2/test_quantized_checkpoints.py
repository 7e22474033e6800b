"""Kimi-K2's quantized layouts on the CPU: FP8 with block scales (Kimi-K2-Instruct: every linear
layer of the decoder, kv_a's rows ending in a partial block as Kimi's 576 do) and
compressed-tensors INT4 groups of 32 (Kimi-K2-Thinking, K2.5: the routed experts only). Our
model equals transformers reading the same files (FP8 with its partial-block dequantization
fixed), and equals our model on the exactly dequantized weights bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

from pegainfer.core.latent_moe.random_weights import LINEAR_LAYERS
from pegainfer.core.ops.quant import dequantize_int4_group
from pegainfer.core.quant.linear import QuantLinear
from pegainfer.core.quant.scheme import Fp8Block, Int4Group
from tests.kimi_k2.hf_reference import VOCAB, load_hf, load_ours, wrap_as_k25, write_hf_checkpoint
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
    int4_config,
    quantize_checkpoint,
)

# Widths on 32-row blocks where a fused matrix's parts meet (q_a 32 | kv_a 32 + 8, the last
# part's partial block as Kimi's 576 rows over 128 leave one; dense gate 96 | up 96) and
# whole blocks for each expert (32), as FP8 experts need.
FP8_WIDTHS = {"q_lora_rank": 32, "moe_intermediate_size": 32}
FP8 = FP8_BLOCK_CONFIG | {"weight_block_size": [32, 32]}
# Kimi-K2-Thinking's ignore list: attention, shared experts, dense MLPs and the head stay bf16.
INT4 = int4_config(["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"])  # fmt: skip


def is_linear(module: str) -> bool:
    return module.startswith("model.layers.") and module.rpartition(".")[2] in LINEAR_LAYERS


@pytest.fixture(scope="module", params=["fp8", "int4"])
def checkpoints(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """(format, the quantized checkpoint, its dequantized twin)."""
    root = tmp_path_factory.mktemp(f"kimi-{request.param}")
    source = write_hf_checkpoint(root / "bf16", **FP8_WIDTHS)
    config = FP8 if request.param == "fp8" else INT4
    quantize_checkpoint(source, root / "quantized", config, is_linear, root / "dequantized")
    if request.param == "int4":
        bf16_exact_scales(root / "quantized", root / "dequantized")
    return request.param, root / "quantized", root / "dequantized"


def bf16_exact_scales(quantized: Path, dequantized: Path) -> None:
    """Round each INT4 scale to 4 significant bits, so that value x scale (a 3-bit integer
    times it) is exact in bf16: transformers decompresses the experts to bf16 even in a
    float32 model, and then holds exactly the weights of our dequantization and of the twin."""
    stored = load_file(quantized / "model.safetensors")
    twin = load_file(dequantized / "model.safetensors")
    for name in [n for n in stored if n.endswith(".weight_scale")]:
        module = name.removesuffix(".weight_scale")
        mantissa, exponent = torch.frexp(stored[name].float())
        scale = torch.ldexp((mantissa * 16).round() / 16, exponent).to(stored[name].dtype)
        stored[name] = scale
        packed = stored[f"{module}.weight_packed"]
        twin[f"{module}.weight"] = dequantize_int4_group(packed, scale, 32, torch.float32)
    save_file(stored, quantized / "model.safetensors", metadata={"format": "pt"})
    save_file(twin, dequantized / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def models(checkpoints):
    """Ours and transformers' on the quantized files. transformers leaves decompressed INT4
    experts in bf16 (exact here: `bf16_exact_scales`) and computes them in bf16; they run in
    float32 like the rest of its float32 model."""
    _, quantized, _ = checkpoints
    with hf_fp8_ceil_blocks():
        hf = load_hf(quantized)
    for module in hf.modules():
        if isinstance(module, DeepseekV3Experts):
            module.to(torch.float32)
    return load_ours(quantized), hf


def test_layers_load_in_the_checkpoints_format(checkpoints, models):
    name, _, _ = checkpoints
    ours, _ = models
    attn, experts = ours.layers[1].self_attn, ours.layers[1].mlp.experts
    assert isinstance(experts.gate_up_proj, QuantLinear)
    assert isinstance(experts.down_proj.fmt, Fp8Block if name == "fp8" else Int4Group)
    assert isinstance(attn.q_kv_a_proj, QuantLinear) == (name == "fp8")
    assert isinstance(ours.layers[0].mlp.gate_up_proj, QuantLinear) == (name == "fp8")
    assert not isinstance(attn.kv_b_proj, QuantLinear)  # dequantized for absorbed attention
    assert ours.layers[1].mlp.e_score_correction_bias.dtype == torch.float32


@pytest.mark.parametrize("length", [1, 17, 40])
def test_prefill_equals_transformers(models, length):
    ours, hf = models
    tokens = random_tokens(length, length, VOCAB)
    assert_close(PagedRunner(ours).step({"a": tokens})["a"], hf_logits(hf, tokens))


def test_chunked_decode_and_mixed_equal_transformers(models):
    check_chunked_prefill(*models, random_tokens(40, 7, VOCAB), (7, 16, 1, 16))
    check_token_by_token_decode(*models, random_tokens(20, 3, VOCAB), prefill=10)
    check_mixed_batch(*models, VOCAB)


def test_equals_the_dequantized_weights_exactly(checkpoints, models):
    _, quantized, dequantized = checkpoints
    ours, _ = models
    twin, original = load_ours(dequantized), load_ours(quantized.parent / "bf16")
    assert not isinstance(twin.layers[1].mlp.experts.gate_up_proj, QuantLinear)
    assert_equals_the_dequantized_twin(ours, twin, original, random_tokens(33, 5, VOCAB))


def test_k25s_nested_int4_config_and_prefixed_weights(tmp_path):
    """K2.5/K2.6's layout: the INT4 quantization_config inside `text_config` (its ignore list as
    models.md gives it: `re:.*lm_head.*`), the text weights under `language_model.`: the same
    logits as the checkpoint unwrapped."""
    config = INT4 | {"ignore": [*INT4["ignore"][1:], "re:.*lm_head.*"]}
    source = write_hf_checkpoint(tmp_path / "bf16", **FP8_WIDTHS)
    quantize_checkpoint(source, tmp_path / "int4", config, is_linear)
    wrapped = wrap_as_k25(tmp_path / "int4", tmp_path / "k25")
    assert "quantization_config" in json.loads((wrapped / "config.json").read_text())["text_config"]
    ours = load_ours(wrapped)
    assert isinstance(ours.layers[1].mlp.experts.gate_up_proj, QuantLinear)
    tokens = random_tokens(21, 5, VOCAB)
    expected = PagedRunner(load_ours(tmp_path / "int4")).step({"a": tokens})["a"]
    assert torch.equal(PagedRunner(ours).step({"a": tokens})["a"], expected)
