"""What a request's output must match, from the fields clients use to say it.

OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs`
(`json`, `regex`, `choice`, `grammar`, `json_object`) and its older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` all become one `StructuredOutput`; so do chat's
`tool_choice` "required" and a named function, which vLLM enforces the same way: the model must
write the named function's arguments as JSON, or a JSON array of `{"name", "parameters"}`
calls of the offered tools, and the answer's JSON becomes its `tool_calls`, streamed as it is
decoded (or, where the tool-call parser has a grammar of its own format, as Kimi-K2's has, the
calls as the model writes them unconstrained).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from pegainfer.core.errors import InvalidRequestError
from pegainfer.core.sampling.structured_output import StructuredOutput
from pegainfer.server.errors import bad_request
from pegainfer.server.tool_calls import ForcedToolCalls, ToolCallParser, parameters_schema


def _json_schema(value: Any, field: str) -> StructuredOutput:
    if isinstance(value, str):
        return StructuredOutput(kind="json_schema", spec=value)
    if not isinstance(value, dict | bool):
        raise bad_request(f"{field} must be a JSON schema", field)
    return StructuredOutput.json_schema(value)


def _text(value: Any, field: str, kind: str) -> StructuredOutput:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{field} must be a non-empty string", field)
    spec = ascii_digits(value) if kind == "regex" else value
    return StructuredOutput(kind=kind, spec=spec)  # type: ignore[arg-type]


def ascii_digits(regex: str) -> str:
    """`regex` with `\\d` meaning the ASCII digits, as vLLM's default backend (xgrammar) and
    JSON Schema's ECMAScript patterns read it. llguidance reads `\\d` as any Unicode decimal
    digit, so a random model asked for an IP address writes NKo and outlined digits. `\\D`
    outside a class becomes `[^0-9]`; inside one it is left as it is."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(regex):
        char = regex[i]
        if char == "\\" and i + 1 < len(regex):
            escaped = regex[i + 1]
            if escaped == "d":
                out.append("0-9" if in_class else "[0-9]")
            elif escaped == "D" and not in_class:
                out.append("[^0-9]")
            else:
                out.append(regex[i : i + 2])
            i += 2
            continue
        if char == "[" and not in_class:
            in_class = True
            out.append(char)
            i += 1
            # A `]` right after `[` or `[^` is a literal, not the class's end.
            if regex.startswith("^", i):
                out.append("^")
                i += 1
            if regex.startswith("]", i):
                out.append("]")
                i += 1
            continue
        if char == "]" and in_class:
            in_class = False
        out.append(char)
        i += 1
    return "".join(out)


def _choice(value: Any, field: str) -> StructuredOutput:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise bad_request(f"{field} must be a non-empty list of strings", field)
    return StructuredOutput.choice(value)


def _response_format(value: dict[str, Any]) -> StructuredOutput | None:
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput.json_schema({"type": "object"})
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request(
                "response_format json_schema needs json_schema.schema", "response_format"
            )
        return _json_schema(spec["schema"], "response_format")
    raise bad_request(
        f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
        "response_format",
    )


_STRUCTURED_OUTPUTS = {
    "json": _json_schema,
    "regex": lambda v, f: _text(v, f, "regex"),
    "grammar": lambda v, f: _text(v, f, "grammar"),
    "choice": _choice,
}


def _structured_outputs(value: dict[str, Any]) -> list[tuple[str, StructuredOutput]]:
    found = []
    for key, spec in value.items():
        field = f"structured_outputs.{key}"
        if key == "json_object":
            if spec:
                found.append((field, StructuredOutput.json_schema({"type": "object"})))
        elif key in _STRUCTURED_OUTPUTS:
            if spec is not None:
                found.append((field, _STRUCTURED_OUTPUTS[key](spec, field)))
        else:
            raise bad_request(f"{field} is not supported", field)
    return found


def requested_output(request: Any) -> tuple[str, StructuredOutput] | None:
    """The constraint a request asks for and the field it came from; a 400 if it asks for
    several, or for one that does not compile."""
    found = _constraints(request)
    if len(found) > 1:
        names = ", ".join(field for field, _ in found)
        raise bad_request(f"ask for one output constraint at a time, not {names}", found[1][0])
    if not found:
        return None
    check(*found[0])
    return found[0]


