"""`POST /v1/completions`."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec

from pegainfer.core.engine.frontend import RequestStream, StreamDelta
from pegainfer.core.engine.messages import EngineRequest, TokenLogprob
from pegainfer.server.engine_client import AsyncEngineClient
from pegainfer.server.errors import bad_request
from pegainfer.server.logprobs import LogprobsFormatter, completion_count
from pegainfer.server.openai_serving import (
    choice_params,
    collect,
    encode_text,
    engine_request,
    now,
    request_id,
    reserve,
    sampling_params,
    sse_stream,
    truncated,
    usage,
)
from pegainfer.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)


def _prompts(
    client: AsyncEngineClient, body: CompletionRequest
) -> list[tuple[str | None, list[int]]]:
    """Normalise the four prompt forms to (text, token ids) pairs."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [(prompt, encode_text(client, prompt, body))]
    ids = _token_ids(prompt)  # one prompt of token ids, else a list of prompts
    if ids is not None:
        return [(None, ids)]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    pairs = []
    for item in prompt:
        ids = None if isinstance(item, str) else _token_ids(item)
        if not isinstance(item, str) and ids is None:
            raise bad_request(
                "prompt must be a string, a list of strings, a list of token ids "
                "or a list of token-id lists",
                "prompt",
            )
        pairs.append((item, encode_text(client, item, body)) if ids is None else (None, ids))
    return pairs


def _token_ids(value: object) -> list[int] | None:
    """`value` as a non-empty list of token ids (JSON integers, not booleans), else None.
    Checked in C: a 16k-token prompt costs microseconds, not milliseconds."""
    if not isinstance(value, list) or not value:
        return None
    try:
        return msgspec.convert(value, list[int], strict=True)
    except msgspec.ValidationError:
        return None


def _multiplier(body: CompletionRequest) -> str:
    """The field that made a request several sequences."""
    return "n" if body.n > 1 else "prompt"


class Completions:
    def __init__(self, client: AsyncEngineClient, model_name: str) -> None:
        self.client = client
        self.model_name = model_name
        self.logprobs = LogprobsFormatter(client.frontend.tokenizer)

    def prepare(
        self, body: CompletionRequest
    ) -> tuple[str, list[tuple[EngineRequest, str | None]]]:
        self.logprobs.as_ids = bool(body.return_tokens_as_token_ids)
        if body.top_logprobs is not None:  # chat's field: here it would be ignored
            raise bad_request("completions take logprobs (how many alternatives), not "
                              "top_logprobs", "top_logprobs")  # fmt: skip
        logprobs = completion_count(body.logprobs)
        params = sampling_params(self.client, body, body.max_tokens, logprobs)
        if body.echo and logprobs is not None:  # the echoed prompt's tokens are scored too
            most = max(logprobs, params.prompt_logprobs or 0)
            params = msgspec.structs.replace(params, prompt_logprobs=most)
        copies = choice_params(params, body.n)
        self.client.metrics.record_request_params(body.n)
        rid = request_id("cmpl")
        prompts = []
        for text, ids in _prompts(self.client, body):
            kept = truncated(self.client, ids, body)
            prompts.append((text if kept is ids else None, kept))  # echo decodes what is kept
        # Choice p * n + i is the i-th of the n choices of prompt p.
        pairs = [(text, ids, params) for text, ids in prompts for params in copies]
        requests = [
            (engine_request(self.client, f"{rid}-{i}", ids, params, body), text)
            for i, (text, ids, params) in enumerate(pairs)
        ]
        return rid, requests

    async def create(self, body: CompletionRequest) -> CompletionResponse:
        rid, requests = await self.client.run_frontend(self.prepare, body)
        reservation = reserve(self.client, len(requests), _multiplier(body))
        streams = await collect(self.client, requests, reservation)
        choices = []
        for i, ((request, prompt), stream) in enumerate(zip(requests, streams, strict=True)):
            text, logprobs, _ = self._text_and_logprobs(
                body, request, prompt, stream.text, stream.logprobs, stream.prompt_logprobs, 0
            )
            choice = CompletionChoice(i, text, logprobs, stream.finish_reason, stream.stop_reason)
            if body.return_token_ids:
                choice.token_ids = stream.token_ids
                choice.prompt_token_ids = stream.prompt_token_ids
            if body.prompt_logprobs is not None:
                choice.prompt_logprobs = self.logprobs.prompt(stream.prompt_logprobs or [])
            choices.append(choice)
        return CompletionResponse(rid, now(), self.model_name, choices, usage(streams, body.n))

    async def stream(self, body: CompletionRequest) -> AsyncIterator[bytes]:
        """The SSE stream, once the request is prepared and its slots reserved (a refusal is
        raised here, before any status line)."""
        rid, requests = await self.client.run_frontend(self.prepare, body)
        reservation = reserve(self.client, len(requests), _multiplier(body))
        created = now()
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        # Where each choice's next token starts in its text, for text_offset: counted in
        # tokens, since the streamed text lags them while a stop string may be starting.
        offsets = [0] * len(requests)

        def chunks(index: int, delta: StreamDelta, first: bool) -> list[CompletionResponse]:
            request, prompt = requests[index]
            text, logprobs, offsets[index] = self._text_and_logprobs(
                body, request, prompt if first else None, delta.text, delta.logprobs,
                delta.prompt_logprobs if first else None, offsets[index], echo=first,
            )  # fmt: skip
            choice = CompletionChoice(index, text, logprobs, delta.finish_reason, delta.stop_reason)
            if body.return_token_ids:
                choice.token_ids = delta.token_ids
                if first:
                    choice.prompt_token_ids = request.prompt_token_ids
            return [CompletionResponse(rid, created, self.model_name, [choice])]

        def final(streams: list[RequestStream]) -> CompletionResponse | None:
            if not include_usage:
                return None
            return CompletionResponse(rid, created, self.model_name, [], usage(streams, body.n))

        return sse_stream(self.client, requests, reservation, chunks, final, body)

    def _text_and_logprobs(
        self,
        body: CompletionRequest,
        request: EngineRequest,
        prompt: str | None,
        text: str,
        entries: list[TokenLogprob],
        prompt_entries: list[TokenLogprob] | None,
        offset: int,
        echo: bool = True,
    ) -> tuple[str, CompletionLogprobs | None, int]:
        """A choice's text (after the echoed prompt, where asked and `echo`), its logprobs
        (the prompt's tokens first, then the answer's) and the offset past their last token."""
        first_token = None
        if body.echo and echo:
            if prompt is None:
                skip = request.params.skip_special_tokens
                prompt = self.client.frontend.tokenizer.decode(request.prompt_token_ids, skip)
            text = prompt + text
            if prompt_entries is not None:
                entries, first_token = prompt_entries + entries, request.prompt_token_ids[0]
        if body.logprobs is None:
            return text, None, offset + len(text)
        return text, *self.logprobs.completion(entries, offset, first_token)
