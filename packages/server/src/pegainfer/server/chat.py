"""`POST /v1/chat/completions`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pegainfer.core.errors import InvalidRequestError
from pegainfer.core.frontend import RequestStream, StreamDelta
from pegainfer.core.messages import EngineRequest
from pegainfer.server.engine_client import AsyncEngineClient
from pegainfer.server.errors import bad_request
from pegainfer.server.openai_serving import (
    collect,
    engine_request,
    now,
    request_id,
    reserve,
    sampling_params,
    sse_stream,
    usage,
)
from pegainfer.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    DeltaMessage,
    ImagePart,
)
from pegainfer.server.reasoning import REASONING_PARSERS, split_reasoning

ROLES = ("system", "developer", "user", "assistant")


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: roles checked, text parts joined."""
    rendered = []
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise bad_request(
                f"messages[{i}].role {message.role!r} is not supported; use one of {ROLES}",
                "messages",
            )
        content = message.content
        if isinstance(content, list):
            if any(isinstance(part, ImagePart) for part in content):
                raise bad_request("this model accepts text only, not images", "messages")
            content = "".join(part.text for part in content)  # type: ignore[union-attr]
        if message.tool_calls or message.tool_call_id is not None:
            raise bad_request(
                f"messages[{i}]: tool calls in the conversation are not supported yet",
                "messages",
            )
        entry: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        if message.reasoning_content is not None:
            entry["reasoning_content"] = message.reasoning_content
        rendered.append(entry)
    return rendered


class Chat:
    def __init__(
        self, client: AsyncEngineClient, model_name: str, reasoning_parser: str | None = None
    ) -> None:
        self.client = client
        self.model_name = model_name
        self.reasoning_parser = reasoning_parser

    def prepare(self, body: ChatCompletionRequest) -> tuple[str, EngineRequest]:
        if not body.messages:
            raise bad_request("messages must not be empty", "messages")
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        params = sampling_params(self.client, body, max_tokens)
        try:
            prompt_ids = self.client.frontend.render_chat(
                template_messages(body.messages),
                add_generation_prompt=body.add_generation_prompt,
                chat_template_kwargs=body.chat_template_kwargs,
            )
        except InvalidRequestError as exc:
            raise bad_request(str(exc), exc.param or "messages") from exc
        rid = request_id("chatcmpl")
        return rid, engine_request(self.client, rid, prompt_ids, params, body.cache_salt)

    async def create(self, body: ChatCompletionRequest) -> ChatCompletionResponse:
        rid, request = self.prepare(body)
        (stream,) = await collect(self.client, [(request, None)], reserve(self.client, 1))
        if self.reasoning_parser is None:
            message = AssistantMessage("assistant", stream.text)
        else:
            reasoning, content = split_reasoning(self.reasoning_parser, stream.text)
            message = AssistantMessage("assistant", content, reasoning)
        choice = ChatChoice(0, message, None, stream.finish_reason, stream.stop_reason)
        return ChatCompletionResponse(rid, now(), self.model_name, [choice], usage([stream]))

    def stream(self, body: ChatCompletionRequest) -> AsyncIterator[bytes]:
        rid, request = self.prepare(body)
        reservation = reserve(self.client, 1)
        created = now()
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        def chunk(delta: DeltaMessage, reason: str | None = None, stop=None) -> ChatCompletionChunk:
            choice = ChatChunkChoice(0, delta, None, reason, stop)
            return ChatCompletionChunk(rid, created, self.model_name, [choice])

        splitter = (
            None if self.reasoning_parser is None else REASONING_PARSERS[self.reasoning_parser]()
        )

        def chunks(index: int, delta: StreamDelta, first: bool) -> list[ChatCompletionChunk]:
            out = [chunk(DeltaMessage(role="assistant", content=""))] if first else []
            if splitter is None:
                message = DeltaMessage(content=delta.text)
            else:
                reasoning, content = splitter.feed(delta.text)
                if delta.finish_reason is not None:
                    rest_reasoning, rest_content = splitter.finish()
                    reasoning, content = reasoning + rest_reasoning, content + rest_content
                # A delta whose text is all held back (a tag in pieces) still carries content
                # "" so that a final chunk keeps its finish_reason.
                message = DeltaMessage(content=content, reasoning_content=reasoning or None)
            out.append(chunk(message, delta.finish_reason, delta.stop_reason))
            return out

        def final(streams: list[RequestStream]) -> ChatCompletionChunk | None:
            if not include_usage:
                return None
            return ChatCompletionChunk(rid, created, self.model_name, [], usage(streams))

        return sse_stream(self.client, [(request, None)], reservation, chunks, final)
