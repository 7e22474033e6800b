"""Which checkpoints the Kimi-K2 line claims (and the DeepSeek-V2 line leaves to it), and a
K2.5-style vision-language checkpoint's text model read from under its prefix."""

from __future__ import annotations

import json

import pytest

from pegainfer.core.errors import ConfigError
from pegainfer.core.plugins import detect_model_line, model_lines
from pegainfer.models.kimi_k2.line import KimiK2Line
from tests.kimi_k2.hf_reference import load_hf, load_ours, wrap_as_k25, write_hf_checkpoint
from tests.paged_runner import PagedRunner, assert_close, hf_logits, random_tokens

TEXT = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}


@pytest.mark.parametrize(
    "config",
    [TEXT, {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]},
     {"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3"}},
     {"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2"}}],
    ids=["kimi_k2", "deepseek_v3", "kimi_k25-v3", "kimi_k25-k2"],
)  # fmt: skip
def test_the_kimi_line_alone_claims_v3_checkpoints(config):
    assert detect_model_line(config, model_lines()).name == "kimi-k2"


@pytest.mark.line("deepseek")
def test_the_deepseek_line_keeps_v2():
    from pegainfer.models.deepseek.line import DeepseekLine

    assert detect_model_line({"model_type": "deepseek_v2"}, model_lines()).name == "deepseek"
    assert not DeepseekLine().probe(TEXT).claimed
    assert not KimiK2Line().probe({"model_type": "deepseek_v2"}).claimed


def test_a_vision_language_checkpoint_without_a_v3_text_model_is_refused():
    probe = KimiK2Line().probe({"model_type": "kimi_k25", "text_config": {"model_type": "x"}})
    assert not probe.claimed and "without a DeepSeek-V3 text_config" in probe.reason


def test_a_v3_checkpoint_that_does_not_route_by_noaux_tc_is_refused(tmp_path):
    from pegainfer.models.kimi_k2.config import KimiCheckpoint

    config = json.loads((write_hf_checkpoint(tmp_path) / "config.json").read_text())
    checkpoint = KimiCheckpoint.of(config | {"scoring_func": "softmax", "topk_method": "greedy",
                                             "norm_topk_prob": False})  # fmt: skip
    with pytest.raises(ConfigError, match="routes by noaux_tc, not 'greedy'"):
        checkpoint.model_config()


def test_k25_text_weights_under_their_prefix(tmp_path):
    """The text model's config nested in `text_config`, its tensors under `language_model.`,
    beside vision tensors the line leaves unread: the logits of the plain checkpoint."""
    plain = write_hf_checkpoint(tmp_path / "plain")
    wrapped = wrap_as_k25(plain, tmp_path / "k25")
    tokens = random_tokens(21, 5, 300)
    expected = hf_logits(load_hf(plain), tokens)
    assert_close(PagedRunner(load_ours(wrapped)).step({"a": tokens})["a"], expected)
