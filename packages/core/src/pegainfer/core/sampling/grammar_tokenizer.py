"""The model's tokenizer as llguidance sees it: what each token spells, which tokens are
special, and how text a grammar forces is tokenized.

llguidance can read a `tokenizer.json` itself, but it then counts every added token written
`<...>` as special, whatever the file's `special` flag says, and marks its bytes as a special
token's (a 0xFF byte first, which no text contains). Qwen's `<think>`, `</think>` and
`<tool_call>` are added tokens with `special: false`: text the model writes in one token and
the detokenizer keeps. Read llguidance's way, a regex or a JSON schema whose text holds
`<think>` fails the request after one token: llguidance tokenizes the text a grammar forces
with the Hugging Face tokenizer, which gives the added token; the mask allows just that token,
and the matcher then refuses it, its bytes not being the text. A special token's text in a
forced string (`<|im_end|>` in a JSON `const`) failed the same way.

So pegainfer builds the table llguidance works from (`llguidance.TokenizerWrapper`'s protocol):
- a token with `special: false` is its text, as any vocabulary token is, so a grammar matches
  it as text and the model may write `<think>` as the one token or in pieces;
- a special token keeps llguidance's mark: no text matches it, and a Lark grammar can still
  name it (`<|im_end|>`); the EOS tokens end an accepted output;
- forced text is tokenized by a copy of the tokenizer that reads special tokens' text as text
  and adds no leading space (SentencePiece's `Prepend`), so the tokens llguidance forces are
  always ones the grammar accepts.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as BackendTokenizer

from pegainfer.core.errors import InvalidRequestError
from pegainfer.core.text.token_bytes import component_spec, token_bytes

if TYPE_CHECKING:
    import llguidance

    from pegainfer.core.text.tokenizer import Tokenizer


_REMEMBERED_TEXTS = 4096  # forced texts whose tokens are kept


class GrammarVocabulary:
    """The tokens' bytes (padded with empty ones to the model's vocabulary), the special ids,
    and the tokenizer of forced text: built once and shared by every `LLTokenizer`."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        """Raises `InvalidRequestError` where the tokenizer cannot serve grammars: the
        request that needs one is refused, and the engine keeps serving the others."""
        tokenizer_json = tokenizer.to_json()
        self._continuation = _continuation_tokenizer(tokenizer_json)
        try:
            table = token_bytes(self._continuation)
        except ValueError as exc:
            raise InvalidRequestError(f"structured output is not available: {exc}") from exc
        if len(table) > vocab_size:
            raise InvalidRequestError(
                f"structured output is not available: the tokenizer has {len(table)} tokens, "
                f"more than the model's vocabulary ({vocab_size})"
            )
        self.tokens = table + [b""] * (vocab_size - len(table))
        self.special_token_ids = sorted(tokenizer.special_token_ids)
        self.eos_token_id = tokenizer.eos_token_id
        # llguidance asks again and again for the same few texts (a schema's forced keys, in
        # every row), holding the GIL from its mask threads: remembered, each costs a lookup.
        self.encode: Callable[[str], tuple[int, ...]] = lru_cache(_REMEMBERED_TEXTS)(self._encode)

    def _encode(self, text: str) -> tuple[int, ...]:
        """The tokens of `text` as it continues an output (special tokens' text is text)."""
        return tuple(self._continuation.encode(text, add_special_tokens=False).ids)

    def llguidance_tokenizer(self, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
        """llguidance's tokenizer for requests that end with `eos_token_ids` (none given: the
        tokenizer's own EOS token)."""
        import llguidance

        eos = eos_token_ids or ([] if self.eos_token_id is None else [self.eos_token_id])
        if not eos:
            raise InvalidRequestError(
                "structured output needs an end-of-sequence token, and neither the request nor "
                "the tokenizer names one",
                "eos_token_id",
            )
        # Slices are llguidance's precomputed token subsets (its default ones).
        return llguidance.LLTokenizer(_Wrapper(self, eos[0]), eos_token=eos)


class _Wrapper:
    """`llguidance.TokenizerWrapper`'s protocol, read once when an `LLTokenizer` is built;
    llguidance calls the object itself (with the GIL) to tokenize forced text."""

    is_tokenizer_wrapper = True
    bos_token_id = None  # llguidance needs it only to tokenize prompts, which it never sees

    def __init__(self, vocabulary: GrammarVocabulary, eos_token_id: int) -> None:
        self.tokens = vocabulary.tokens
        self.special_token_ids = vocabulary.special_token_ids
        self.eos_token_id = eos_token_id
        self._encode = vocabulary.encode

    def __call__(self, text: str) -> tuple[int, ...]:
        return self._encode(text)


def _continuation_tokenizer(tokenizer_json: str) -> BackendTokenizer:
    """The tokenizer of text in the middle of an output: special tokens' text is text, no
    leading space is added (SentencePiece's `Prepend` normalizer and `Metaspace`'s prepend
    scheme), no padding, no truncation."""
    backend = BackendTokenizer.from_str(tokenizer_json)
    normalizer, pre_tokenizer = (component_spec(backend.normalizer),
                                 component_spec(backend.pre_tokenizer))  # fmt: skip
    fixed = _without_prepend(normalizer), _never_prepending(pre_tokenizer)
    if fixed != (normalizer, pre_tokenizer):  # (byte-level tokenizers need no fix)
        spec = json.loads(tokenizer_json)
        spec["normalizer"], spec["pre_tokenizer"] = fixed
        backend = BackendTokenizer.from_str(json.dumps(spec))
    backend.no_padding()
    backend.no_truncation()
    backend.encode_special_tokens = True
    return backend


def _without_prepend(normalizer: dict[str, Any] | None) -> dict[str, Any] | None:
    if normalizer is None or normalizer.get("type") == "Prepend":
        return None
    if normalizer.get("type") == "Sequence":
        steps = [s for s in map(_without_prepend, normalizer["normalizers"]) if s is not None]
        return {**normalizer, "normalizers": steps} if steps else None
    return normalizer


def _never_prepending(pre_tokenizer: dict[str, Any] | None) -> dict[str, Any] | None:
    if pre_tokenizer is None:
        return None
    if pre_tokenizer.get("type") == "Metaspace":
        # (`add_prefix_space`: the scheme's older spelling)
        kept = {k: v for k, v in pre_tokenizer.items() if k != "add_prefix_space"}
        return {**kept, "prepend_scheme": "never"}
    if pre_tokenizer.get("type") == "Sequence":
        steps = [_never_prepending(p) for p in pre_tokenizer["pretokenizers"]]
        return {**pre_tokenizer, "pretokenizers": steps}
    return pre_tokenizer
