"""The server driven by the client libraries people put in front of OpenAI-compatible servers
(issue 28): langchain-openai, litellm and instructor, each check one a random-weight model can
answer (chat, streaming, usage, tools under tool_choice "required" or a named function with
nested pydantic models, structured output, completions, typed errors).

The libraries are heavy and are not in the dev group: each section is skipped where its library
is not installed. To run them all:

    pip install langchain-openai litellm instructor
    pytest -q tests/server/test_client_libraries.py
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.server.conftest import start_server, stop_server
from tests.server.helpers import MESSAGES, PROMPT, tokenize

MAX_TOKENS = 200  # ample for the bounded answers below


class Bounded(BaseModel):
    """No properties beyond the declared ones (OpenAI's strict schemas): a random model's
    answer then ends within MAX_TOKENS, as its keys and values are all bounded."""

    model_config = ConfigDict(extra="forbid")


class Place(Bounded):
    """A nested model: pydantic writes it under $defs and refers to it by $ref."""

    city: Literal["Oslo", "Paris", "Lima"]
    code: Annotated[str, Field(max_length=4)]


class Trip(Bounded):
    """Plan a trip."""

    to: Place
    days: Annotated[int, Field(ge=1, le=9)]
    tags: Annotated[list[Literal["sea", "hill"]], Field(max_length=2)]


class Tides(Bounded):
    """Tide times at a port."""

    port: Place


@pytest.fixture(scope="module")
def tool_server(tiny_model, tmp_path_factory):
    """A context long enough for the tools' schemas in the prompt and a bounded answer."""
    log = tmp_path_factory.mktemp("client-libraries") / "server.log"
    running = start_server(tiny_model, log, "--max-model-len", "2048",
                           "--tool-call-parser", "hermes")  # fmt: skip
    yield running
    stop_server(running)


def _prompt_tokens(server, **body) -> int:
    return len(tokenize(server, **body))


# ---------------------------------------------------------------------------- langchain-openai


@pytest.fixture(scope="module")
def langchain(tool_server):
    module = pytest.importorskip("langchain_openai")
    return module, dict(base_url=tool_server.base_url, api_key="unused", model=tool_server.model,
                        max_retries=0, timeout=120)  # fmt: skip


def test_langchain_chat_invoke_and_usage(langchain, tool_server):
    module, common = langchain
    chat = module.ChatOpenAI(**common, max_tokens=6, temperature=0,
                             extra_body={"ignore_eos": True})  # fmt: skip
    reply = chat.invoke(MESSAGES)
    assert isinstance(reply.content, str)
    assert reply.response_metadata["finish_reason"] == "length"
    prompt = _prompt_tokens(tool_server, messages=MESSAGES)
    assert reply.usage_metadata["input_tokens"] == prompt
    assert reply.usage_metadata["output_tokens"] == 6
    assert reply.usage_metadata["total_tokens"] == prompt + 6


def test_langchain_chat_stream_joins_to_the_answer_with_usage(langchain, tool_server):
    module, common = langchain
    chat = module.ChatOpenAI(**common, max_tokens=6, temperature=0, stream_usage=True,
                             extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(chat.stream(MESSAGES))
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert whole.content == chat.invoke(MESSAGES).content  # greedy: the same answer
    assert whole.usage_metadata["output_tokens"] == 6
    assert whole.usage_metadata["input_tokens"] == _prompt_tokens(tool_server, messages=MESSAGES)


def test_langchain_async_batch(langchain):
    module, common = langchain
    chat = module.ChatOpenAI(**common, max_tokens=4, temperature=0)
    replies = asyncio.run(chat.abatch([MESSAGES, [("user", "Name a colour.")]]))
    assert len(replies) == 2 and all(isinstance(r.content, str) for r in replies)


@pytest.mark.parametrize("tool_choice", ["required", "Trip"])
def test_langchain_tools_with_nested_models(langchain, tool_choice):
    """bind_tools turns pydantic models (nested through $defs) into tools; the forced call's
    arguments validate as the model."""
    module, common = langchain
    chat = module.ChatOpenAI(**common, max_tokens=MAX_TOKENS, temperature=1.0, seed=3)
    # One call: a random model would otherwise write calls until max_tokens.
    bound = chat.bind_tools([Trip, Tides], tool_choice=tool_choice, parallel_tool_calls=False)
    reply = bound.invoke("Plan a trip to the sea.")
    assert reply.tool_calls and not reply.invalid_tool_calls
    for call in reply.tool_calls:
        assert call["name"] in ("Trip", "Tides") and call["id"].startswith("call_")
        assert tool_choice == "required" or call["name"] == tool_choice
        {"Trip": Trip, "Tides": Tides}[call["name"]].model_validate(call["args"])


def test_langchain_streamed_tool_call_chunks_join_to_a_valid_call(langchain):
    module, common = langchain
    chat = module.ChatOpenAI(**common, max_tokens=MAX_TOKENS, temperature=1.0, seed=4)
    chunks = list(chat.bind_tools([Trip], tool_choice="Trip").stream("Plan a trip."))
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    (call,) = whole.tool_calls
    Trip.model_validate(call["args"])
    assert len([c for c in chunks if c.tool_call_chunks]) > 2  # the arguments streamed


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(langchain, method):
    module, common = langchain
    chat = module.ChatOpenAI(**common, max_tokens=MAX_TOKENS, temperature=1.0, seed=5)
    trip = chat.with_structured_output(Trip, method=method).invoke("Plan a trip.")
    assert isinstance(trip, Trip)


def test_langchain_completions_llm(langchain, tool_server):
    module, common = langchain
    llm = module.OpenAI(**common, max_tokens=5, temperature=0)
    text = llm.invoke(PROMPT)
    direct = openai.OpenAI(base_url=tool_server.base_url, api_key="unused").completions.create(
        model=tool_server.model, prompt=PROMPT, max_tokens=5, temperature=0
    )
    assert text == direct.choices[0].text


def test_langchain_errors_are_openai_errors(langchain):
    module, common = langchain
    with pytest.raises(openai.NotFoundError):
        module.ChatOpenAI(**(common | {"model": "no-such-model"}), max_tokens=2).invoke("hi")
    with pytest.raises(openai.BadRequestError) as bad:
        module.ChatOpenAI(**common, max_tokens=2, top_p=7.0).invoke("hi")
    assert "top_p" in str(bad.value)


# ------------------------------------------------------------------------------------ litellm


@pytest.fixture(scope="module")
def litellm(tool_server):
    module = pytest.importorskip("litellm")
    common = dict(model=f"openai/{tool_server.model}", api_base=tool_server.base_url,
                  api_key="unused", num_retries=0, timeout=120)  # fmt: skip
    return module, common


def test_litellm_completion_and_usage(litellm, tool_server):
    module, common = litellm
    reply = module.completion(**common, messages=MESSAGES, max_tokens=6, temperature=0,
                              extra_body={"ignore_eos": True})  # fmt: skip
    choice = reply.choices[0]
    assert isinstance(choice.message.content, str) and choice.finish_reason == "length"
    prompt = _prompt_tokens(tool_server, messages=MESSAGES)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt, 6)
    assert reply.usage.total_tokens == prompt + 6


def test_litellm_stream_with_usage(litellm, tool_server):
    module, common = litellm
    kwargs = dict(messages=MESSAGES, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    chunks = list(module.completion(**common, **kwargs, stream=True,
                                    stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == module.completion(**common, **kwargs).choices[0].message.content
    usage = module.stream_chunk_builder(chunks).usage
    assert usage.completion_tokens == 6
    assert usage.prompt_tokens == _prompt_tokens(tool_server, messages=MESSAGES)


def test_litellm_async_completion(litellm):
    module, common = litellm
    reply = asyncio.run(module.acompletion(**common, messages=MESSAGES, max_tokens=3))
    assert isinstance(reply.choices[0].message.content, str)


def _tool(model: type[BaseModel]) -> dict:
    return {"type": "function", "function": {"name": model.__name__,
            "description": model.__doc__, "parameters": model.model_json_schema()}}  # fmt: skip


@pytest.mark.parametrize("tool_choice", ["required", "Tides"])
def test_litellm_tools_with_nested_models(litellm, tool_choice):
    module, common = litellm
    choice = tool_choice
    if tool_choice != "required":
        choice = {"type": "function", "function": {"name": tool_choice}}
    reply = module.completion(**common, messages=[{"role": "user", "content": "Tides?"}],
                              tools=[_tool(Trip), _tool(Tides)], tool_choice=choice,
                              parallel_tool_calls=False,
                              max_tokens=MAX_TOKENS, temperature=1.0, seed=6)  # fmt: skip
    choice_ = reply.choices[0]
    assert choice_.finish_reason == "tool_calls" and choice_.message.tool_calls
    for call in choice_.message.tool_calls:
        model = {"Trip": Trip, "Tides": Tides}[call.function.name]
        assert tool_choice == "required" or model is Tides
        model.model_validate_json(call.function.arguments)


def test_litellm_response_format_pydantic(litellm):
    module, common = litellm
    reply = module.completion(**common, messages=[{"role": "user", "content": "Plan a trip."}],
                              response_format=Trip, max_tokens=MAX_TOKENS, temperature=1.0,
                              seed=7)  # fmt: skip
    Trip.model_validate_json(reply.choices[0].message.content)


def test_litellm_text_completion(litellm, tool_server):
    module, common = litellm
    reply = module.text_completion(**common, prompt=PROMPT, max_tokens=5, temperature=0)
    direct = openai.OpenAI(base_url=tool_server.base_url, api_key="unused").completions.create(
        model=tool_server.model, prompt=PROMPT, max_tokens=5, temperature=0
    )
    assert reply.choices[0].text == direct.choices[0].text
    assert reply.usage.completion_tokens == direct.usage.completion_tokens


def test_litellm_errors_are_mapped(litellm):
    module, common = litellm
    with pytest.raises(module.NotFoundError):
        module.completion(**(common | {"model": "openai/no-such-model"}), messages=MESSAGES,
                          max_tokens=2)  # fmt: skip
    with pytest.raises(module.BadRequestError) as bad:
        module.completion(**common, messages=MESSAGES, max_tokens=2, top_p=7.0)
    assert "top_p" in str(bad.value)


# ----------------------------------------------------------------------------------- instructor


@pytest.fixture(scope="module")
def instructor_clients(tool_server):
    module = pytest.importorskip("instructor")

    def make(mode, client_class=openai.OpenAI):
        client = client_class(base_url=tool_server.base_url, api_key="unused", max_retries=0)
        factory = module.from_openai
        return factory(client, mode=getattr(module.Mode, mode))

    return make, tool_server.model


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_returns_the_nested_model(instructor_clients, mode):
    """TOOLS forces a call of the model's function (a named tool_choice); JSON_SCHEMA sends
    response_format json_schema."""
    make, model = instructor_clients
    trip, completion = make(mode).chat.completions.create_with_completion(
        model=model, response_model=Trip, max_retries=0, max_tokens=MAX_TOKENS,
        temperature=1.0, seed=8, messages=[{"role": "user", "content": "Plan a trip."}],
    )  # fmt: skip
    assert isinstance(trip, Trip) and completion.usage.completion_tokens > 0


def test_instructor_streams_partial_models(instructor_clients):
    make, model = instructor_clients
    partials = list(make("TOOLS").chat.completions.create_partial(
        model=model, response_model=Trip, max_retries=0, max_tokens=MAX_TOKENS,
        temperature=1.0, seed=9, messages=[{"role": "user", "content": "Plan a trip."}],
    ))  # fmt: skip
    assert len(partials) > 2  # built up as the arguments stream
    Trip.model_validate(partials[-1].model_dump())


def test_instructor_async_client(instructor_clients):
    make, model = instructor_clients

    async def ask() -> Tides:
        client = make("TOOLS", openai.AsyncOpenAI)
        return await client.chat.completions.create(
            model=model, response_model=Tides, max_retries=0, max_tokens=MAX_TOKENS,
            temperature=1.0, seed=10, messages=[{"role": "user", "content": "Tides?"}],
        )  # fmt: skip

    assert isinstance(asyncio.run(ask()), Tides)


def test_instructor_sees_the_servers_refusal(instructor_clients):
    """A request the server refuses surfaces as the SDK's typed error (not retried)."""
    make, model = instructor_clients
    retried = pytest.importorskip("instructor.core").InstructorRetryException
    refusals = (openai.BadRequestError, retried)  # instructor may wrap the SDK's error
    with pytest.raises(refusals) as bad:
        make("TOOLS").chat.completions.create(
            model=model, response_model=Trip, max_retries=0, max_tokens=MAX_TOKENS,
            top_p=7.0, messages=[{"role": "user", "content": "Plan a trip."}],
        )  # fmt: skip
    assert "top_p" in str(bad.value)