def constraint_field(request: Any) -> str:
    """The field a request's constraint came from (tool_choice when it asked for none), for
    errors found later, when the grammar is compiled against the tokenizer."""
    found = _constraints(request)
    return found[0][0] if found else "tool_choice"


def _constraints(request: Any) -> list[tuple[str, StructuredOutput]]:
    found: list[tuple[str, StructuredOutput]] = []
    if request.response_format is not None:
        output = _response_format(request.response_format)
        if output is not None:
            found.append(("response_format", output))
    if request.structured_outputs:
        found += _structured_outputs(request.structured_outputs)
    for field, make in (("guided_json", _json_schema), ("guided_choice", _choice),
                        ("guided_regex", _STRUCTURED_OUTPUTS["regex"]),
                        ("guided_grammar", _STRUCTURED_OUTPUTS["grammar"])):  # fmt: skip
        value = getattr(request, field)
        if value is not None:
            found.append((field, make(value, field)))
    return found


def check(field: str, output: StructuredOutput) -> None:
    try:
        output.grammar()
    except InvalidRequestError as exc:
        raise bad_request(str(exc), field) from exc


def forced_tool_calls(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel: bool = True,
    parser: type[ToolCallParser] | None = None,
) -> tuple[StructuredOutput, Callable[[], ToolCallParser]] | None:
    """The constraint of tool_choice "required" or of a named function, and the parser its
    answer goes through; None for "auto" and "none". Not `parallel`: "required" allows exactly
    one call. A tool-call `parser` with a grammar of its own format (Kimi-K2's) makes the model
    write the calls as it would unconstrained; otherwise they are JSON, as vLLM has them:
    the named function's arguments, or an array of `{"name", "parameters"}` calls."""
    if tool_choice in (None, "auto", "none"):
        return None
    if not tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    functions = {tool["function"]["name"]: tool["function"] for tool in tools}
    if tool_choice == "required":
        name = None
    elif (
        isinstance(tool_choice, dict)
        and tool_choice.get("type") == "function"
        and isinstance(tool_choice.get("function"), dict)
    ):
        name = tool_choice["function"].get("name")
        if name not in functions:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools",
                              "tool_choice")  # fmt: skip
    else:
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    try:
        native = parser.forced_output(functions, name, parallel) if parser is not None else None
    except InvalidRequestError as exc:  # the tools ask what the parser's format cannot write
        raise bad_request(str(exc), "tool_choice") from exc
    if native is not None:
        check("tool_choice", native)
        return native, partial(parser.for_request, tools)
    output = (
        _required_calls(functions, parallel)
        if name is None
        else StructuredOutput.json_schema(parameters_schema(functions[name]))
    )
    check("tool_choice", output)
    return output, partial(ForcedToolCalls, name)


def _required_calls(functions: dict[str, dict[str, Any]], parallel: bool) -> StructuredOutput:
    """A JSON array of calls of `functions` (exactly one unless `parallel`)."""
    # Each tool's parameters move to $defs and are referred to from there, their own local
    # $refs ($defs of nested models, "#" for recursion) rebased so that they still resolve.
    defs, calls = {}, []
    for i, (name, function) in enumerate(functions.items()):
        try:
            defs[f"tool{i}"] = _rebased(parameters_schema(function), f"#/$defs/tool{i}")
        except RecursionError:
            raise bad_request(f"tools[{i}] parameters nest too deeply", "tools") from None
        calls.append({"type": "object", "properties": {
            "name": {"const": name}, "parameters": {"$ref": f"#/$defs/tool{i}"}},
            "required": ["name", "parameters"], "additionalProperties": False})  # fmt: skip
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, "$defs": defs}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutput.json_schema(schema)


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with its local references ("#", "#/$defs/X") pointing under `base` instead."""
    if isinstance(schema, dict):
        return {
            key: base + value[1:]
            if key == "$ref" and isinstance(value, str) and value.startswith("#")
            else _rebased(value, base)
            for key, value in schema.items()
        }
    if isinstance(schema, list):
        return [_rebased(value, base) for value in schema]
    return schema
