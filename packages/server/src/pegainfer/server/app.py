"""The starlette application: routes, authentication, body limits and error mapping."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from pegainfer.core.errors import InvalidRequestError
from pegainfer.core.kv.kv_events import KVEventsConfig, endpoint_for_rank
from pegainfer.server.chat import Chat, template_messages
from pegainfer.server.completions import Completions
from pegainfer.server.engine_client import AsyncEngineClient, EngineFailedError, ServerBusyError
from pegainfer.server.errors import APIError, bad_request
from pegainfer.server.openai_serving import translate_engine_errors
from pegainfer.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    KVEventSource,
    Load,
    ModelCard,
    ModelInfo,
    ModelList,
    ServerInfo,
    TokenizeRequest,
    TokenizeResponse,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Fields clients send that change nothing: accepted without a warning.
_INFORMATIONAL = {"user", "metadata", "store", "service_tier"}


@dataclass
class ServerState:
    """What the routes share. `client` stays None until the engine can serve."""

    model_names: list[str]
    api_key: str | None = None
    max_body_bytes: int = 32 << 20
    client: AsyncEngineClient | None = None
    startup_error: str | None = None
    started_at: int = field(default_factory=lambda: int(time.time()))
    logged_unknown_fields: set[str] = field(default_factory=set)
    # Parser classes (parsers.py), set once the model line is known: one splits chat answers
    # into reasoning and content, the other turns function calls in them into tool_calls.
    reasoning_parser: Any = None
    tool_call_parser: Any = None
    # Requests by route and status class, refusals before the engine included (vLLM's
    # http_requests_total): what came in balances what the engine finished plus the refused.
    http_registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    # The engine's parallel layout, for /get_server_info.
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # The engine's --kv-events-config when it publishes, for /kv_event_sources.
    kv_events: KVEventsConfig | None = None

    def ready_client(self) -> AsyncEngineClient:
        if self.client is None:
            raise APIError(503, "the model is still loading", code="not_ready")
        if not self.client.alive:
            raise APIError(503, "the engine has stopped", code="engine_dead")
        if self.client.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        return self.client


def _json(payload: msgspec.Struct | dict[str, Any], status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status, media_type="application/json")


def build_app(state: ServerState) -> Starlette:
    async def read_json(request: Request) -> dict[str, Any]:
        content_type = request.headers.get("content-type")
        if content_type is not None and not _is_json(content_type):
            # As vLLM: a form (curl -d without a header) is refused, not read as JSON.
            clipped = _clip(content_type)
            raise bad_request(f"the body must be JSON (application/json), not {clipped!r}")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > state.max_body_bytes:
            raise _too_large(state.max_body_bytes)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > state.max_body_bytes:
                raise _too_large(state.max_body_bytes)
        try:
            raw = msgspec.json.decode(body)
        except msgspec.DecodeError as exc:
            raise bad_request(f"the body is not valid JSON: {exc}") from exc
        except RecursionError:
            raise _too_deep() from None
        if not isinstance(raw, dict):
            raise bad_request("the body must be a JSON object")
        return raw

    def parse(raw: dict[str, Any], kind: type[T]) -> T:
        try:
            parsed = msgspec.convert(raw, kind)
        except msgspec.ValidationError as exc:
            raise bad_request(str(exc), _path_param(str(exc))) from exc
        except RecursionError:
            raise _too_deep() from None
        unknown = set(raw) - set(kind.__struct_fields__) - _INFORMATIONAL  # type: ignore[attr-defined]
        for name in sorted(unknown - state.logged_unknown_fields):
            logger.warning("ignoring unknown request field %r (logged once)", name)
            state.logged_unknown_fields.add(name)
        model = getattr(parsed, "model", None)
        if model is not None:
            check_model(model)
        return parsed

    async def read_body(request: Request, kind: type[T]) -> T:
        return parse(await read_json(request), kind)

    def check_model(model: str) -> None:
        if model not in state.model_names:
            raise APIError(
                404,
                f"the model {_clip(model)!r} does not exist; this server serves "
                f"{state.model_names}",
                param="model",
                code="model_not_found",
            )

    async def generate(
        request: Request, kind: type, make_handler: Callable, raw: dict[str, Any] | None = None
    ) -> Response:
        """Completions and chat: parse, then stream SSE or answer once the text is complete."""
        client = state.ready_client()
        body = parse(raw if raw is not None else await read_json(request), kind)
        handler = make_handler(client, body.model or state.model_names[0])
        if body.stream:
            return _sse(await handler.stream(body))
        return _json(await _until_disconnect(request, handler.create(body)))

    def make_chat(client: AsyncEngineClient, name: str) -> Chat:
        return Chat(client, name, state.reasoning_parser, state.tool_call_parser)

    async def completions(request: Request) -> Response:
        return await generate(request, CompletionRequest, Completions)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, ChatCompletionRequest, make_chat)

    async def invocations(request: Request) -> Response:
        """SageMaker's single endpoint, as vLLM serves it: a chat if the body has messages,
        else a completion if it has a prompt."""
        state.ready_client()
        raw = await read_json(request)
        if "messages" in raw:
            return await generate(request, ChatCompletionRequest, make_chat, raw)
        if "prompt" in raw:
            return await generate(request, CompletionRequest, Completions, raw)
        raise bad_request("/invocations needs messages (a chat) or prompt (a completion)")

    def model_cards() -> list[ModelCard]:
        config = state.ready_client().config
        root, max_len = str(config.model_dir), config.max_model_len
        return [ModelCard(name, state.started_at, max_len, root) for name in state.model_names]

    async def models(request: Request) -> Response:
        return _json(ModelList(model_cards()))

    async def model(request: Request) -> Response:
        cards = model_cards()
        name = request.path_params["name"]
        check_model(name)
        return _json(next(card for card in cards if card.id == name))

    async def tokenize(request: Request) -> Response:
        client = state.ready_client()
        body = await read_body(request, TokenizeRequest)
        return _json(await client.run_frontend(tokenized, client, body))

    async def detokenize(request: Request) -> Response:
        client = state.ready_client()
        body = await read_body(request, DetokenizeRequest)
        return _json(await client.run_frontend(detokenized, client, body))

    async def health(request: Request) -> Response:
        """200 while the server can take work; else 503 saying why."""
        client = state.client
        if client is None:
            reason = state.startup_error or "loading"
        elif not client.alive:
            reason = "engine stopped"
        elif client.draining:
            reason = "shutting down"
        else:
            reason = client.admission_stalled()
        return Response(status_code=200) if reason is None else Response(reason, status_code=503)

    async def metrics(request: Request) -> Response:
        engine = b"" if state.client is None else state.client.metrics.render()
        body = generate_latest(state.http_registry) + engine
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def version_route(request: Request) -> Response:
        return _json({"version": _version()})

    def loaded_client() -> AsyncEngineClient:
        """The engine client once the model has loaded, draining or not: the routes routers
        poll describe the server while it drains too."""
        if state.client is None:
            raise APIError(503, "the model is still loading", code="not_ready")
        return state.client

    async def get_load(request: Request) -> Response:
        return _json(Load(loaded_client().num_in_flight))

    async def get_model_info(request: Request) -> Response:
        config = loaded_client().config
        return _json(ModelInfo(str(config.model_dir), str(config.tokenizer_dir), state.model_names))

    async def get_server_info(request: Request) -> Response:
        config = loaded_client().config
        info = ServerInfo(
            model_id=state.model_names[0],
            model_path=str(config.model_dir),
            served_model_names=state.model_names,
            max_model_len=config.max_model_len,
            kv_block_size=config.block_size,
            num_kv_blocks=config.num_kv_blocks,
            dp_size=state.data_parallel_size,
            tp_size=state.tensor_parallel_size,
            version=_version(),
        )
        return _json(info)

    async def kv_event_sources(request: Request) -> Response:
        """Where each attention rank publishes its KV events (empty when none publish)."""
        events = state.kv_events
        if events is None:
            return _json({})
        sources = {
            str(rank): KVEventSource(
                endpoint_for_rank(events.endpoint, rank),
                None
                if events.replay_endpoint is None
                else endpoint_for_rank(events.replay_endpoint, rank),
                events.topic,
            )
            for rank in range(state.data_parallel_size)
        }
        return _json(sources)

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/invocations", invocations, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/version", version_route, methods=["GET"]),
        # What routers in front of a fleet ask of a worker (SGLang's names, which vllm-router
        # keeps): its load, its model and its cache layout.
        Route("/get_load", get_load, methods=["GET"]),
        Route("/get_model_info", get_model_info, methods=["GET"]),
        Route("/get_server_info", get_server_info, methods=["GET"]),
        Route("/kv_event_sources", kv_event_sources, methods=["GET"]),
    ]
    handlers = {APIError: _api_error, ServerBusyError: _engine_error,
                EngineFailedError: _engine_error, HTTPException: _http_error,
                Exception: _crash}  # fmt: skip
    app = Starlette(routes=routes, exception_handlers=handlers)  # type: ignore[arg-type]
    app.add_middleware(_AuthMiddleware, api_key=state.api_key)
    app.add_middleware(_CountRequests, state=state)  # outermost: 401s are counted too
    return app


def tokenized(client: AsyncEngineClient, body: TokenizeRequest) -> TokenizeResponse:
    """`/tokenize`'s answer (on the frontend's threads)."""
    frontend = client.frontend
    try:
        if body.messages is not None:
            tokens = frontend.render_chat(
                template_messages(body.messages),
                add_generation_prompt=body.add_generation_prompt,
                tools=body.tools or None,
                chat_template_kwargs=body.chat_template_kwargs,
                continue_final_message=body.continue_final_message,
            )
        elif body.prompt is not None:
            tokens = frontend.tokenizer.encode(body.prompt, body.add_special_tokens)
        else:
            raise bad_request("give either prompt or messages", "prompt")
    except InvalidRequestError as exc:
        raise bad_request(str(exc), exc.param) from exc
    strs = None
    if body.return_token_strs:
        strs = [frontend.tokenizer.id_to_token(t) or "" for t in tokens]
    return TokenizeResponse(tokens, len(tokens), client.config.max_model_len, strs)


def detokenized(client: AsyncEngineClient, body: DetokenizeRequest) -> DetokenizeResponse:
    """`/detokenize`'s answer (on the frontend's threads)."""
    vocab = client.config.vocab_size
    if body.tokens and (min(body.tokens) < 0 or max(body.tokens) >= vocab):
        raise bad_request(f"tokens must be in [0, {vocab})", "tokens")
    return DetokenizeResponse(client.frontend.tokenizer.decode(body.tokens, False))


def _sse(stream: Any) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(stream, media_type="text/event-stream", headers=headers)


async def _until_disconnect(request: Request, work: Any) -> Any:
    """Await `work`, cancelling it (and so aborting its requests) if the client goes away."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise APIError(499, "the client disconnected", code="client_disconnected")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")


