"""How many characters of text one token can stand for, read from a `tokenizer.json` pipeline.

It gives a lower bound on a text's token count without tokenizing it: a prompt of C
characters has at least ceil(C / k) tokens when no token covers more than k characters. The
server uses it to refuse a prompt that cannot fit the context before spending seconds (and
hundreds of MB) tokenizing it.

The bound holds only for pipelines that keep every character of the text in some token, so
each stage is checked against what it may drop or merge:

- normalizers: Unicode normalization composes at most 4 code points into one (the longest
  canonical decomposition is 4); `Replace` of a literal string shrinks by at most the ratio of
  the lengths; `Lowercase` and `Prepend` never shrink. Anything else (`Strip`, regex
  replacements, BERT's and SentencePiece's normalizers, which drop characters) gives no bound.
- pre-tokenizers: byte-level, metaspace, digit, punctuation and script splits keep every
  character (byte-level maps each byte to one symbol, and a character is at least one byte);
  whitespace splitters and `Split` with behaviour `Removed` drop characters: no bound.
- the model: BPE's tokens are spelt with at least one symbol per character covered (a
  byte-fallback token `<0x41>` spells one byte in six); an unknown token fused over a run
  (`fuse_unk`), WordPiece's whole-word unknowns, Unigram and WordLevel cover unbounded runs.
- added tokens match their own content, except those that swallow the whitespace around them
  (`lstrip`/`rstrip`): no bound.
"""

from __future__ import annotations

import math
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from pegainfer.core.text.token_bytes import component_spec

_UNICODE_FORMS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})
_MAX_COMPOSED = 4  # code points that Unicode composition can fold into one
_NEUTRAL_NORMALIZERS = frozenset({"Lowercase", "Prepend"})
_KEEPING_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}
)


def max_chars_per_token(backend: BackendTokenizer) -> int | None:
    """The most characters of input text one token can cover, or None where the pipeline can
    fold an unbounded run of text into one token (or drop it).

    Read from the components themselves, not from the whole `tokenizer.json` (for a 151k-token
    vocabulary, writing and parsing it costs half a second)."""
    shrink = _normalizer_shrink(component_spec(backend.normalizer))
    if shrink is None or not _keeps_text(component_spec(backend.pre_tokenizer)):
        return None
    model = backend.model
    if type(model).__name__ != "BPE" or (model.unk_token and model.fuse_unk):
        return None
    added = backend.get_added_tokens_decoder().values()
    if any(token.lstrip or token.rstrip for token in added):
        return None
    size = backend.get_vocab_size(with_added_tokens=False)
    texts = [backend.id_to_token(i) or "" for i in range(size)] + [t.content for t in added]
    return max(1, max(map(len, texts), default=0)) * shrink


def min_tokens(num_chars: int, chars_per_token: int | None) -> int:
    """A lower bound on the tokens of a text of `num_chars` characters (0: none known)."""
    return 0 if chars_per_token is None else math.ceil(num_chars / chars_per_token)


def _normalizer_shrink(normalizer: dict[str, Any] | None) -> int | None:
    """By how much a normalizer can shorten a text at most, or None if without bound."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            shrink = _normalizer_shrink(part)
            if shrink is None:
                return None
            factor *= shrink
        return factor
    if kind in _UNICODE_FORMS:
        return _MAX_COMPOSED
    if kind in _NEUTRAL_NORMALIZERS:
        return 1
    if kind == "Replace":
        pattern, content = normalizer.get("pattern", {}), normalizer.get("content", "")
        literal = pattern.get("String") if isinstance(pattern, dict) else None
        if not literal or not content:
            return None
        return math.ceil(len(literal) / len(content))
    return None


def _keeps_text(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_text(part) for part in pre_tokenizer.get("pretokenizers", []))
    if kind == "Split":
        return pre_tokenizer.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS
