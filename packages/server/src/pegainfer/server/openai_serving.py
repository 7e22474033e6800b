"""What completions and chat have in common: sampling params, prompts, usage, SSE framing."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec

from pegainfer.core.engine.frontend import RequestStream, StreamDelta
from pegainfer.core.engine.messages import EngineRequest
from pegainfer.core.errors import InvalidRequestError
from pegainfer.core.sampling.sampling_params import SamplingParams
from pegainfer.core.sampling.structured_output import StructuredOutput
from pegainfer.server.engine_client import (
    AsyncEngineClient,
    EngineFailedError,
    Reservation,
    ServerBusyError,
    ShuttingDownError,
)
from pegainfer.server.errors import APIError, bad_request
from pegainfer.server.protocol import (
    CompletionTokensDetails,
    PromptTokensDetails,
    Usage,
    unsupported_fields,
)
from pegainfer.server.structured import constraint_field, requested_output

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids")


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def sampling_params(
    client: AsyncEngineClient,
    request: Any,
    max_tokens: int | None,
    logprobs: int | None = None,
    forced: StructuredOutput | None = None,
) -> SamplingParams:
    """The request's sampling fields over the model's generation defaults, validated.

    `logprobs` is how many alternatives per token the endpoint read from its own fields
    (None: no logprobs). `forced` is the constraint the endpoint itself imposes (chat's
    forced tool calls); it cannot be combined with one the request asks for.
    """
    refused = unsupported_fields(request)
    if request.spaces_between_special_tokens and not request.skip_special_tokens:
        refused.append("spaces_between_special_tokens")
    if refused:
        raise bad_request(
            f"{', '.join(refused)} {'is' if len(refused) == 1 else 'are'} not supported yet",
            refused[0],
        )
    explicit: dict[str, Any] = {
        name: getattr(request, name)
        for name in _SAMPLING_FIELDS
        if getattr(request, name) is not None
    }
    if request.top_k == -1:
        explicit["top_k"] = 0
    if request.repetition_penalty != 1.0:  # else the checkpoint's default, if it has one
        explicit["repetition_penalty"] = request.repetition_penalty
    stop = request.stop
    explicit |= {
        "stop": [stop] if isinstance(stop, str) else list(stop or []),
        # Unset: the checkpoint's max_new_tokens, else until the context is full.
        "max_tokens": max_tokens
        if max_tokens is not None
        else client.frontend.defaults.max_new_tokens,
        "min_tokens": request.min_tokens,
        "ignore_eos": request.ignore_eos,
        "skip_special_tokens": request.skip_special_tokens,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "logit_bias": _logit_bias(request.logit_bias),
        "allowed_token_ids": request.allowed_token_ids,
        "bad_words_token_ids": _bad_words(client, request.bad_words),
        "structured": _structured(request, forced),
        "logprobs": logprobs,
        "prompt_logprobs": request.prompt_logprobs,
    }
    if request.cache_salt == "":
        raise bad_request("cache_salt must be a non-empty string when given", "cache_salt")
    if request.stream_options is not None and not request.stream:
        # As vLLM and OpenAI: the options shape a stream; without one they are a mistake.
        raise bad_request("stream_options can only be set when stream is true", "stream_options")
    if request.prompt_logprobs is not None and request.stream:
        # As vLLM: a prompt's scores come whole, with the first output, not streamed.
        raise bad_request("prompt_logprobs are not available when streaming", "prompt_logprobs")
    params = client.frontend.default_sampling_params(**explicit)
    try:
        return params.validate(client.config.vocab_size)
    except InvalidRequestError as exc:
        param = exc.param
        if param == "max_tokens" and getattr(request, "max_completion_tokens", None) is not None:
            param = "max_completion_tokens"
        raise bad_request(str(exc), param) from exc


def _structured(request: Any, forced: StructuredOutput | None) -> StructuredOutput | None:
    requested = requested_output(request)
    if requested is None:
        return forced
    if forced is not None:
        raise bad_request(f"tool_choice cannot be combined with {requested[0]}", requested[0])
    return requested[1]


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as strings; every key that is not one is
    named in the error, not only the first."""
    bias = bias or {}
    wrong = [token for token in bias if not token.strip().lstrip("-").isdigit()]
    if wrong:
        names = ", ".join(repr(token) for token in wrong)
        raise bad_request(f"logit_bias keys must be token ids, not {names}", "logit_bias")
    return {int(token): float(value) for token, value in bias.items()}


def _bad_words(client: AsyncEngineClient, words: list[str] | None) -> list[list[int]]:
    """Each bad word's tokens as it would start the text and as it would follow a space (BPE
    tokenizers spell the two differently), as vLLM bans them."""
    encode = client.frontend.tokenizer.encode
    found: list[list[int]] = []
    for word in words or []:
        if not word.strip():
            raise bad_request("bad_words must not be empty or blank", "bad_words")
        for spelling in (word.lstrip(), " " + word.lstrip()):
            ids = encode(spelling, add_special_tokens=False)
            if ids not in found:
                found.append(ids)
    return found


def engine_request(
    client: AsyncEngineClient,
    rid: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    body: Any,
) -> EngineRequest:
    """The request for the engine, checked as the engine will check it (its grammar by the
    engine itself, which compiles it: `AsyncEngineClient.check_grammar`), so a bad one is a
    400, never a failure mid-stream."""
    request = client.frontend.make_request(rid, prompt_token_ids, params)
    request.cache_salt = body.cache_salt
    try:
        client.limits.check(request)
    except InvalidRequestError as exc:
        param = exc.param
        if params.structured is not None and param == params.structured.kind:
            param = constraint_field(body)  # the grammar's kind is no field the client sent
        raise bad_request(str(exc), param) from exc
    return request


def encode_text(client: AsyncEngineClient, text: str, body: Any) -> list[int]:
    """A prompt's text as tokens, with the tokenizer's special tokens where the request's
    `add_special_tokens` asks (chat's is always false: its template writes them, and true is
    refused). Unless the request truncates its prompt, one that cannot fit the context is
    refused before it is tokenized, by a lower bound on its tokens from its length
    (`Tokenizer.min_tokens`): a 10 MB prompt costs microseconds, not seconds."""
    tokenizer = client.frontend.tokenizer
    if body.truncate_prompt_tokens is None:
        try:
            client.limits.check_prompt_length(tokenizer.min_tokens(text), at_least=True)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), exc.param) from exc
    return tokenizer.encode(text, body.add_special_tokens)


def truncated(client: AsyncEngineClient, ids: list[int], body: Any) -> list[int]:
    """A prompt's tokens after vLLM's `truncate_prompt_tokens`: the last k (the first k with
    `truncation_side` "right"); -1 keeps as many as the context holds."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return ids
    limit = client.config.max_model_len
    if keep == -1:
        keep = limit
    if not 1 <= keep <= limit:
        raise bad_request(
            f"truncate_prompt_tokens must be -1 or between 1 and the context ({limit}), got {keep}",
            "truncate_prompt_tokens",
        )
    if len(ids) <= keep:
        return ids
    return ids[:keep] if body.truncation_side == "right" else ids[-keep:]


def usage(
    streams: Sequence[RequestStream], n: int = 1, reasoning_tokens: int | None = None
) -> Usage:
    """Token counts of a response; with `n` choices per prompt (streams grouped by prompt),
    each prompt counts once, as OpenAI counts it."""
    prompt = sum(len(s.prompt_token_ids) for s in streams[::n])
    completion = sum(len(s.token_ids) for s in streams)
    cached = sum(s.num_cached_tokens for s in streams[::n])
    details = None if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens)
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached), details)


def _before_tokens(counted: Usage, num_tokens: int) -> Usage:
    """`counted` as it stood `num_tokens` completion tokens earlier."""
    completion = counted.completion_tokens - num_tokens
    return msgspec.structs.replace(
        counted, completion_tokens=completion, total_tokens=counted.prompt_tokens + completion
    )


MAX_N = 64


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling parameters of `n` choices of one prompt: a request's seed is spread over
    its choices (seed, seed + 1, ...), so seeded choices differ and stay reproducible."""
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {n}", "n")
    if params.seed is None:
        return [params] * n
    return [msgspec.structs.replace(params, seed=_wrap_seed(params.seed + i)) for i in range(n)]


def _wrap_seed(seed: int) -> int:
    return (seed + 2**63) % 2**64 - 2**63


class ClientTooSlowError(RuntimeError):
    """The client read its stream too slowly: the response was ended."""


async def merged(
    client: AsyncEngineClient,
    requests: Sequence[tuple[EngineRequest, str | None]],
    reservation: Reservation,
) -> AsyncIterator[tuple[int, RequestStream, StreamDelta]]:
    """Stream several requests at once, tagging each delta with its request's index.

    Past `client.max_unsent_tokens` tokens waiting for the consumer (a stream's client that
    stopped reading) the response ends with `ClientTooSlowError` and its requests are aborted:
    such a client cannot make the server hold an ever larger answer (one n=64, logprobs=20
    stream grew it by 216 MB). Tokens, not deltas: a consumer that falls behind gets several
    tokens in one delta, so a count of deltas bounds nothing."""
    queue: asyncio.Queue[tuple[int, RequestStream, StreamDelta] | BaseException | None] = (
        asyncio.Queue()
    )
    unsent = 0  # tokens in `queue` (a delta without any counts as one)

    async def pump(index: int, request: EngineRequest, prompt: str | None) -> None:
        nonlocal unsent
        try:
            # Closed on leaving the loop, which aborts the request.
            async with contextlib.aclosing(client.generate(request, reservation, prompt)) as out:
                async for stream, delta in out:
                    if unsent >= client.max_unsent_tokens:
                        raise ClientTooSlowError(
                            f"the client read its stream too slowly ({unsent} tokens were "
                            "waiting): the answer was ended"
                        )
                    unsent += max(1, len(delta.token_ids))
                    queue.put_nowait((index, stream, delta))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            queue.put_nowait(exc)
            return
        queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, r, p)) for i, (r, p) in enumerate(requests)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                unsent -= max(1, len(item[2].token_ids))
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def translate_engine_errors(
    exc: ServerBusyError | EngineFailedError | ClientTooSlowError,
) -> APIError:
    if isinstance(exc, ServerBusyError):
        return APIError(
            503, f"server busy: {exc}", code="server_busy", headers={"Retry-After": "1"}
        )
    if isinstance(exc, ClientTooSlowError):
        return APIError(400, str(exc), code="client_too_slow")
    if isinstance(exc, ShuttingDownError):
        return APIError(503, str(exc), code="shutting_down")
    return APIError(500, str(exc), code="engine_error")


def reserve(client: AsyncEngineClient, num_requests: int, param: str = "n") -> Reservation:
    """Reserve waiting slots before answering, so a refusal is a 503, never a broken stream.

    A request needing more slots than the server has can never be admitted: a 400 naming
    `param` (what multiplied the requests), as retrying after a 503 would never help.
    """
    if num_requests > client.max_waiting:
        raise bad_request(
            f"this request makes {num_requests} sequences (prompts times n), but at most "
            f"{client.max_waiting} may wait at once on this server (--max-waiting-requests)",
            param,
        )
    try:
        return client.reserve(num_requests)
    except (ServerBusyError, EngineFailedError) as exc:
        raise translate_engine_errors(exc) from exc


async def collect(
    client: AsyncEngineClient,
    requests: Sequence[tuple[EngineRequest, str | None]],
    reservation: Reservation,
) -> list[RequestStream]:
    """Run requests to completion; raise the `APIError` an engine failure maps to."""
    streams: dict[int, RequestStream] = {}
    try:
        async for index, stream, _ in merged(client, requests, reservation):
            streams[index] = stream
    except (ServerBusyError, EngineFailedError) as exc:
        raise translate_engine_errors(exc) from exc
    return [streams[i] for i in range(len(requests))]


def sse(payload: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def sse_stream(
    client: AsyncEngineClient,
    requests: Sequence[tuple[EngineRequest, str | None]],
    reservation: Reservation,
    chunks: Callable[[int, StreamDelta, bool], list[Any]],
    final: Callable[[list[RequestStream]], msgspec.Struct | None],
    body: Any,
) -> AsyncIterator[bytes]:
    """SSE bytes: `chunks(index, delta, first)` per delta, then `final(streams)`, then [DONE].

    With `stream_options.continuous_usage_stats` (and include_usage) every chunk carries its
    choice's usage so far, as vLLM's do. An engine failure mid-stream becomes an error event
    (the status line is already sent).
    """
    options = body.stream_options
    continuous = options is not None and options.include_usage and options.continuous_usage_stats
    streams: dict[int, RequestStream] = {}
    try:
        async for index, stream, delta in merged(client, requests, reservation):
            first = index not in streams
            streams[index] = stream
            out = chunks(index, delta, first)
            for position, chunk in enumerate(out):
                if continuous:
                    chunk.usage = usage([stream])
                    if position < len(out) - 1:  # chat's role chunk: before the delta's tokens
                        chunk.usage = _before_tokens(chunk.usage, len(delta.token_ids))
                yield sse(chunk)
    except (ServerBusyError, EngineFailedError, ClientTooSlowError) as exc:
        yield b"data: " + translate_engine_errors(exc).body() + b"\n\n"
        yield SSE_DONE
        return
    last = final([streams[i] for i in sorted(streams)])
    if last is not None:
        yield sse(last)
    yield SSE_DONE