def _clip(text: str, limit: int = 128) -> str:
    """A client's string as quoted back in an error: never all of a huge one."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _too_deep() -> APIError:
    # msgspec stops at Python's recursion limit, a little under 1,000 levels here.
    return bad_request("the body's JSON is nested too deeply")


def _path_param(message: str) -> str | None:
    """`... - at `$.max_tokens`` → "max_tokens" (msgspec's validation errors name the path)."""
    marker = "at `$."
    if marker not in message:
        return None
    return message.split(marker, 1)[1].split("`", 1)[0].split("[", 1)[0].split(".", 1)[0]


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def _version() -> str:
    try:
        return version("pegainfer-server")
    except PackageNotFoundError:
        return "unknown"


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _engine_error(request: Request, exc: Exception) -> Response:
    """The engine client's refusals before an answer starts (no waiting slot for a request's
    preparation: 503 with Retry-After, as a full queue answers)."""
    assert isinstance(exc, ServerBusyError | EngineFailedError)
    return translate_engine_errors(exc).response()


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route, a method the route does not take) as OpenAI
    errors, not plain text."""
    assert isinstance(exc, HTTPException)
    path = _clip(request.url.path)
    if exc.status_code == 404:
        message, code = f"no route {path}", "not_found"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"{path} does not take {request.method}; it takes {allowed}"
        code = "method_not_allowed"
    else:
        message, code = exc.detail, None
    return APIError(exc.status_code, message, code=code, headers=exc.headers).response()


async def _crash(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error serving %s", request.url.path, exc_info=exc)
    return APIError(500, "internal server error", code="internal_error").response()


class _CountRequests:
    """Counts each HTTP request by route, method and status class, once its answer starts
    (plain ASGI middleware, so streaming is untouched). Probes and scrapes are not counted,
    as vLLM's server leaves them out."""

    _UNCOUNTED = frozenset(
        {
            "/metrics",
            "/health",
            "/version",
            "/get_load",
            "/get_model_info",
            "/get_server_info",
            "/kv_event_sources",
        }
    )

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.requests = Counter(
            "http_requests", "HTTP requests by handler, method and status class.",
            ["model_name", "handler", "method", "status"], registry=state.http_registry,
        )  # fmt: skip
        self.model = state.model_names[0]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self._UNCOUNTED:
            await self.app(scope, receive, send)
            return

        async def counted(message: Any) -> None:
            if message["type"] == "http.response.start":
                route = scope.get("route")
                handler = getattr(route, "path", None) or "none"
                status = f"{message['status'] // 100}xx"
                self.requests.labels(self.model, handler, scope["method"], status).inc()
            await send(message)

        await self.app(scope, receive, counted)


class _AuthMiddleware:
    """Bearer-token check on `/v1/*` and `/invocations` (plain ASGI middleware, so streaming
    is untouched)."""

    def __init__(self, app: Any, api_key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (
            self.expected is not None
            and scope["type"] == "http"
            and (scope["path"].startswith("/v1/") or scope["path"] == "/invocations")
        ):
            given = [value for name, value in scope["headers"] if name == b"authorization"]
            # Several Authorization headers are ambiguous (proxies disagree on which one
            # counts): refused, whichever of them holds the key.
            if len(given) != 1 or not secrets.compare_digest(given[0], self.expected):
                message = "invalid or missing API key"
                if len(given) > 1:
                    message = f"send one Authorization header, not {len(given)}"
                error = APIError(401, message, code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
