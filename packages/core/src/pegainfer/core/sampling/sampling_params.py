"""Per-request sampling and stopping parameters.

A msgspec struct, so it crosses the engine's message boundary unchanged. `validate` is the
single place where out-of-range values are rejected; the engine trusts validated params.
"""

from __future__ import annotations

import math

import msgspec

from pegainfer.core.errors import InvalidRequestError
from pegainfer.core.sampling.structured_output import StructuredOutput

# Every integer must fit the engine's message encoding (msgpack) and torch's 64-bit seeds.
_MAX_INT = 2**63 - 1
# Below this temperature sampling is greedy (dividing logits by it would overflow).
MIN_TEMPERATURE = 1e-5
# Any top_k beyond the vocabulary means "no limit"; the bound keeps it a 32-bit integer.
_MAX_TOP_K = 2**31 - 1
#: Most alternatives a request may ask logprobs for, per token (OpenAI's chat limit).
MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to pick tokens and when to stop. Defaults follow vLLM's `SamplingParams`.

    temperature 0 (or below 1e-5, where scaling would overflow) means greedy. `top_k` <= 0
    and `top_p` 1 disable those filters.
    `max_tokens` None means "until the context is full".
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    #: OpenAI's penalties on the output so far (counts and presence), and the multiplicative
    #: repetition penalty on every token seen, prompt included (as vLLM applies it).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    #: Added to the logits of these token ids before any other processing (OpenAI's range).
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    #: What the output must match (a JSON schema, a regex, a grammar, a choice).
    structured: StructuredOutput | None = None
    #: Report each sampled token's logprob (of the model's own distribution, before any
    #: sampling transform) and the `logprobs` most likely tokens' beside it; None: none.
    logprobs: int | None = None
    #: The same for every prompt token after the first (the prompt is then never read from the
    #: prefix cache: its logits are needed).
    prompt_logprobs: int | None = None
    #: Only these tokens may be sampled (vLLM's `allowed_token_ids`); None: any.
    allowed_token_ids: list[int] | None = None
    #: Token sequences the output must not contain (vLLM's `bad_words`, as token ids): a
    #: sequence's last token is banned wherever the output so far ends with the rest of it.
    bad_words_token_ids: list[list[int]] = msgspec.field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def restricts_tokens(self) -> bool:
        """Whether tokens are kept from the sampler whatever their logits (`allowed_token_ids`,
        `bad_words`)."""
        return self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise `InvalidRequestError` naming the first bad field; return self when all are good."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be a finite number >= 0, got {self.temperature}", "temperature"
            )
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not (-1 <= self.top_k <= _MAX_TOP_K):
            raise InvalidRequestError(
                f"top_k must be -1 or 0 (disabled) or a positive integer up to {_MAX_TOP_K}, "
                f"got {self.top_k}",
                "top_k",
            )
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.seed is not None and not (-_MAX_INT - 1 <= self.seed <= _MAX_INT):
            raise InvalidRequestError("seed must fit in a signed 64-bit integer", "seed")
        if self.max_tokens is not None and not (1 <= self.max_tokens <= _MAX_INT):
            raise InvalidRequestError(
                f"max_tokens must be between 1 and {_MAX_INT}, got {self.max_tokens}", "max_tokens"
            )
        if not (0 <= self.min_tokens <= _MAX_INT):
            raise InvalidRequestError(
                f"min_tokens must be between 0 and {_MAX_INT}, got {self.min_tokens}", "min_tokens"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                "min_tokens",
            )
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty", "stop")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (0 <= value <= MAX_LOGPROBS):
                raise InvalidRequestError(
                    f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}", name
                )
        if self.structured is not None and (self.ignore_eos or self.min_tokens):
            # The grammar ends the output with an EOS token; these forbid it.
            field = "ignore_eos" if self.ignore_eos else "min_tokens"
            raise InvalidRequestError(f"{field} cannot be combined with structured output", field)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}", name)
        if not (math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0):
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
                "repetition_penalty",
            )
        if any(not (math.isfinite(b) and -100.0 <= b <= 100.0) for b in self.logit_bias.values()):
            raise InvalidRequestError("logit_bias values must be in [-100, 100]", "logit_bias")
        # Token ids: in the vocabulary when it is known, else at least non-negative and encodable.
        limit = _MAX_INT + 1 if vocab_size is None else vocab_size
        where = "the vocabulary" if vocab_size is not None else "the token id range"
        outside = sorted(t for t in self.logit_bias if not (0 <= t < limit))
        if outside:
            raise InvalidRequestError(
                f"logit_bias token ids {outside[:5]} are outside {where} [0, {limit})",
                "logit_bias",
            )
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("bad_words", [t for word in self.bad_words_token_ids for t in word]),
        ):
            bad = [t for t in ids if not (0 <= t < limit)]
            if bad:
                raise InvalidRequestError(
                    f"{name} {bad[:5]} are outside {where} [0, {limit})", name
                )
        if self.allowed_token_ids == []:
            raise InvalidRequestError("allowed_token_ids must not be empty", "allowed_token_ids")
        if any(not word for word in self.bad_words_token_ids):
            raise InvalidRequestError("bad_words must not be empty", "bad_words")
        return self
