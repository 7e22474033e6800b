"""Plugin discovery: model lines arrive through pluggy hooks in the `pegainfer` entry-point group.

A package adds a family by declaring, in its pyproject.toml,

    [project.entry-points.pegainfer]
    myfamily = "my_package.plugin"

where `my_package.plugin` holds a function decorated with `hookimpl` named
`pegainfer_model_lines` returning `ModelLine` instances. A plugin may also contribute chat
answer parsers (`pegainfer_reasoning_parsers`, `pegainfer_tool_call_parsers`: names to parser
classes, with the interfaces of `pegainfer.server.reasoning` and `pegainfer.server.tool_calls`),
which a line names as its defaults. Hooks must be cheap and import heavy modules lazily: they
run in every process that needs the registry.
"""

from __future__ import annotations

import logging
import os
from importlib.metadata import entry_points
from typing import Any

import pluggy

from pegainfer.core.errors import ModelLineError
from pegainfer.core.model_line import ModelLine

PROJECT = "pegainfer"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

logger = logging.getLogger(__name__)

# model_type values of the families we publish, and the extra that installs each.
KNOWN_FAMILIES: dict[str, str] = {
    "qwen3": "qwen3",
    "qwen3_5": "qwen35",
    "qwen3_5_text": "qwen35",
    "deepseek_v2": "deepseek",
    "kimi_k2": "kimi-k2",
    "deepseek_v3": "kimi-k2",
    "glm_moe_dsa": "glm5",
}


class _Specs:
    @hookspec
    def pegainfer_model_lines(self) -> list[ModelLine]:  # type: ignore[empty-body]
        """Return the model lines this plugin contributes."""

    @hookspec
    def pegainfer_reasoning_parsers(self) -> dict[str, Any]:  # type: ignore[empty-body]
        """Return reasoning parsers by name: classes whose instances split one answer."""

    @hookspec
    def pegainfer_tool_call_parsers(self) -> dict[str, Any]:  # type: ignore[empty-body]
        """Return tool-call parsers by name: classes whose instances parse one answer."""


#: Installed plugins that could not be loaded, by entry-point name: why. A broken plugin is
#: left out (and logged) so that the other families still serve; a checkpoint no loaded line
#: claims lists these in its error.
LOAD_FAILURES: dict[str, str] = {}

_HOOKS = {name for name in dir(_Specs) if name.startswith(f"{PROJECT}_")}


def _allowed_plugins() -> set[str] | None:
    allowed = os.environ.get("PEGAINFER_PLUGINS")
    return None if allowed is None else {n.strip() for n in allowed.split(",") if n.strip()}


def create_plugin_manager(load_entry_points: bool = True) -> pluggy.PluginManager:
    """A plugin manager with our hook specs and, by default, every installed plugin.

    `PEGAINFER_PLUGINS` (a comma-separated list of entry-point names) restricts which
    installed plugins load, as `VLLM_PLUGINS` does for vLLM.
    """
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(_Specs)
    if not load_entry_points:
        return pm
    allowed = _allowed_plugins()
    installed = entry_points(group=PROJECT)
    LOAD_FAILURES.clear()
    for name in sorted((allowed or set()) - set(installed.names)):
        logger.warning("PEGAINFER_PLUGINS names %r, which no installed plugin has; installed: %s",
                       name, ", ".join(sorted(installed.names)) or "none")  # fmt: skip
    for entry in installed:
        if (allowed is not None and entry.name not in allowed) or pm.has_plugin(entry.name):
            continue
        try:
            plugin = entry.load()
            check_plugin(plugin)
            pm.register(plugin, name=entry.name)
        except Exception as exc:  # any failure of third-party code: left out, said why
            reason = f"{type(exc).__name__}: {exc}"
            LOAD_FAILURES[entry.name] = reason
            logger.error("left out the pegainfer plugin %r (%s): %s; fix or uninstall it, or "
                         "choose the plugins to load with PEGAINFER_PLUGINS",
                         entry.name, entry.value, reason)  # fmt: skip
    logger.debug("pegainfer plugins: %s", [n for n, _ in pm.list_name_plugin()])
    return pm


