"""Tokenizing a prompt one special-token-delimited segment at a time, with the long segments'
ids kept: a conversation's next turn re-sends its whole history, and only its new messages
are tokenized again.

This is exact, not an approximation. A `tokenizers.Tokenizer` first cuts its input at every
added token that is matched on the raw text (`normalized: false`), then normalizes,
pre-tokenizes and runs the model on each piece by itself: no merge, regex split or
normalization crosses such a token. A chat template writes its markers (`<|im_start|>`,
`<|im_end|>`, ...) as exactly such tokens, so the text between two of them tokenizes to the
same ids whatever surrounds it. `SegmentCache.for_tokenizer` refuses (returns None) the
tokenizers where that does not hold: a pre-tokenizer that looks at where a piece starts in the
whole text (Metaspace's `prepend_scheme: first`), a pre-tokenizer type not known here, an added
token matched as a single word, or raw-matched added tokens that strip whitespace and whose
texts overlap a marker's (the tokenizer picks the leftmost-longest match among all raw-matched
tokens, which a split on the markers alone could miss). Only prompts tokenized without the
post-processor (`add_special_tokens=False`, as chat prompts are) go through it.

The ids of segments of at least `min_chars` characters are kept by a 16-byte digest of their
text, least recently used first out, up to `max_tokens` ids in all (4 bytes each: 4 MiB by
default); the misses of one prompt are tokenized in one batch call, with the GIL released and
across tokenizers' threads.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from array import array
from collections import OrderedDict
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

# Pre-tokenizers that treat every piece alike, wherever it starts in the text.
_PIECEWISE_PRE_TOKENIZERS = frozenset(
    {
        "BertPreTokenizer",
        "ByteLevel",
        "CharDelimiterSplit",
        "Digits",
        "Punctuation",
        "Split",
        "UnicodeScripts",
        "Whitespace",
        "WhitespaceSplit",
    }
)


class SegmentCache:
    """Token ids of a text, tokenized per segment between markers, long segments' ids kept."""

    def __init__(
        self,
        backend: BackendTokenizer,
        markers: list[str],
        *,
        min_chars: int = 256,
        max_tokens: int = 1 << 20,
    ) -> None:
        self._backend = backend
        # Longest first: at one position the alternation takes the longest marker, as the
        # tokenizer's leftmost-longest match does.
        alternation = "|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True))
        self._split = re.compile(f"({alternation})").split
        self._marker_ids = {m: backend.token_to_id(m) for m in markers}
        self.min_chars = min_chars
        self.max_tokens = max_tokens
        self._kept: OrderedDict[bytes, array] = OrderedDict()  # by _digest of the text
        self._kept_tokens = 0
        self._lock = threading.Lock()  # the server tokenizes on a thread pool

    @classmethod
    def for_tokenizer(cls, backend: BackendTokenizer, **kwargs: Any) -> SegmentCache | None:
        """A cache for `backend`, or None where tokenizing per segment could differ from
        tokenizing the whole text (see the module's docstring)."""
        if getattr(backend, "encode_special_tokens", False):  # added tokens cut nothing
            return None
        pre_tokenizer = backend.pre_tokenizer
        if pre_tokenizer is not None and not _pieces_alike(
            json.loads(pre_tokenizer.__getstate__())
        ):
            return None
        added = list(backend.get_added_tokens_decoder().values())
        if any(t.single_word for t in added):
            return None
        # The tokens matched on the raw text, all in one pass; those matched after
        # normalization are matched inside each piece, by the backend itself.
        raw = [t for t in added if not t.normalized]
        markers = [t.content for t in raw if not (t.lstrip or t.rstrip)]
        others = [t.content for t in raw if t.lstrip or t.rstrip]
        if not markers or any(_overlap(m, o) for m in markers for o in others):
            return None
        return cls(backend, markers, **kwargs)

    @property
    def markers(self) -> list[str]:
        """The added tokens' texts the prompt is cut at."""
        return list(self._marker_ids)

    @property
    def kept_tokens(self) -> int:
        """Ids kept in all, over the kept segments."""
        return self._kept_tokens

    def __contains__(self, segment: str) -> bool:
        """Whether `segment`'s ids are kept."""
        with self._lock:
            return _digest(segment) in self._kept

    def encode(self, text: str) -> list[int]:
        """`backend.encode(text, add_special_tokens=False).ids`, segment by segment."""
        parts = self._split(text)  # texts at even indices, markers at odd ones
        digests = {i: _digest(parts[i]) for i in range(0, len(parts), 2)
                   if len(parts[i]) >= self.min_chars}  # fmt: skip
        found: dict[int, array] = {}
        with self._lock:
            for i, digest in digests.items():
                ids = self._kept.get(digest)
                if ids is not None:
                    self._kept.move_to_end(digest)
                    found[i] = ids
        missing = [i for i in range(0, len(parts), 2) if i not in found and parts[i]]
        if missing:
            encodings = self._backend.encode_batch(
                [parts[i] for i in missing], add_special_tokens=False
            )
            for i, encoding in zip(missing, encodings, strict=True):
                found[i] = array("i", encoding.ids)
            self._keep([(digests[i], found[i]) for i in missing if i in digests])
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                ids.append(self._marker_ids[part])
            elif part:
                ids.extend(found[i])
        return ids

    def _keep(self, segments: list[tuple[bytes, array]]) -> None:
        with self._lock:
            for digest, ids in segments:
                if len(ids) > self.max_tokens or digest in self._kept:
                    continue
                self._kept[digest] = ids
                self._kept_tokens += len(ids)
                while self._kept_tokens > self.max_tokens:
                    _, dropped = self._kept.popitem(last=False)
                    self._kept_tokens -= len(dropped)


def _digest(text: str) -> bytes:
    """A segment's key: 16 bytes kept instead of its text (128 bits: no collision in any
    cache's life)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _pieces_alike(pre_tokenizer: dict[str, Any]) -> bool:
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_pieces_alike(p) for p in pre_tokenizer.get("pretokenizers", []))
    if kind == "Metaspace":  # "first" prepends to the piece at offset 0 of the whole text only
        return pre_tokenizer.get("prepend_scheme", "always") != "first"
    return kind in _PIECEWISE_PRE_TOKENIZERS


def _overlap(marker: str, other: str) -> bool:
    """Whether an occurrence of `other` can share characters with one of `marker`."""
    if marker in other or other in marker:
        return True
    shortest = min(len(marker), len(other))
    return any(marker.endswith(other[:k]) or other.endswith(marker[:k]) for k in range(1, shortest))
