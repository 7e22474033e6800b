"""Command-line options the load-generating benchmarks share, and their value types."""

from __future__ import annotations

import argparse
import os
from typing import Any


def subcommand(subparsers: Any, name: str, doc: str) -> argparse.ArgumentParser:
    """A `pegainfer-bench` subcommand whose help is its module docstring's first line."""
    return subparsers.add_parser(
        name,
        help=doc.split("\n")[0],
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, not {value}")
    return value


def rate(text: str) -> float:
    """Requests per second: a positive number or `inf` (every request at once)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive or inf, not {text}")
    return value


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The server to load, what every request asks for, the seed and the result file."""
    target = parser.add_argument_group("server")
    target.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server root, without /v1 (default: %(default)s)",
    )
    target.add_argument(
        "--model", default=None, help="model name to send (default: the first in /v1/models)"
    )
    target.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)",
    )
    requests = parser.add_argument_group("requests")
    requests.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default: greedy)"
    )
    requests.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly the output length, as vLLM does for random data (default: on)",
    )
    requests.add_argument(
        "--seed", type=int, default=0, help="seed of the prompts and arrivals (default: 0)"
    )
    parser.add_argument("--result-json", default=None, metavar="PATH", help="write results here")