def check_plugin(plugin: object) -> None:
    """Refuse a plugin whose hooks would be ignored without a word: a `pegainfer_*` function
    that is no hook we know (a typo) or that lacks `@hookimpl`, or no hook at all."""
    hooks = [name for name in dir(plugin) if name.startswith(f"{PROJECT}_")]
    for name in hooks:
        if name not in _HOOKS:
            raise ModelLineError(
                f"{name} is not a pegainfer hook; hooks: {', '.join(sorted(_HOOKS))}"
            )
        if getattr(getattr(plugin, name), f"{PROJECT}_impl", None) is None:
            raise ModelLineError(f"{name} is not decorated with pegainfer.core.plugins.hookimpl")
    if not hooks:
        raise ModelLineError(f"it defines none of the hooks {', '.join(sorted(_HOOKS))}")


def model_lines(pm: pluggy.PluginManager | None = None) -> list[ModelLine]:
    """Every model line the installed plugins contribute, in registration order."""
    pm = pm or create_plugin_manager()
    lines = [line for group in pm.hook.pegainfer_model_lines() for line in group]
    names = [line.name for line in lines]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ModelLineError(f"model line name(s) registered twice: {', '.join(duplicates)}")
    return lines


def find_model_line(name: str, lines: list[ModelLine] | None = None) -> ModelLine:
    """The line called `name` among `lines` (default: the installed ones): how a process that
    did not load the model (the server's) reaches the line the engine detected."""
    for line in model_lines() if lines is None else lines:
        if line.name == name:
            return line
    raise ModelLineError(f"no model line {name!r} is installed")


def answer_parsers(pm: pluggy.PluginManager, kind: str) -> dict[str, Any]:
    """Every parser of `kind` ("reasoning" or "tool_call") the registered plugins contribute."""
    hook = getattr(pm.hook, f"pegainfer_{kind}_parsers")
    found: dict[str, Any] = {}
    for group in hook():
        twice = sorted(found.keys() & group.keys())
        if twice:
            raise ModelLineError(f"{kind} parser(s) registered twice: {', '.join(twice)}")
        found |= group
    return found


def detect_model_line(config: dict[str, Any], lines: list[ModelLine]) -> ModelLine:
    """The one line that claims `config`; a `ModelLineError` explaining why otherwise."""
    refusals = [(line, line.probe(config)) for line in lines]
    claimed = [line for line, probe in refusals if probe.claimed]
    if len(claimed) == 1:
        return claimed[0]
    model_type = config.get("model_type", "<missing>")
    if claimed:
        names = " and ".join(repr(line.name) for line in claimed)
        raise ModelLineError(
            f"model_type {model_type!r} is claimed by more than one installed model line: {names}; "
            "uninstall one of them or restrict plugins with PEGAINFER_PLUGINS"
        )
    lines_text = "\n".join(f"  - {line.name}: {probe.reason}" for line, probe in refusals)
    message = f"no installed model line supports model_type {model_type!r}."
    extra = KNOWN_FAMILIES.get(str(model_type))
    if extra is None and isinstance(config.get("text_config"), dict):
        extra = KNOWN_FAMILIES.get(str(config["text_config"].get("model_type")))
    if extra is None:
        families = ", ".join(sorted(KNOWN_FAMILIES))
        message += f" pegainfer has no model line for it (its families: {families})."
    elif extra in LOAD_FAILURES:
        message += f" Its line {extra!r} is installed but failed to load: {LOAD_FAILURES[extra]}."
    elif (
        (allowed := _allowed_plugins()) is not None
        and extra not in allowed
        and (extra in entry_points(group=PROJECT).names)
    ):
        message += (f" Its line {extra!r} is installed but not loaded: PEGAINFER_PLUGINS="
                    f"{os.environ['PEGAINFER_PLUGINS']!r} leaves it out.")  # fmt: skip
    else:
        message += f" It belongs to the {extra!r} family: pip install 'pegainfer[{extra}]'."
    message += "\nInstalled lines:\n" + (lines_text or "  (none)")
    failed = "".join(f"\n  - {name}: {why}" for name, why in sorted(LOAD_FAILURES.items()))
    if failed:
        message += "\nPlugins that failed to load:" + failed
    raise ModelLineError(message)
