"""`pegainfer-server`: serve one model over the OpenAI API.

The arguments are parsed and the port bound before torch or any plugin is imported, so `--help`
and a busy port answer at once. HTTP then comes up, answering 503 on /health and the API while
the model loads; it turns ready only when the engine can serve. The engine runs in a process of
its own (`pegainfer.core.engine.process`), so HTTP, SSE framing, detokenization and metrics
never take the GIL from its step loop. If loading fails, the process exits non-zero with the
reason; if the engine process dies later, requests in flight fail and /health turns 503.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any

import anyio

from pegainfer.core.args import EngineArgs
from pegainfer.core.distributed.nodes import Nodes
from pegainfer.core.engine.spawn import SpawnedEngine, spawn_engine
from pegainfer.core.errors import PegainferError
from pegainfer.core.kv.kv_events import KVEventsConfig
from pegainfer.core.process_info import rss_bytes, since_process_start

if TYPE_CHECKING:
    from pegainfer.core.engine.engine_config import EngineConfig
    from pegainfer.core.engine.frontend import Frontend
    from pegainfer.core.engine.process import EngineProcess
    from pegainfer.server.app import ServerState

logger = logging.getLogger("pegainfer.server")

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pegainfer-server",
        description="Serve a model over the OpenAI-compatible HTTP API.",
        argument_default=argparse.SUPPRESS,  # only what the user sets reaches EngineArgs
    )
    engine = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"]
        if f.type in (bool, "bool"):
            action = "store_false" if f.default else "store_true"
            engine.add_argument(flag, dest=f.name, action=action, help=help_text)
            continue
        kind = {"int": int, "float": float}.get(str(f.type).split(" |")[0], str)
        if f.default is dataclasses.MISSING:
            engine.add_argument(
                flag,
                dest=f.name,
                type=kind,
                required=True,
                metavar="PATH_OR_REPO_ID",
                help=help_text,
            )
        else:
            default = "" if f.default is None else f" (default: {f.default})"
            engine.add_argument(flag, dest=f.name, type=kind, help=help_text + default)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="0.0.0.0", help="Address to listen on.")
    server.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    server.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="Model name(s) clients use in requests; defaults to --model-path as given.",
    )
    server.add_argument(
        "--api-key",
        default=os.environ.get("PEGAINFER_API_KEY"),
        help="Require 'Authorization: Bearer KEY' on /v1/* (default: $PEGAINFER_API_KEY).",
    )
    server.add_argument(
        "--backlog",
        type=int,
        default=2048,
        help="Connections the listening socket queues before accepting them (vLLM's default; "
        "the kernel caps it at net.core.somaxconn). A burst beyond it is reset.",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=_SHUTDOWN_TIMEOUT_S,
        help="Seconds requests in flight get to finish on SIGTERM or SIGINT; what is left then "
        "ends with a 503 (an error event and [DONE] in a stream). The listening socket closes "
        "at once; meanwhile new requests on open connections and /health get 503.",
    )
    server.add_argument(
        "--max-request-bytes",
        type=int,
        default=32 << 20,
        help="Largest request body accepted; larger ones get 413.",
    )
    server.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="Requests allowed to wait for their first token; more get 503 with Retry-After.",
    )
    server.add_argument(
        "--max-unsent-tokens",
        type=int,
        default=16384,
        help="Tokens of one response that may wait for a client reading its stream slowly; "
        "past them the response ends and its requests are aborted.",
    )
    server.add_argument(
        "--reasoning-parser",
        default=None,
        help="Split chat answers' thinking into reasoning_content (qwen3: <think>...</think>; "
        "plugins may add more); default: the model line's, 'none' for no split.",
    )
    server.add_argument(
        "--tool-call-parser",
        default=None,
        help="Turn function calls in chat answers into tool_calls (hermes: Qwen3's "
        "<tool_call>{json}</tool_call>; qwen3_xml: Qwen3.5's <function=...> form; plugins may "
        "add more); default: the model line's, 'none' to refuse requests with tools.",
    )
    server.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="Logging verbosity.",
    )
    return parser


_SERVER_FIELDS = (
    "host",
    "port",
    "served_model_name",
    "api_key",
    "backlog",
    "shutdown_timeout",
    "max_request_bytes",
    "max_waiting_requests",
    "max_unsent_tokens",
    "log_level",
    "reasoning_parser",
    "tool_call_parser",
)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    options = vars(parser.parse_args(argv))
    server = {name: options.pop(name) for name in _SERVER_FIELDS}
    logging.basicConfig(level=server["log_level"].upper(), format=_LOG_FORMAT)
    if server["backlog"] < 1:
        print("pegainfer-server: --backlog must be at least 1", file=sys.stderr)
        return 2
    if server["max_unsent_tokens"] < 1:
        print("pegainfer-server: --max-unsent-tokens must be at least 1", file=sys.stderr)
        return 2
    if not 0 <= server["shutdown_timeout"] < float("inf"):
        print("pegainfer-server: --shutdown-timeout must be a number of seconds >= 0",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        engine_args = EngineArgs(**options).validate()
        nodes = Nodes.from_args(engine_args)
    except PegainferError as exc:
        print(f"pegainfer-server: {exc}", file=sys.stderr)
        return 2
    if nodes.node_rank > 0:
        unused = [name for name in _SERVER_FIELDS if name != "log_level"
                  and server[name] != parser.get_default(name)]  # fmt: skip
        return _worker_node(engine_args, unused)
    try:
        listener = listen(server["host"], server["port"])
    except OSError as exc:
        print(f"pegainfer-server: cannot listen on {server['host']}:{server['port']}: "
              f"{exc.strerror or exc}", file=sys.stderr)  # fmt: skip
        return 1
    with listener:
        # The engine process starts loading now, importing torch while this process does.
        spawned = spawn_engine(engine_args, _LOG_FORMAT)
        try:
            # Plugins (and torch with them) load only now: the answer parsers come from them.
            from pegainfer.server import parsers

            parsers.check_names(parsers.registry(), _requested_parsers(server))
        except BaseException as exc:
            spawned.stop()
            if not isinstance(exc, PegainferError):
                raise
            print(f"pegainfer-server: {exc}", file=sys.stderr)
            return 2
        return asyncio.run(serve(engine_args, server, listener, spawned))


def _worker_node(engine_args: EngineArgs, unused: list[str]) -> int:
    """A host other than node 0: its ranks only, no HTTP; the exit status says how they
    ended (0: node 0 stopped them)."""
    from pegainfer.core.distributed.worker_node import run_worker_node

    if unused:
        flags = ", ".join("--" + name.replace("_", "-") for name in unused)
        logger.warning("this host serves no HTTP (node 0 does): %s unused here", flags)
    try:
        return run_worker_node(engine_args)
    except PegainferError as exc:
        print(f"pegainfer-server: {exc}", file=sys.stderr)
        return 1


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (not yet listening: hypercorn sets the backlog), made
    before anything slow so that a busy port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host.strip("[]"), port))
    except OSError:
        sock.close()
        raise
    return sock


def _requested_parsers(server: dict[str, Any]) -> dict[str, str | None]:
    return {"reasoning": server["reasoning_parser"], "tool_call": server["tool_call_parser"]}


async def serve(
    engine_args: EngineArgs,
    server: dict[str, Any],
    listener: socket.socket,
    spawned: SpawnedEngine,
) -> int:
    """Serve HTTP at once on `listener` and the model once the engine process (`spawned`,
    loading it) has loaded it.

    SIGINT and SIGTERM close the listening socket and drain: requests in flight get
    `--shutdown-timeout` seconds, then what is left is ended with a proper error; then the
    engine process stops (a bounded wait, then it is terminated). While the model loads, they
    end the load.
    """
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    from pegainfer.core.engine.metrics import Metrics
    from pegainfer.core.engine.process import EngineProcess
    from pegainfer.server import http2, parsers
    from pegainfer.server.app import ServerState, build_app
    from pegainfer.server.engine_client import AsyncEngineClient

    names = server["served_model_name"] or [engine_args.model]
    state = ServerState(
        model_names=names,
        api_key=server["api_key"],
        max_body_bytes=server["max_request_bytes"],
        tensor_parallel_size=engine_args.tensor_parallel_size,
        data_parallel_size=engine_args.data_parallel_size,
        kv_events=_publishing(engine_args),
    )
    http2.install()
    config = Config()
    # hypercorn owns the socket from here and closes it when it stops (at once on a signal).
    config.bind = [f"fd://{listener.detach()}"]
    config.backlog = server["backlog"]
    config.accesslog = None
    # hypercorn waits this long for open connections once the socket is closed: the drain,
    # then the time the ended requests take to write their errors.
    config.graceful_timeout = server["shutdown_timeout"] + _ANSWER_ENDED_S
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    http = asyncio.create_task(
        hypercorn_serve(build_app(state), config, shutdown_trigger=stop.wait)
    )
    drain = asyncio.create_task(_drain_on_stop(state, stop, server["shutdown_timeout"]))

    exit_code = 0
    engine = EngineProcess(spawned)
    # The tokenizer and chat template load while the engine process loads the model.
    frontend_load = asyncio.ensure_future(asyncio.to_thread(_load_frontend, engine_args))
    try:
        try:
            engine_config = await _load(engine, stop)
            frontend = await frontend_load
            # A first streamed response would import anyio's asyncio backend (starlette, which
            # brings anyio, runs it in a task group): 0.1 s of its TTFT on a busy CPU.
            await anyio.sleep(0)
            line_defaults = {
                "reasoning": engine_config.reasoning_parser,
                "tool_call": engine_config.tool_call_parser,
            }
            chosen = parsers.resolve(parsers.registry(), _requested_parsers(server), line_defaults)
            state.reasoning_parser = chosen["reasoning"]
            state.tool_call_parser = chosen["tool_call"]
            kv_tokens = engine_config.block_size * engine_config.num_kv_blocks
            metrics = Metrics(
                names[0],
                engine_config.max_model_len,
                {
                    "block_size": str(engine_config.block_size),
                    "num_gpu_blocks": str(engine_config.num_kv_blocks),
                    "cache_dtype": engine_config.dtype,
                    # vLLM's: the cache's tokens, and how many full-context requests fit them.
                    "kv_cache_size_tokens": str(kv_tokens),
                    "kv_cache_max_concurrency": f"{kv_tokens / engine_config.max_model_len:.2f}",
                },
            )
            state.client = AsyncEngineClient(
                engine, frontend, metrics, server["max_waiting_requests"],
                server["max_unsent_tokens"],
            )  # fmt: skip
            logger.info("ready: serving %s at http://%s:%s, %.2f s after start (this process: "
                        "RSS %d MiB)", names, server["host"], server["port"],
                        since_process_start(), rss_bytes() >> 20)  # fmt: skip
        except PegainferError as exc:
            if stop.is_set():
                logger.info("stopped while loading")
            else:
                logger.error("cannot serve %s: %s", engine_args.model, exc)
                state.startup_error = str(exc)
                exit_code = 1
                stop.set()
        await http
    finally:  # whatever ended serving: the engine process (not a daemon) must not outlive it
        if not frontend_load.done():
            frontend_load.cancel()
        elif not frontend_load.cancelled():
            frontend_load.exception()  # retrieved: when the engine failed, its error is reported
        drain.cancel()
        if state.client is not None:
            state.client.close()
        engine.shutdown(_ENGINE_STOP_S)
    return exit_code


def _publishing(engine_args: EngineArgs) -> KVEventsConfig | None:
    """The engine's KV-events configuration if it publishes (validated already)."""
    if engine_args.kv_events_config is None:
        return None
    events = KVEventsConfig.parse(engine_args.kv_events_config)
    return events if events.publishes else None


