"""The message protocol between the frontend (HTTP, offline API) and the engine loop.

Only these msgspec structs cross the boundary, as msgpack bytes, so the loop runs in a thread
of the same process (tests, `engine_loop.EngineLoop`) or in a process of its own (the server:
`process.EngineProcess`) without either side changing.
"""

from __future__ import annotations

import msgspec

from pegainfer.core.sampling.sampling_params import SamplingParams
from pegainfer.core.sampling.structured_output import StructuredOutput


class EngineRequest(msgspec.Struct, kw_only=True, tag=True):
    """A tokenized request, validated by the frontend."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    cache_salt: str | None = None


class AbortRequest(msgspec.Struct, tag=True):
    request_ids: list[str]


class CheckGrammar(msgspec.Struct, tag=True):
    """Compile a grammar against the tokenizer for requests ending in `eos_token_ids`, off the
    step loop, and answer whether it is usable (`GrammarChecked`); the compiled grammar is
    kept for the requests that follow. The server asks before it answers a request with one,
    so a bad grammar is a 400 and the grammar compiles once, in the engine's process."""

    check_id: str
    structured: StructuredOutput
    eos_token_ids: list[int]


class Shutdown(msgspec.Struct, tag=True):
    """Stop the engine loop after the current step."""


Inbound = EngineRequest | AbortRequest | CheckGrammar | Shutdown


class TokenLogprob(msgspec.Struct, array_like=True):
    """A sampled token's logprob and rank (1: the most likely) in the model's distribution,
    and the most likely tokens' (id, logprob), most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


class RequestTiming(msgspec.Struct, frozen=True):
    """Where a finished request's time went on the engine's clock, in seconds (vLLM's split):
    waiting to be scheduled, scheduled to first token, first to last token, scheduled to last;
    and how many times it was preempted on the way."""

    queue: float
    prefill: float
    decode: float
    inference: float
    num_preemptions: int = 0


class RequestOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What one step produced for one request.

    `finish_reason` is "stop" (EOS or a stop token; `stop_token_id` says which),
    "length" (max_tokens or the context filled up), "abort" or "error" (`error` says why).
    `num_cached_tokens` is the prefix-cache hit of the request's first admission.
    """

    request_id: str
    new_token_ids: list[int]
    num_cached_tokens: int
    finish_reason: str | None = None
    stop_token_id: int | None = None
    error: str | None = None
    # On the final output of a request that was scheduled.
    timing: RequestTiming | None = None
    # One per new token, when the request asked for logprobs.
    logprobs: list[TokenLogprob] | None = None
    # With the first token, when asked: prompt tokens 1.. scored by the prompt before them.
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def failure(cls, request_id: str, error: str) -> RequestOutput:
        """The last output of a request that could not be served."""
        return cls(
            request_id=request_id,
            new_token_ids=[],
            num_cached_tokens=0,
            finish_reason="error",
            error=error,
        )


class SpecDecodeStats(msgspec.Struct):
    """Speculative decoding's cumulative counts: verify steps of a request with drafts, drafts
    fed, drafts accepted, and per draft position how often it was accepted (vLLM's
    `spec_decode_*` counters)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = msgspec.field(default_factory=list)


class EngineStats(msgspec.Struct):
    """The engine's state after a step, for metrics. Counters are cumulative."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prefix_cache_hits_host: int = 0  # of prefix_cache_hits, restored from the host tier
    # Tokens (prompt and output) of each step launched since the previous stats.
    step_tokens: list[int] = msgspec.field(default_factory=list)
    spec_decode: SpecDecodeStats | None = None  # with --speculative-tokens


class GrammarChecked(msgspec.Struct, array_like=True):
    """The answer to a `CheckGrammar`: `error` says why the grammar cannot be used (None: it
    compiled)."""

    check_id: str
    error: str | None = None


class EngineOutputs(msgspec.Struct):
    """Everything one engine step (or one batch of inbound messages) produced."""

    outputs: list[RequestOutput]
    stats: EngineStats | None = None
    grammar_checks: list[GrammarChecked] = msgspec.field(default_factory=list)
    # Set on the last message of a loop that failed: every request in flight has ended.
    engine_failed: str | None = None
