"""`POST /v1/chat/completions`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import msgspec

from pegainfer.core.engine.frontend import RequestStream, StreamDelta
from pegainfer.core.engine.messages import EngineRequest
from pegainfer.core.errors import InvalidRequestError
from pegainfer.server.engine_client import AsyncEngineClient
from pegainfer.server.errors import bad_request
from pegainfer.server.logprobs import LogprobsFormatter, chat_count
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
from pegainfer.server.reasoning import ThinkSplitter
from pegainfer.server.structured import forced_tool_calls
from pegainfer.server.tool_calls import ToolCall, ToolCallParser, joined, whole_calls

ROLES = ("system", "developer", "user", "assistant", "tool")


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
        # OpenAI's newer name for system instructions; chat templates know only "system".
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": content or ""}
        if message.tool_calls:
            if message.role != "assistant":
                raise bad_request(f"messages[{i}]: only assistant messages carry tool_calls",
                                  "messages")  # fmt: skip
            entry["tool_calls"] = [template_call(call, f"messages[{i}].tool_calls[{j}]")
                                   for j, call in enumerate(message.tool_calls)]  # fmt: skip
        if message.role == "tool":
            if message.tool_call_id is None:
                raise bad_request(f"messages[{i}]: a tool message needs tool_call_id", "messages")
            entry["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            entry["name"] = message.name
        if message.reasoning_content is not None:
            entry["reasoning_content"] = message.reasoning_content
        rendered.append(entry)
    return rendered


def template_call(call: dict[str, Any], at: str) -> dict[str, Any]:
    """A call in the history as chat templates read it: its arguments an object, not the JSON
    text OpenAI sends (as vLLM passes them: templates such as GLM's iterate over them)."""
    function = call.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{at}.function must be an object", "messages")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise bad_request(f"{at}.function.arguments is not JSON: {exc}", "messages") from exc
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise bad_request(f"{at}.function.arguments must be a JSON object", "messages")
    return call | {"function": function | {"arguments": arguments}}


class AnswerParser:
    """One answer's reasoning, content and tool calls, whole or as its text streams; each
    parser is optional (None: the text is all content)."""

    def __init__(
        self,
        reasoning: Callable[[], ThinkSplitter] | None,
        tool_calls: Callable[[], ToolCallParser] | None,
        max_calls: int | None = None,
    ) -> None:
        self._reasoning = reasoning() if reasoning else None
        self._tools = tool_calls() if tool_calls else None
        # parallel_tool_calls false: calls after the first are dropped, as vLLM drops them.
        self._calls_left = max_calls
        self._dropped: set[int | None] = set()  # indexes of streamed calls left out

    def feed(self, text: str, last: bool) -> tuple[str, str, list[ToolCall]]:
        reasoning, content = ("", text) if self._reasoning is None else self._reasoning.feed(text)
        if last and self._reasoning is not None:
            more_reasoning, more_content = self._reasoning.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        calls: list[ToolCall] = []
        if self._tools is not None:
            content, calls = self._tools.feed(content)
            if last:
                more_content, more_calls = self._tools.finish()
                content, calls = content + more_content, calls + more_calls
            if self._calls_left is not None:
                calls = [call for call in calls if self._keep(call)]
        return reasoning, content, calls

    def _keep(self, call: ToolCall) -> bool:
        """Within max_calls: a call's first piece (with its id) counts, later pieces follow it."""
        if call.id is None:
            return call.index not in self._dropped
        if self._calls_left == 0:
            self._dropped.add(call.index)
            return False
        self._calls_left -= 1
        return True


class Chat:
    def __init__(
        self,
        client: AsyncEngineClient,
        model_name: str,
        reasoning_parser: type[ThinkSplitter] | None = None,
        tool_call_parser: type[ToolCallParser] | None = None,
    ) -> None:
        self.client = client
        self.model_name = model_name
        self.reasoning_parser = reasoning_parser
        self.tool_call_parser = tool_call_parser
        self.logprobs = LogprobsFormatter(client.frontend.tokenizer)

    def prepare(
        self, body: ChatCompletionRequest
    ) -> tuple[str, list[tuple[EngineRequest, str | None]], Callable[[], AnswerParser]]:
        """The response id, the engine requests (one per choice) and a maker of the parser
        each answer goes through."""
        if not body.messages:
            raise bad_request("messages must not be empty", "messages")
        self.logprobs.as_ids = bool(body.return_tokens_as_token_ids)
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        if body.tool_choice == "auto" and body.tools is None:
            raise bad_request('tool_choice "auto" needs tools', "tool_choice")  # as vLLM
        tools = self._tools(body)
        parallel = body.parallel_tool_calls is not False
        forced = forced_tool_calls(tools, body.tool_choice, parallel, self.tool_call_parser)
        logprobs = chat_count(body.logprobs, body.top_logprobs)
        params = sampling_params(self.client, body, max_tokens, logprobs, forced and forced[0])
        if tools and self.tool_call_parser and self.tool_call_parser.needs_special_tokens:
            # The calls are special tokens: the parser reads them in the answer's text.
            params = msgspec.structs.replace(params, skip_special_tokens=False)
        try:
            text = self.client.frontend.chat_prompt(
                template_messages(body.messages),
                add_generation_prompt=body.add_generation_prompt,
                tools=tools,
                chat_template_kwargs=body.chat_template_kwargs,
                continue_final_message=body.continue_final_message,
            )
        except InvalidRequestError as exc:
            raise bad_request(str(exc), exc.param or "messages") from exc
        # The length bound applies to the rendered text: a template may leave content out.
        prompt_ids = truncated(self.client, encode_text(self.client, text, body), body)
        rid = request_id("chatcmpl")
        requests = [
            (engine_request(self.client, f"{rid}-{i}", prompt_ids, p, body), None)
            for i, p in enumerate(choice_params(params, body.n))
        ]
        self.client.metrics.record_request_params(body.n)
        tool_calls = self._tool_call_parser(body, forced)
        max_calls = None if parallel else 1
        reasoning = None
        # An answer held to a grammar from its first token is the grammar's text: none of it
        # is thinking (GLM-5's and Kimi-K2's parsers read an answer as thinking from its
        # first token, and a JSON answer went to reasoning_content, its content empty).
        if self.reasoning_parser is not None and params.structured is None:
            reasoning = partial(self.reasoning_parser.for_request, body.chat_template_kwargs or {})
        return rid, requests, lambda: AnswerParser(reasoning, tool_calls, max_calls)

    def _tools(self, body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
        """The tools the chat template shows the model (none with tool_choice "none")."""
        if not body.tools or body.tool_choice == "none":
            return None
        if self.tool_call_parser is None and body.tool_choice in (None, "auto"):
            raise bad_request("this server parses no tool calls (the model line names no parser, "
                              "or --tool-call-parser none); tools need one", "tools")  # fmt: skip
        for i, tool in enumerate(body.tools):
            function = tool.get("function")
            if (
                tool.get("type") != "function"
                or not isinstance(function, dict)
                or not (isinstance(function.get("name"), str))
            ):
                raise bad_request(f"tools[{i}] must be a function with a name", "tools")
        return body.tools

    def _tool_call_parser(
        self,
        body: ChatCompletionRequest,
        forced: tuple[Any, Callable[[], ToolCallParser]] | None,
    ) -> Callable[[], ToolCallParser] | None:
        """Forced tool calls are read by the parser their constraint names; under "auto" the
        server's tool-call parser finds them in the text."""
        if forced is not None:
            return forced[1]
        if body.tools and body.tool_choice != "none" and self.tool_call_parser:
            return partial(self.tool_call_parser.for_request, body.tools)
        return None

    async def create(self, body: ChatCompletionRequest) -> ChatCompletionResponse:
        rid, requests, answer_parser = await self.client.run_frontend(self.prepare, body)
        streams = await collect(self.client, requests, reserve(self.client, len(requests)))
        choices, reasonings = [], []
        for index, stream in enumerate(streams):
            reasoning, content, pieces = answer_parser().feed(stream.text, last=True)
            calls = whole_calls(pieces)
            if stream.finish_reason == "length" and body.tool_choice not in (None, "auto", "none"):
                # As OpenAI and vLLM answer: a forced call that max_tokens cut short is no call
                # (a stream has sent its pieces by then; its client sees the length).
                calls = [call for call in calls if _is_json(call.arguments)]
            reasonings.append(reasoning)
            shown = reasoning if body.include_reasoning else ""
            message = AssistantMessage(
                "assistant",
                content if content or not calls else None,
                reasoning=shown or None,
                reasoning_content=shown or None,
                tool_calls=[call.as_openai() for call in calls] or None,
            )
            reason = stream.finish_reason
            if calls and reason == "stop":
                reason = "tool_calls"
            logprobs = self.logprobs.chat(stream.logprobs) if body.logprobs else None
            token_ids = stream.token_ids if body.return_token_ids else None
            choices.append(
                ChatChoice(index, message, logprobs, reason, stream.stop_reason, token_ids)
            )
        counted = usage(streams, body.n, self._reasoning_tokens(reasonings))
        response = ChatCompletionResponse(rid, now(), self.model_name, choices, counted)
        if body.return_token_ids:
            response.prompt_token_ids = streams[0].prompt_token_ids
        if body.prompt_logprobs is not None:
            response.prompt_logprobs = self.logprobs.prompt(streams[0].prompt_logprobs or [])
        return response

    def _reasoning_tokens(self, reasonings: list[str]) -> int | None:
        """`completion_tokens_details.reasoning_tokens`: the thinking's text as the tokenizer
        encodes it (the tags are not counted); None without a reasoning parser."""
        if self.reasoning_parser is None:
            return None
        encode = self.client.frontend.tokenizer.encode
        return sum(len(encode(text, add_special_tokens=False)) for text in reasonings if text)

    async def stream(self, body: ChatCompletionRequest) -> AsyncIterator[bytes]:
        """The SSE stream, once the request is prepared and its slots reserved (a refusal is
        raised here, before any status line)."""
        rid, requests, answer_parser = await self.client.run_frontend(self.prepare, body)
        parsers = [answer_parser() for _ in requests]
        reasonings = [""] * len(requests)
        num_calls = [0] * len(requests)
        reservation = reserve(self.client, len(requests))
        created = now()
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        def chunk(
            index: int, delta: DeltaMessage, reason: str | None = None, stop=None, logprobs=None
        ) -> ChatCompletionChunk:
            choice = ChatChunkChoice(index, delta, logprobs, reason, stop)
            return ChatCompletionChunk(rid, created, self.model_name, [choice])

        def chunks(index: int, delta: StreamDelta, first: bool) -> list[ChatCompletionChunk]:
            out = []
            if first:
                out.append(chunk(index, DeltaMessage(role="assistant", content="")))
                if body.return_token_ids:
                    out[0].prompt_token_ids = requests[index][0].prompt_token_ids
            last = delta.finish_reason is not None
            reasoning, content, calls = parsers[index].feed(delta.text, last)
            reasonings[index] += reasoning
            if not body.include_reasoning:
                reasoning = ""
            tool_calls = []
            for call in joined(calls):  # numbered by the parser when it streams, else in order
                number = num_calls[index] if call.index is None else call.index
                if call.id is not None:
                    num_calls[index] += 1
                tool_calls.append(call.as_openai(number))
            reason = delta.finish_reason
            if reason == "stop" and num_calls[index]:
                reason = "tool_calls"
            # A delta whose text is all held back (a tag in pieces) still carries content "":
            # one chunk per token, which benchmarks count as inter-token latencies.
            message = DeltaMessage(content=content, reasoning=reasoning or None,
                                   reasoning_content=reasoning or None,
                                   tool_calls=tool_calls or None)  # fmt: skip
            logprobs = self.logprobs.chat(delta.logprobs) if body.logprobs else None
            out.append(chunk(index, message, reason, delta.stop_reason, logprobs))
            if body.return_token_ids:
                out[-1].choices[0].token_ids = delta.token_ids
            return out

        def final(streams: list[RequestStream]) -> ChatCompletionChunk | None:
            if not include_usage:
                return None
            counted = usage(streams, body.n, self._reasoning_tokens(reasonings))
            return ChatCompletionChunk(rid, created, self.model_name, [], counted)

        return sse_stream(self.client, requests, reservation, chunks, final, body)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
