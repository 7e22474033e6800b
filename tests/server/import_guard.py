"""`python tests/server/import_guard.py ARGS`: `pegainfer-server ARGS`, its HTTP process
reporting on stderr every import of a package it must never load (`heavy import: NAME` and
where it came from). The engine process it spawns is not watched: it runs the model."""

from __future__ import annotations

import importlib.abc
import sys
import traceback

HEAVY = frozenset({"torch", "transformers", "triton", "flashinfer"})
REPORT = "heavy import: "


class _Reporter(importlib.abc.MetaPathFinder):
    """Reports an import and leaves finding the module to the other finders."""

    def find_spec(self, name: str, path: object, target: object = None) -> None:
        if name.partition(".")[0] in HEAVY:
            where = "".join(traceback.format_stack()[:-1])
            print(f"{REPORT}{name}\n{where}", file=sys.stderr, flush=True)


if __name__ == "__main__":  # the spawned engine process imports this file as __mp_main__
    sys.meta_path.insert(0, _Reporter())
    from pegainfer.server.cli import main

    sys.exit(main())
