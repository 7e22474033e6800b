"""Core's latent-attention MoE decoder on quantized checkpoints (Kimi-K2-Instruct's FP8 blocks
on every linear layer, K2-Thinking's INT4 routed experts), on the CPU: the model equals the
same decoder on the exactly dequantized weights, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pegainfer.core.latent_moe.model import LatentMoEForCausalLM
from pegainfer.core.loading.model_files import read_config
from pegainfer.core.loading.weights import build_and_load
from pegainfer.core.model import ModelContext
from pegainfer.core.model_line import RuntimeConfig
from pegainfer.core.moe.experts import QuantizedExpertWeights
from pegainfer.core.quant.linear import QuantLinear
from pegainfer.core.quant.scheme import parse_quantization
from tests.paged_runner import PagedRunner, random_tokens
from tests.quant_checkpoints import FP8_BLOCK_CONFIG, int4_config, quantize_checkpoint

pytestmark = pytest.mark.line("deepseek")
# The DeepSeek line writes the checkpoints; with it not installed this module is skipped.
deepseek_line = pytest.importorskip(
    "pegainfer.models.deepseek.line", reason="the deepseek line is not installed"
)

# 32-row blocks: the q LoRA (96 rows) and kv_a (64 + 16: a partial last block) fuse on block
# rows, every expert's 64-wide gate, up and down rows are whole blocks.
SCHEMES = {
    "fp8": FP8_BLOCK_CONFIG | {"weight_block_size": [32, 32]},
    "int4-experts": int4_config(ignore=["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]),
}  # fmt: skip


def is_linear(module: str) -> bool:
    """The layers transformers builds as nn.Linear (the router is not one)."""
    return module.startswith("model.layers.") and module.endswith(("_proj", "_proj_with_mqa"))


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("latent-moe")
    deepseek_line.DeepseekLine().write_tiny_checkpoint(
        path, seed=5, q_lora_rank=96, num_hidden_layers=2
    )
    return path


def load(path: Path) -> LatentMoEForCausalLM:
    config = read_config(path)
    ctx = ModelContext(path, config, torch.float32, torch.device("cpu"))
    scheme = parse_quantization(config)
    model = build_and_load(lambda: LatentMoEForCausalLM(deepseek_line.deepseek_v2_config(config),
                                                        scheme=scheme), ctx)  # fmt: skip
    model.init_runtime(RuntimeConfig(block_size=4, max_model_len=256, max_num_batched_tokens=256,
                                     max_num_seqs=8))  # fmt: skip
    return model


@pytest.mark.parametrize("name", list(SCHEMES))
def test_equals_the_dequantized_weights(source, tmp_path, name):
    quantize_checkpoint(source, tmp_path / "q", SCHEMES[name], is_linear, tmp_path / "dequant")
    quantized, plain = load(tmp_path / "q"), load(tmp_path / "dequant")
    moe_layer = quantized.layers[1]
    assert isinstance(moe_layer.mlp.experts.weights(), QuantizedExpertWeights)
    attention = moe_layer.self_attn
    assert isinstance(attention.q_kv_a_proj, QuantLinear) == (name == "fp8")
    assert not isinstance(attention.kv_b_proj, QuantLinear)  # dequantized after loading
    runner_q, runner_p = PagedRunner(quantized), PagedRunner(plain)
    tokens = random_tokens(19, 4, 200)
    assert torch.equal(
        runner_q.step({"a": tokens[:15]})["a"], runner_p.step({"a": tokens[:15]})["a"]
    )
    for token in tokens[15:]:  # decodes: the absorbed attention over the dequantized kv_b
        assert torch.equal(runner_q.step({"a": [token]})["a"], runner_p.step({"a": [token]})["a"])


def test_a_quantized_lm_head_is_refused(source, tmp_path):
    from pegainfer.core.errors import ConfigError

    config = FP8_BLOCK_CONFIG | {"weight_block_size": [32, 32], "modules_to_not_convert": []}
    quantize_checkpoint(source, tmp_path / "q", config, lambda m: m == "lm_head")
    with pytest.raises(ConfigError, match="quantized LM head"):
        load(tmp_path / "q")


def test_layers_are_named_under_the_checkpoint_prefix(source):
    """A vision-language checkpoint (Kimi-K2.5) names its text layers under a prefix: the
    scheme's patterns see those names."""
    ignore = ["lm_head", "language_model.model.layers.0"]
    qc = FP8_BLOCK_CONFIG | {"weight_block_size": [32, 32], "modules_to_not_convert": ignore}
    config = read_config(source) | {"quantization_config": qc}
    with torch.device("meta"):
        model = LatentMoEForCausalLM(
            deepseek_line.deepseek_v2_config(config),
            scheme=parse_quantization(config),
            checkpoint_prefix="language_model.",
        )
    assert not isinstance(model.layers[0].self_attn.o_proj, QuantLinear)
    assert not isinstance(model.layers[0].mlp.down_proj, QuantLinear)
    assert isinstance(model.layers[1].self_attn.o_proj, QuantLinear)
    assert isinstance(model.layers[1].mlp.experts.down_proj, QuantLinear)
