"""The benchmark's HTTP client: streamed generation requests timed as `vllm bench serve` does.

Payloads, SSE parsing and timing follow vLLM's `benchmarks/lib/endpoint_request_func.py`:
TTFT is the time to the first chunk with a non-empty `choices`, each later choice chunk adds
one inter-token latency, the usage chunk (`choices: []`) gives the prompt and output lengths,
and the end-to-end latency ends at the last choice chunk. A request fails (and keeps the error
text) on an HTTP error, a transport error, an error event in the stream, or a stream without
any choice chunk; it never raises.

One deliberate difference: the chat preamble chunk that only announces the assistant role is
not a token. vLLM's client counts it, which adds a zero ITL sample to every chat request
because servers send it together with the first token.
"""

from __future__ import annotations

import codecs
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

# As vLLM's client: a benchmark request may queue for a long time behind a saturated server.
_TIMEOUT_S = 6 * 60 * 60


@dataclass
class RequestResult:
    """One request as measured by the client. Times are `time.perf_counter()` seconds."""

    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    cached_tokens: int | None = None
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    generated_text: str = ""
    error: str = ""


@dataclass(frozen=True)
class Generation:
    """What every generation request carries besides its prompt."""

    model: str
    max_tokens: int
    ignore_eos: bool = True
    temperature: float = 0.0

    def payload(self, max_tokens_field: str) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "model": self.model,
            max_tokens_field: self.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:  # vLLM's client sends the field only when set
            payload["ignore_eos"] = True
        return payload


class BenchClient:
    """A server under test: its base URL (the root, without /v1) and one connection pool.

    The pool is unbounded: concurrency is the benchmark's to limit, not httpx's (whose default
    of 100 connections would silently cap `--request-rate inf`).
    """

    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(_TIMEOUT_S),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            trust_env=False,  # a proxy between the client and the server would be measured too
        )

    async def __aenter__(self) -> BenchClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def first_model(self) -> str:
        """The first model id the server lists, which `--model` defaults to."""
        response = await self.http.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]

    async def server_version(self) -> str | None:
        try:
            response = await self.http.get("/version")
            response.raise_for_status()
            return response.json()["version"]
        except (httpx.HTTPError, ValueError, KeyError):
            return None

    async def tokenize(self, text: str) -> list[int]:
        """The server's token ids for `text`, without special tokens."""
        body = {"prompt": text, "add_special_tokens": False}
        response = await self.http.post("/tokenize", json=body)
        response.raise_for_status()
        return response.json()["tokens"]

    async def detokenize(self, token_ids: list[int]) -> str:
        response = await self.http.post("/detokenize", json={"tokens": token_ids})
        response.raise_for_status()
        return response.json()["prompt"]

    async def completion(self, prompt: str | list[int], generation: Generation) -> RequestResult:
        """Stream `POST /v1/completions`; `prompt` is text or token ids."""
        payload = generation.payload("max_tokens")
        payload |= {"prompt": prompt, "repetition_penalty": 1.0, "logprobs": None}
        return await self._stream("/v1/completions", payload)

    async def chat(self, messages: list[dict[str, str]], generation: Generation) -> RequestResult:
        """Stream `POST /v1/chat/completions`."""
        payload = generation.payload("max_completion_tokens") | {"messages": messages}
        return await self._stream("/v1/chat/completions", payload)

    async def _stream(self, path: str, payload: dict[str, Any]) -> RequestResult:
        result = RequestResult()
        start = result.start_time = time.perf_counter()
        last = start
        token_chunks = 0
        try:
            async with self.http.stream("POST", path, json=payload) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode(errors="replace")
                    result.error = f"HTTP {response.status_code}: {body}"
                    return result
                async for data in _sse_data(response):
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        result.error = f"error event: {json.dumps(event['error'])}"
                        return result
                    if choices := event.get("choices"):
                        if _is_role_preamble(choices[0]):
                            continue
                        now = time.perf_counter()
                        if token_chunks:
                            result.itl.append(now - last)
                        else:
                            result.ttft = now - start
                        last = now
                        token_chunks += 1
                        result.generated_text += _chunk_text(choices[0])
                    elif usage := event.get("usage"):
                        result.prompt_len = usage["prompt_tokens"]
                        result.output_len = usage["completion_tokens"]
                        details = usage.get("prompt_tokens_details") or {}
                        result.cached_tokens = details.get("cached_tokens")
        except Exception as exc:  # one broken request is a failure to count, not a crash
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        if not token_chunks:
            result.error = "the stream had no chunk with choices"
            return result
        if result.output_len == 0:  # no usage chunk: count the chunks instead
            result.output_len = token_chunks
        result.latency = last - start
        result.success = True
        return result


async def _sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The `data` payloads of an SSE stream: events split on blank lines, comments skipped."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    buffer = ""
    async for chunk in response.aiter_bytes():
        buffer += decoder.decode(chunk)
        *events, buffer = buffer.split("\n\n")
        for event in events:
            for data in _event_data(event):
                yield data
    for data in _event_data(buffer + decoder.decode(b"", final=True)):
        yield data


def _event_data(event: str) -> list[str]:
    return [
        line[len("data:") :].removeprefix(" ")
        for line in event.strip().splitlines()
        if line.startswith("data:")  # skips comments (":...") and other fields
    ]


def _is_role_preamble(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    return (
        delta is not None
        and "role" in delta
        and not delta.get("content")
        and choice.get("finish_reason") is None
    )


def _chunk_text(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""