async def _drain_on_stop(state: ServerState, stop: asyncio.Event, grace: float) -> None:
    """Once asked to stop, drain the engine client (hypercorn meanwhile closes the socket
    and waits for the connections the drain lets finish)."""
    await stop.wait()
    if state.client is not None:
        logger.info("stopping: requests in flight get %gs to finish", grace)
        await state.client.drain(grace)


# Seconds requests in flight get by default once the server is asked to stop (under
# Kubernetes' default grace of 30 s, with the engine's stop after it); seconds ended requests
# get to write their errors; seconds the engine process gets to stop.
_SHUTDOWN_TIMEOUT_S = 15.0
_ANSWER_ENDED_S = 5.0
_ENGINE_STOP_S = 10.0


def _load_frontend(engine_args: EngineArgs) -> Frontend:
    from pegainfer.core.engine.frontend import Frontend
    from pegainfer.core.engine.model_source import resolve_model_source

    return Frontend.for_source(resolve_model_source(engine_args))


async def _load(engine: EngineProcess, stop: asyncio.Event) -> EngineConfig:
    """The engine's config once it has loaded; a stop request meanwhile ends the load (and
    `wait_ready` then raises)."""
    loading = asyncio.ensure_future(asyncio.to_thread(engine.wait_ready))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not loading.done():
        await asyncio.to_thread(engine.shutdown, 0)
    return await loading


if __name__ == "__main__":
    sys.exit(main())
