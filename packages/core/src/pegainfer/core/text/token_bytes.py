"""The bytes each token of a `tokenizer.json` stands for.

A byte-level BPE (GPT-2's, Qwen's, DeepSeek's, GLM's) spells its vocabulary through a map of
the 256 byte values to printable characters; a SentencePiece-style BPE with byte fallback
spells bytes as `<0xNN>` tokens and the space as `▁`. Added tokens (`<|im_end|>`, `<think>`)
are stored as the text they match. Grammars need the bytes: a grammar constrains text, and a
token is allowed where its bytes continue the text the grammar accepts.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

logger = logging.getLogger(__name__)


def token_bytes(backend: BackendTokenizer) -> list[bytes]:
    """The bytes of every token id below the tokenizer's vocabulary size (with its added
    tokens): an added token's bytes are its text, special or not; an id the tokenizer leaves
    unassigned, and a byte-level token spelled with a character outside the byte map (which
    no text encodes to), have none. Raises ValueError for a tokenizer that is neither
    byte-level nor byte-fallback (its tokens' bytes cannot be known from their spelling)."""
    spell = _speller(component_spec(backend.decoder) or {})
    table = [b""] * backend.get_vocab_size(with_added_tokens=True)
    unspelled = 0
    for token, token_id in backend.get_vocab(with_added_tokens=False).items():
        spelled = spell(token)
        unspelled += spelled is None
        table[token_id] = spelled or b""
    for token_id, added in backend.get_added_tokens_decoder().items():
        table[token_id] = added.content.encode()
    if unspelled:
        logger.warning("%d tokens are spelled with characters outside the byte-level map; "
                       "grammars never allow them", unspelled)  # fmt: skip
    return table


def component_spec(component: Any) -> dict[str, Any] | None:
    """A tokenizer component's (decoder, normalizer, pre-tokenizer) entry in tokenizer.json,
    without writing the whole file (its pickled state is that entry)."""
    return None if component is None else json.loads(component.__getstate__())


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 byte values to printable characters, which byte-level BPE
    vocabularies are spelled in: printable Latin-1 bytes stand for themselves, the others are
    shifted past U+0100."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in chars)
    chars |= {b: chr(256 + n) for n, b in enumerate(shifted)}
    return dict(sorted(chars.items()))


def _speller(decoder: dict[str, Any]) -> Callable[[str], bytes | None]:
    """A function from a vocabulary token's spelling to its bytes (None: it spells none),
    for this decoder."""
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    kinds = {step.get("type") for step in steps}
    if "ByteLevel" in kinds:
        char_to_byte = {char: byte for byte, char in bytes_to_unicode().items()}

        def byte_level(token: str) -> bytes | None:
            try:
                return bytes(char_to_byte[c] for c in token)
            except KeyError:
                return None

        return byte_level
    if "ByteFallback" in kinds:
        space = _space_mark(steps)

        def byte_fallback(token: str) -> bytes:
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                return bytes([int(token[3:5], 16)])
            return (token.replace(space, " ") if space else token).encode()

        return byte_fallback
    raise ValueError(
        f"cannot tell the bytes of this tokenizer's tokens: its decoder ({decoder.get('type')}) "
        "is neither byte-level nor byte-fallback"
    )


def _space_mark(steps: list[dict[str, Any]]) -> str | None:
    """The character a byte-fallback decoder turns into a space (SentencePiece's `▁`), if any."""
    for step in steps:
        if step.get("type") == "Replace" and step.get("content") == " ":
            pattern = step.get("pattern", {}).get("String")
            if isinstance(pattern, str):
                return pattern
        if step.get("type") == "Metaspace":
            return step.get("replacement", "▁")
    return None
