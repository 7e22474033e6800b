"""Texts that tokenizer equivalence tests encode: a fixed multilingual corpus and random
strings over mixed scripts, punctuation, digits, whitespace and a vocabulary's own token texts."""

from __future__ import annotations

import random
from collections.abc import Sequence

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
    "HTTPServer JSONDecoder iPhone McDonald's naïve ǅemal ʰa",
    "   leading, trailing   ",
    "runs:    \n\n\n   \t\t  \r\n\r\n \u00a0\u3000 end",
    "",
    " ",
    "\n",
]

ALPHABET = [
    *"abcxyzABCXYZ0123456789 .,;:!?'\"-_()[]{}<>|/\\#@$%^&*+=~`",
    *"\n\r\t",
    "  ",
    "    ",
    "\u00a0",
    "é",
    "e\u0301",
    "\u0308",
    "ñ",
    "ü",
    "Ü",
    "ß",
    "ǅ",
    "ʰ",
    "Ω",
    "я",
    "Ж",
    "日",
    "本",
    "語",
    "北京",
    "天气",
    "の",
    "한",
    "😀",
    "👍🏽",
    "👨‍👩‍👧",
    "’",
    "…",
    "'s",
    "'T",
    "'LL",
    "'Ve",
    "the",
    " the",
    "ing",
]


def random_texts(count: int, tokens: Sequence[str] = (), seed: int = 0) -> list[str]:
    """`count` random strings over `ALPHABET` and `tokens` (a vocabulary's special texts),
    each followed by a stretch of arbitrary code points below the surrogates."""
    rng = random.Random(seed)
    alphabet = [*ALPHABET, *tokens]
    texts = []
    for _ in range(count):
        text = "".join(rng.choices(alphabet, k=rng.randint(1, 40)))
        text += "".join(chr(rng.randint(0x20, 0xD7FF)) for _ in range(rng.randint(0, 8)))
        texts.append(text)
    return texts
