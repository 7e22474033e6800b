"""A small, deterministic byte-level BPE tokenizer for tests and tiny checkpoints.

Real checkpoints are too large to ship with the test suite, and the Hugging Face hub is not
reachable from CI. This module trains a Qwen-style tokenizer (NFC normalizer, Qwen's split regex,
byte-level pre-tokenizer and decoder) on a built-in corpus in well under a second, so tests can
exercise the same code paths as a real Qwen checkpoint: multi-byte characters split across tokens,
special and non-special added tokens, and a chat template.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

# Qwen2/Qwen3's pre-tokenization regex, as in their tokenizer.json.
_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Varied text so that merges cover English words, code, numbers and punctuation, while accented
# letters, CJK and emoji stay rare enough that they are often split into several byte tokens.
_CORPUS = r"""
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age
of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season
of Light, it was the season of Darkness, it was the spring of hope, it was the winter of despair.
Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my
purse, and nothing particular to interest me on shore, I thought I would sail about a little and
see the watery part of the world. It is a way I have of driving off the spleen and regulating the
circulation. Whenever I find myself growing grim about the mouth; whenever it is a damp, drizzly
November in my soul, then, I account it high time to get to sea as soon as I can.
A language model predicts the next token given the previous tokens. The server receives a
request, tokenizes the prompt, schedules it with other requests, and streams the generated text
back to the client. Tokens are cached in blocks of key and value tensors; when memory runs out,
the scheduler preempts the newest request and recomputes it later.
Q: What is the capital of France? A: Paris. Q: What is 12 + 30? A: 42.
Q: Who wrote "Pride and Prejudice"? A: Jane Austen, in 1813. She also wrote 'Emma' (1815).
The meeting is on 2024-03-15 at 09:30 UTC; call +1 (555) 010-9999 or e-mail ops@example.com.
Prices: $3.50, $12.99, 45%, 3/4 cup, 1,000,000 users, 0.001 seconds, 6.02e23 atoms, -273.15 C.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 32 50 64 100 128 256 512 1024.

def fibonacci(n: int) -> list[int]:
    # Return the first n Fibonacci numbers.
    result = [0, 1]
    while len(result) < n:
        result.append(result[-1] + result[-2])
    return result[:n]


class Stack:
    def __init__(self) -> None:
        self.items: list[object] = []

    def push(self, item: object) -> None:
        self.items.append(item)

    def pop(self) -> object:
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()


for i in range(10):
    if i % 2 == 0:
        print(f"{i} is even")
    else:
        print(f"{i} is odd")

#include <stdio.h>
int main(int argc, char **argv) {
    for (int i = 0; i < argc; ++i) { printf("%d: %s\n", i, argv[i]); }
    return 0;
}

fn main() { let v: Vec<u32> = (1..=10).map(|x| x * x).collect(); println!("{:?}", v); }
const add = (a, b) => a + b; console.log(JSON.stringify({ sum: add(2, 3), ok: true }));
SELECT name, COUNT(*) AS n FROM users WHERE age >= 18 GROUP BY name ORDER BY n DESC LIMIT 5;
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
<html><body><p class="note">Hello &amp; welcome!</p></body></html>
| a | b | c |   [link](https://example.com/path?q=1&r=2#frag)
~!@#$%^&*()_+-=[]{};':",./<>?\|` -- ... ... !!! ??? *** ### ===

Le cœur a ses raisons que la raison ne connaît point. Où est la bibliothèque ? À bientôt !
Ça va très bien, merci. L'été dernier, nous sommes allés à Genève et à Zürich.
Der Bär läuft über die Straße, und die Mädchen hören Musik. Schöne Grüße aus München!
El niño comió una manzana en el año dos mil. ¿Dónde está la estación? ¡Qué día más bonito!
São Paulo é a maior cidade do Brasil. Ação, coração, informação, educação.
Ελληνικά: Καλημέρα κόσμε. Русский: Привет, как дела? Українська: Дякую!
日本語のテキストです。東京は日本の首都です。今日はいい天気ですね。
中文文本：你好，世界！我们今天学习机器学习和自然语言处理。北京是中国的首都。
한국어: 안녕하세요, 만나서 반갑습니다. 서울은 한국의 수도입니다.
العربية: مرحبا بالعالم. हिन्दी: नमस्ते दुनिया। ไทย: สวัสดีชาวโลก
Emoji: 😀 😂 🙂 🎉 🚀 ❤️ 👍 🐍 🔥 ✨ 🌍 👨‍👩‍👧 🇫🇷 — smileys, flags and joiners.
Math: ∑ ∫ √ ∞ ≈ ≠ ≤ ≥ π θ λ µ ° ± × ÷ → ⇒ ∀ ∃ ∈ ∉ ∅ ∧ ∨ ¬.
Typography: “curly quotes”, ‘single’, en–dash, em—dash, ellipsis…, non‑breaking space,
€100, £5, ¥300.
"""


def train_tiny_bpe(
    split_regex: str, vocab_size: int, normalizer: normalizers.Normalizer | None = None
) -> Tokenizer:
    """A byte-level BPE of at most `vocab_size` tokens (every byte, then merges) trained on the
    built-in corpus, its text split by `split_regex` (a model's pre-tokenization regex) after
    `normalizer`. Deterministic, and well under a second."""
    tokenizer = Tokenizer(models.BPE())
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def write_tiny_tokenizer(
    out_dir: Path,
    *,
    special_tokens: Sequence[str],
    eos_token: str,
    pad_token: str | None,
    chat_template: str,
    vocab_size: int = 1024,
    added_tokens: Sequence[str] = (),
) -> int:
    """Train the tokenizer and write `tokenizer.json` and `tokenizer_config.json` to `out_dir`.

    `vocab_size` bounds the BPE model (256 byte symbols plus merges); `special_tokens` (which must
    include `eos_token` and `pad_token`) follow it as added special tokens, then `added_tokens` as
    added tokens that are not special (like Qwen3's `<think>` and `<tool_call>`, which
    `skip_special_tokens` keeps). Every UTF-8 string can be encoded, and the files are byte-for-byte
    the same on every run. Returns the total vocabulary size, added tokens included.
    """
    missing = [t for t in (eos_token, pad_token) if t is not None and t not in special_tokens]
    if missing:
        raise ValueError(f"{missing} must be among special_tokens")

    tokenizer = train_tiny_bpe(_SPLIT_REGEX, vocab_size, normalizers.NFC())
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in special_tokens]
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    write_tokenizer_config(
        out_dir,
        tokenizer,
        special_tokens=special_tokens,
        added_tokens=added_tokens,
        eos_token=eos_token,
        pad_token=pad_token,
        chat_template=chat_template,
    )
    return tokenizer.get_vocab_size(with_added_tokens=True)


def write_tokenizer_config(
    out_dir: Path,
    tokenizer: Tokenizer,
    *,
    special_tokens: Sequence[str],
    added_tokens: Sequence[str],
    eos_token: str,
    pad_token: str | None,
    chat_template: str,
) -> None:
    """Write a Qwen-style `tokenizer_config.json` that transformers' AutoTokenizer loads offline.

    transformers 5 needs `added_tokens_decoder` to load a `Qwen2Tokenizer` from the directory.
    """
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": {
            str(tokenizer.token_to_id(t)): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": t in special_tokens,
            }
            for t in (*special_tokens, *added_tokens)
        },
        "additional_special_tokens": [t for t in special_tokens if t != pad_token],
        "bos_token": None,
        "eos_token": eos_token,
        "pad_token": pad_token,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 131072,
        "split_special_tokens": False,
        "chat_template": chat_template,
    }
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
