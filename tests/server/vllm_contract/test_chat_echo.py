"""vLLM's tests/entrypoints/openai/basic/test_chat_echo.py: continue_final_message without
add_generation_prompt continues the assistant's message; chat's `echo`, which we do not
implement, is refused with a 400 naming it (README)."""

from __future__ import annotations

import openai
import pytest

SAYING = "Here is a common saying about apple. An apple a day, keeps"
MESSAGES = [{"role": "user", "content": "tell me a common saying"},
            {"role": "assistant", "content": SAYING}]  # fmt: skip


def test_chat_session_with_continue_final_message(client, server):
    """test_chat_session_with_echo_and_continue_final_message, echo=False: the answer goes on
    from the final message (its text not repeated), finish_reason stop or length."""
    reply = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=8,
        extra_body={"echo": False, "continue_final_message": True,
                    "add_generation_prompt": False},
    )  # fmt: skip
    assert reply.id and len(reply.choices) == 1
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.role == "assistant"
    assert choice.message.content is not None and SAYING not in choice.message.content


def test_chat_session_with_echo_is_refused(client, server):
    """test_chat_session_with_echo_and_continue_final_message, echo=True: refused by name."""
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.chat.completions.create(
            model=server.model, messages=MESSAGES, max_tokens=8,
            extra_body={"echo": True, "continue_final_message": True,
                        "add_generation_prompt": False},
        )  # fmt: skip


def test_continue_final_message_with_add_generation_prompt_is_refused(client, server):
    """vLLM's request validation: continue_final_message and add_generation_prompt together
    are a 400."""
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(
            model=server.model, messages=MESSAGES, max_tokens=2,
            extra_body={"continue_final_message": True, "add_generation_prompt": True},
        )  # fmt: skip
