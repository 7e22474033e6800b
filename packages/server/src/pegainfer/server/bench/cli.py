"""`pegainfer-bench`: one subcommand per benchmark; each writes its results as JSON on request."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from pegainfer.server.bench import (
    make_checkpoint,
    memory_plan,
    multiturn,
    prefix,
    serve,
    startup,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pegainfer-bench", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in (serve, multiturn, prefix, startup, make_checkpoint, memory_plan):
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
