"""Incremental detokenization with stop strings, for streaming one request's output.

Decoding each new token on its own is wrong in two ways: a multi-byte character split across
tokens would come out as U+FFFD, and tokenizers whose decoders look at neighbouring tokens (e.g.
SentencePiece's leading-space handling) would drop or add spaces. So, as vLLM and TGI do, each step
decodes a short window of recent tokens twice, with and without the new ones, and emits only the
difference, holding it back while it ends in U+FFFD (an incomplete character).

Stop strings are matched on the decoded text. The emitted text never contains a stop string nor
any part of one: a tail that could be the start of a stop string is held back until the next
tokens show that it is not.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from pegainfer.core.text.tokenizer import Tokenizer

# How many prompt tokens give the first generated tokens their decoding context.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class DetokenizedDelta(msgspec.Struct, frozen=True):
    """Text that became safe to emit, whether a stop string ended the output, and how many of
    the pushed tokens were read (after the one that completed a stop string, none are)."""

    text: str
    finished: bool = False
    num_tokens: int = 0


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text, a few tokens at a time.

    Tokens are processed one by one even when pushed in batches, so the output text and the point
    where a stop string ends it do not depend on how the ids were chunked. Once everything is
    pushed and flushed, `output_text` equals `tokenizer.decode(output_ids)` (cut before the stop
    string, if one matched) for byte-level BPE tokenizers like Qwen's.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        min_tokens: int = 0,
        include_stop: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop  # keep the matched stop string at the end
        self._min_tokens = min_tokens

        # The window context: the last few prompt tokens, unless they end inside a character
        # (prompts given as token ids can), which would make the first window's text inconsistent.
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if self._decode(context).endswith(_REPLACEMENT_CHAR):
            context = []
        self._ids = context
        # Text of ids[prefix_offset:read_offset] was emitted already; the window starts there.
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_generated = 0

        # Decoded text is emitted, or pending while it may be the start of a stop string. Only
        # the pending tail is ever searched, so long outputs cost no more per token than short.
        self._emitted: list[str] = []
        self._pending = ""
        self.stop_reason: str | None = None

    @property
    def output_text(self) -> str:
        """All text emitted so far."""
        return "".join(self._emitted)

    @property
    def finished(self) -> bool:
        """Whether a stop string ended the output."""
        return self.stop_reason is not None

    def push(self, new_token_ids: Sequence[int]) -> DetokenizedDelta:
        """Add generated tokens; return the text that is now safe to emit.

        After a stop string matched, further tokens are ignored and `finished` stays True.
        """
        read = 0
        for token_id in new_token_ids:
            if self.finished:
                break
            self._ids.append(token_id)
            self._num_generated += 1
            read += 1
            self._append_text(self._decode_step(final=False))
        return DetokenizedDelta(self._release(), self.finished, read)

    def flush(self) -> str:
        """At the end of generation, return the text still held back.

        That is an incomplete character at the very end (emitted as U+FFFD, as a full decode
        would) and any tail that looked like the start of a stop string. A stop string completed
        by the flushed text still cuts the output.
        """
        if not self.finished:
            self._append_text(self._decode_step(final=True))
        return self._release(final=True)

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_step(self, *, final: bool) -> str:
        """The text the tokens since `read_offset` add, or "" while it may be incomplete."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return ""
        if new_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]

    def _append_text(self, text: str) -> None:
        """Add newly decoded text and cut the output at a stop string it completes."""
        if not text:
            return
        start = len(self._pending)
        self._pending += text
        if not self._stop or self._num_generated < self._min_tokens:
            return
        # A new match ends inside the new text, and starts inside the pending text: emitted text
        # never ends with the start of a stop string. The match completed first, reading character
        # by character, wins (the longest on a tie), so tokenization does not change the result.
        matches = []
        for s in self._stop:
            index = self._pending.find(s, max(0, start - len(s) + 1))
            if index >= 0:
                matches.append((index + len(s), index, s))
        if matches:
            _, index, s = min(matches)
            self._pending = self._pending[: index + len(s) * self._include_stop]
            self.stop_reason = s

    def _release(self, *, final: bool = False) -> str:
        """Emit the pending text, except a tail that may be the start of a stop string."""
        hold = 0 if final or self.finished else self._stop_prefix_length()
        delta = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(delta) :]
        if delta:
            self._emitted.append(delta)
        return delta

    def _stop_prefix_length(self) -> int:
        """Length of the longest tail of the pending text that is a proper prefix of a stop string.

        Looking at the pending text suffices: a longer such tail would have been held already.
        """
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(s[:n]):
                    longest = n
                    break
        return longest
