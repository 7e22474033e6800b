"""The chat answer parsers a server can use: its own and those plugins contribute, by name.

`--reasoning-parser` and `--tool-call-parser` name one (or `none`); left unset, the model
line's defaults apply (Qwen3: `qwen3` and `hermes`; Qwen3.5: `qwen3` and `qwen3_xml`).
"""

from __future__ import annotations

from typing import Any

import pluggy

from pegainfer.core.errors import ConfigError
from pegainfer.core.plugins import answer_parsers, create_plugin_manager, hookimpl
from pegainfer.server.reasoning import REASONING_PARSERS
from pegainfer.server.tool_calls import TOOL_CALL_PARSERS

NONE = "none"
KINDS = ("reasoning", "tool_call")


class _Builtins:
    """The server's own parsers, registered through the same hooks as a plugin's."""

    @hookimpl
    def pegainfer_reasoning_parsers(self) -> dict[str, Any]:
        return dict(REASONING_PARSERS)

    @hookimpl
    def pegainfer_tool_call_parsers(self) -> dict[str, Any]:
        return dict(TOOL_CALL_PARSERS)


def registry(pm: pluggy.PluginManager | None = None) -> dict[str, dict[str, Any]]:
    """Parsers by kind ("reasoning", "tool_call"), then by name."""
    pm = pm or create_plugin_manager()
    pm.register(_Builtins())
    return {kind: answer_parsers(pm, kind) for kind in KINDS}


def check_names(parsers: dict[str, dict[str, Any]], requested: dict[str, str | None]) -> None:
    """A ConfigError for a requested name no parser has."""
    for kind, name in requested.items():
        if name is not None and name != NONE and name not in parsers[kind]:
            known = ", ".join(sorted(parsers[kind])) or "none installed"
            raise ConfigError(f"unknown {kind} parser {name!r}; known: {known}, or {NONE}")


def resolve(
    parsers: dict[str, dict[str, Any]],
    requested: dict[str, str | None],
    line_defaults: dict[str, str | None],
) -> dict[str, Any]:
    """The parser class of each kind: the requested one, else the line's default (None: no
    parser, for `none` or a line without a default)."""
    check_names(parsers, requested)
    chosen = {}
    for kind in KINDS:
        name = requested.get(kind) or line_defaults.get(kind)
        if name is not None and name != NONE and name not in parsers[kind]:
            raise ConfigError(f"the model line's default {kind} parser {name!r} is not installed")
        chosen[kind] = None if name in (None, NONE) else parsers[kind][name]
    return chosen
