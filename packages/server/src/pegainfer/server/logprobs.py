"""Token logprobs in the two shapes OpenAI returns them.

Completions: parallel lists (`tokens`, `token_logprobs`, `top_logprobs` as {token: logprob}
maps, `text_offset`). Chat: `content`, one entry per token with its `bytes` and its
`top_logprobs` list. A token's text is the token decoded alone (special tokens included), so a
character split across tokens shows as U+FFFD in each piece, and `bytes` are that text's UTF-8,
as vLLM reports them.
"""

from __future__ import annotations

from typing import Any

from pegainfer.core.engine.messages import TokenLogprob
from pegainfer.core.sampling.sampling_params import MAX_LOGPROBS
from pegainfer.core.text.tokenizer import Tokenizer
from pegainfer.server.errors import bad_request
from pegainfer.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)


def completion_count(value: Any) -> int | None:
    """Completions' `logprobs`: how many alternatives per token (0: only the sampled one)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad_request("logprobs must be an integer >= 0", "logprobs")
    return value


def chat_count(logprobs: Any, top_logprobs: int | None) -> int | None:
    """Chat's `logprobs` (a switch) and `top_logprobs` (how many alternatives)."""
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad_request("logprobs must be true or false", "logprobs")
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be between 0 and {MAX_LOGPROBS}", "top_logprobs")
    if not logprobs:
        if top_logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return top_logprobs or 0


class LogprobsFormatter:
    """Turns `TokenLogprob`s into either shape, decoding each token id once."""

    def __init__(self, tokenizer: Tokenizer, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        # vLLM's return_tokens_as_token_ids: tokens are named "token_id:N", not by their text.
        self.as_ids = as_ids
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], False)
        return text

    def name(self, token_id: int) -> str:
        """How a token is named in logprobs: its text, or "token_id:N"."""
        return f"token_id:{token_id}" if self.as_ids else self.text(token_id)

    def completion(
        self, entries: list[TokenLogprob], offset: int = 0, first_token: int | None = None
    ) -> tuple[CompletionLogprobs, int]:
        """The logprobs and the offset past their last token. `offset`: where the first
        token's text starts in the choice's text; `first_token`: an echoed prompt's first
        token, which nothing before it scores."""
        logprobs = CompletionLogprobs([], [], [], [])
        if first_token is not None:
            logprobs.tokens.append(self.name(first_token))
            logprobs.token_logprobs.append(None)
            logprobs.top_logprobs.append(None)
            logprobs.text_offset.append(offset)
            offset += len(self.text(first_token))
        for entry in entries:
            logprobs.tokens.append(self.name(entry.token_id))
            logprobs.token_logprobs.append(entry.logprob)
            logprobs.top_logprobs.append(self.top_map(entry))
            logprobs.text_offset.append(offset)
            offset += len(self.text(entry.token_id))
        return logprobs, offset

    def top_map(self, entry: TokenLogprob) -> dict[str, float]:
        """Completions' `{token: logprob}` of one position: the chosen token and then the most
        likely ones (OpenAI: up to logprobs + 1 entries). Tokens that decode alike (byte
        pieces of one character) would share a key; a later one is keyed `token_id:N` instead
        of being lost."""
        top = {self.name(entry.token_id): entry.logprob}
        for token_id, logprob in entry.top:
            if token_id != entry.token_id:
                key = self.name(token_id)
                top[f"token_id:{token_id}" if key in top else key] = logprob
        return top

    def prompt(self, entries: list[TokenLogprob]) -> PromptLogprobs:
        """vLLM's `prompt_logprobs` of a prompt whose tokens after the first are `entries`."""
        scored: PromptLogprobs = [None]
        for entry in entries:
            candidates = {entry.token_id: (entry.logprob, entry.rank)}
            for rank, (token_id, logprob) in enumerate(entry.top, 1):
                candidates.setdefault(token_id, (logprob, rank))
            scored.append({str(token_id): PromptLogprob(logprob, rank, self.name(token_id))
                           for token_id, (logprob, rank) in candidates.items()})  # fmt: skip
        return scored

    def chat(self, entries: list[TokenLogprob]) -> ChatLogprobs:
        def top(token_id: int, logprob: float) -> TopLogprob:
            text = self.name(token_id)
            return TopLogprob(text, logprob, list(text.encode()))

        content = []
        for entry in entries:
            text = self.name(entry.token_id)
            alternatives = [top(t, lp) for t, lp in entry.top]
            content.append(ChatTokenLogprob(text, entry.logprob, list(text.encode()), alternatives))
        return ChatLogprobs(content)
