"""`pegainfer-server`: serve one model over the OpenAI API.

HTTP comes up at once, answering 503 on /health and the API while the model loads; it turns
ready only when the engine can serve. If loading fails, the process exits non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from typing import Any

from pegainfer.core.args import EngineArgs
from pegainfer.core.errors import PegainferError
from pegainfer.server import parsers

logger = logging.getLogger("pegainfer.server")


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
    "max_request_bytes",
    "max_waiting_requests",
    "log_level",
    "reasoning_parser",
    "tool_call_parser",
)


def main(argv: list[str] | None = None) -> int:
    options = vars(build_parser().parse_args(argv))
    server = {name: options.pop(name) for name in _SERVER_FIELDS}
    logging.basicConfig(
        level=server["log_level"].upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if server["backlog"] < 1:
        print("pegainfer-server: --backlog must be at least 1", file=sys.stderr)
        return 2
    try:
        engine_args = EngineArgs(**options).validate()
        parsers.check_names(parsers.registry(), _requested_parsers(server))
    except PegainferError as exc:
        print(f"pegainfer-server: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(serve(engine_args, server))


def _requested_parsers(server: dict[str, Any]) -> dict[str, str | None]:
    return {"reasoning": server["reasoning_parser"], "tool_call": server["tool_call_parser"]}


async def serve(engine_args: EngineArgs, server: dict[str, Any]) -> int:
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    from pegainfer.core.engine import EngineCore
    from pegainfer.core.frontend import Frontend
    from pegainfer.core.metrics import Metrics
    from pegainfer.server.app import ServerState, build_app
    from pegainfer.server.engine_client import AsyncEngineClient

    names = server["served_model_name"] or [engine_args.model]
    state = ServerState(
        model_names=names,
        api_key=server["api_key"],
        max_body_bytes=server["max_request_bytes"],
    )
    config = Config()
    config.bind = [f"{server['host']}:{server['port']}"]
    config.backlog = server["backlog"]
    config.accesslog = None
    config.graceful_timeout = 5
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    http = asyncio.create_task(
        hypercorn_serve(build_app(state), config, shutdown_trigger=stop.wait)
    )

    exit_code = 0
    try:
        engine = await asyncio.to_thread(EngineCore, engine_args)
        config = engine.config
        frontend = await asyncio.to_thread(Frontend, config.model_dir, config.tokenizer_dir)
        line_defaults = {"reasoning": config.reasoning_parser, "tool_call": config.tool_call_parser}
        chosen = parsers.resolve(parsers.registry(), _requested_parsers(server), line_defaults)
        state.reasoning_parser, state.tool_call_parser = chosen["reasoning"], chosen["tool_call"]
        state.client = AsyncEngineClient(
            engine, frontend, Metrics(names[0]), server["max_waiting_requests"]
        )
        logger.info("ready: serving %s at http://%s:%s", names, server["host"], server["port"])
    except PegainferError as exc:
        logger.error("cannot serve %s: %s", engine_args.model, exc)
        state.startup_error = str(exc)
        exit_code = 1
        stop.set()
    await http
    if state.client is not None:
        state.client.shutdown()
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
