"""Chat templates: compiled and rendered in the Jinja environment transformers renders them
in (a sandbox, as templates come with downloaded checkpoints). Imported by `tokenizer.py` only
when there are templates to compile or render, so that a process that only tokenizes does not
import Jinja."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pegainfer.core.errors import ConfigError, InvalidRequestError


def compile_templates(sources: Mapping[str, str]) -> dict[str, jinja2.Template]:
    """Each named template's source compiled; a ConfigError names one that is not valid Jinja."""
    env = _template_environment()
    templates = {}
    for name, source in sources.items():
        try:
            templates[name] = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"chat template {name!r} is not valid Jinja: {e}") from e
    return templates


def render(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """`template` rendered with `variables`; an error from inside it is the request's."""
    try:
        return template.render(**variables)
    except InvalidRequestError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
        # Templates read messages without checking them; a malformed conversation (a missing
        # role, content of the wrong type) surfaces as an error from inside the template,
        # which is the request's fault, not the server's.
        raise InvalidRequestError(
            f"the chat template cannot render these messages: {e}", "messages"
        ) from e


class _GenerationTag(jinja2.ext.Extension):
    """Accept transformers' `{% generation %}...{% endgeneration %}` blocks and render their body.

    transformers uses the tag to build assistant-token masks for training; several published chat
    templates contain it, and plain Jinja would reject them as syntax errors.
    """

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise InvalidRequestError(str(message), "messages")


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own `tojson` escapes <, >, & and ' for HTML and sorts keys; chat templates expect the
    # plain JSON that transformers' override produces.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _template_environment() -> ImmutableSandboxedEnvironment:
    """The Jinja environment transformers renders chat templates in: a sandbox (templates come
    with downloaded checkpoints), block trimming, loop controls, and the same helpers."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
