"""vLLM's tests/entrypoints/openai/chat_completion/test_tool_choice_null.py over HTTP: an
explicit `"tool_choice": null` means what an absent one means."""

from __future__ import annotations

import httpx
import pytest

from tests.server.helpers import assert_error

MESSAGES = [{"role": "user", "content": "what is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {}}}}]  # fmt: skip


def chat(server, **fields) -> httpx.Response:
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    return httpx.post(server.url + "/v1/chat/completions", json=body | fields, timeout=60)


@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no-tools"])
def test_null_tool_choice_means_an_absent_one(server, tools):
    """test_null_tool_choice_defaults_to_auto_like_an_absent_one,
    test_null_tool_choice_without_tools_matches_an_absent_one: the same answer (greedy)."""
    extra = {} if tools is None else {"tools": tools}
    omitted, explicit_null = chat(server, **extra), chat(server, tool_choice=None, **extra)
    assert omitted.status_code == explicit_null.status_code == 200, explicit_null.text
    assert omitted.json()["choices"] == explicit_null.json()["choices"]


def test_null_tool_choice_does_not_conflict_with_structured_outputs(server):
    """test_null_tool_choice_does_not_conflict_with_structured_outputs: accepted, the answer
    constrained."""
    response = chat(server, tool_choice=None, structured_outputs={"choice": ["yes", "no"]})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] in ("yes", "no")


@pytest.mark.parametrize(
    ("tool_choice", "tools"), [("bogus", TOOLS), ("auto", None)], ids=["bogus", "auto-no-tools"]
)
def test_invalid_tool_choice_is_still_rejected(server, tool_choice, tools):
    """test_invalid_tool_choice_is_still_rejected: an unknown choice, or auto without tools,
    is a 400 naming tool_choice."""
    extra = {} if tools is None else {"tools": tools}
    assert_error(chat(server, tool_choice=tool_choice, **extra), 400, param="tool_choice")


def test_explicit_none_tool_choice_is_untouched(server):
    """test_explicit_none_tool_choice_is_untouched: "none" answers without calls."""
    response = chat(server, tools=TOOLS, tool_choice="none")
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"].get("tool_calls") in (None, [])
