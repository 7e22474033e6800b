"""vLLM's tests/entrypoints/openai/basic/test_return_token_ids.py: `return_token_ids` gives
`prompt_token_ids` and `token_ids`, consistent with the text, logprobs and prompt_logprobs;
null without it."""

from __future__ import annotations

from tests.server.helpers import tokenize

EMOJI_PROMPT = "Complete this sentence with emojis: I love coding 🚀"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given location",
    "parameters": {"type": "object", "required": ["location"], "properties": {
        "location": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}]  # fmt: skip
WEATHER = [{"role": "system", "content": "You are a helpful assistant."},
           {"role": "user", "content": "What's the weather like in Paris?"}]  # fmt: skip
EMOJI_CHAT = [{"role": "system", "content": "You like to use emojis in your responses."},
              {"role": "user", "content": "Repeat after me: I love cats 🐱"}]  # fmt: skip


def test_basic_completion_with_emoji(client, server, hf_tokenizer):
    """test_basic_completion_with_emoji: prompt_token_ids are the prompt's; token_ids decode to
    the text; both null when not asked."""
    kwargs = dict(model=server.model, prompt=EMOJI_PROMPT, max_tokens=10, temperature=0,
                  logprobs=1)  # fmt: skip
    choice = client.completions.create(**kwargs, extra_body={"return_token_ids": True}).choices[0]
    assert choice.model_extra["prompt_token_ids"] == hf_tokenizer.encode(EMOJI_PROMPT).ids
    token_ids = choice.model_extra["token_ids"]
    assert token_ids and hf_tokenizer.decode(token_ids).startswith(choice.text)

    without = client.completions.create(**kwargs, extra_body={"return_token_ids": False})
    dumped = without.model_dump()["choices"][0]
    assert dumped.get("token_ids") is None and dumped.get("prompt_token_ids") is None


def test_chat_completion_with_tool_use(client, server, hf_tokenizer):
    """test_chat_completion_with_tool_use: with tools offered, the response's prompt_token_ids
    hold the conversation and the choice's token_ids the answer; null when not asked."""
    kwargs = dict(model=server.model, messages=WEATHER, tools=TOOLS, tool_choice="auto",
                  max_tokens=5, temperature=0, logprobs=True)  # fmt: skip
    reply = client.chat.completions.create(**kwargs, extra_body={"return_token_ids": True})
    prompt_text = hf_tokenizer.decode(reply.model_extra["prompt_token_ids"])
    assert "You are a helpful assistant" in prompt_text
    assert "What's the weather like in Paris?" in prompt_text
    token_ids = reply.choices[0].model_extra["token_ids"]
    assert len(token_ids) == reply.usage.completion_tokens > 0
    for call in reply.choices[0].message.tool_calls or []:
        assert call.function.name == "get_weather"

    without = client.chat.completions.create(**kwargs, extra_body={"return_token_ids": False})
    assert without.choices[0].model_extra["token_ids"] is None
    assert without.model_extra["prompt_token_ids"] is None


def test_comparison_with_prompt_logprobs_and_logprobs(client, server, hf_tokenizer):
    """test_comparison_with_prompt_logprobs_and_logprobs: with echo, return_token_ids and
    return_tokens_as_token_ids, the logprobs' ids end with token_ids; streamed, the first
    chunk carries prompt_token_ids and the token_ids of all chunks equal the logprobs' ids."""
    prompt = "Hello, world! How are you today?"
    completion = client.completions.create(
        model=server.model, prompt=prompt, max_tokens=20, temperature=0, echo=True, logprobs=1,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True,
                    "prompt_logprobs": 1},
    )  # fmt: skip
    choice = completion.choices[0]
    token_ids = choice.model_extra["token_ids"]
    prompt_ids = choice.model_extra["prompt_token_ids"]
    assert choice.model_extra["prompt_logprobs"] is not None
    logprob_ids = [int(token.removeprefix("token_id:")) for token in choice.logprobs.tokens]
    assert logprob_ids == prompt_ids + token_ids
    assert "Hello, world" in hf_tokenizer.decode(prompt_ids)
    assert choice.text.endswith(hf_tokenizer.decode(token_ids))

    streamed_prompt, streamed_ids, logprob_ids = None, [], []
    for chunk in client.completions.create(
        model=server.model, prompt="Tell me a short fact about Python:", max_tokens=12,
        temperature=0, stream=True, logprobs=1,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
    ):  # fmt: skip
        streamed = chunk.choices[0]
        if streamed_prompt is None:
            streamed_prompt = streamed.model_extra["prompt_token_ids"]
        logprob_ids += [int(t.removeprefix("token_id:")) for t in streamed.logprobs.tokens]
        streamed_ids += streamed.model_extra["token_ids"]
    assert streamed_prompt == tokenize(server, prompt="Tell me a short fact about Python:")
    assert streamed_ids == logprob_ids and streamed_ids


def test_chat_completion_with_emoji_and_token_ids(client, server, hf_tokenizer):
    """test_chat_completion_with_emoji_and_token_ids: prompt_token_ids decode to the rendered
    conversation; streamed, only the first chunk has them, and the chunks' token_ids decode to
    the streamed content."""
    kwargs = dict(model=server.model, messages=EMOJI_CHAT, max_tokens=12, temperature=0)
    reply = client.chat.completions.create(**kwargs, logprobs=True,
                                           extra_body={"return_token_ids": True})  # fmt: skip
    decoded_prompt = hf_tokenizer.decode(reply.model_extra["prompt_token_ids"])
    assert "You like to use emojis in your responses" in decoded_prompt
    assert "I love cats 🐱" in decoded_prompt
    assert reply.choices[0].model_extra["token_ids"]

    content, token_ids = "", []
    for number, chunk in enumerate(client.chat.completions.create(
        **kwargs, stream=True, extra_body={"return_token_ids": True}
    )):  # fmt: skip
        if number == 0:
            assert hf_tokenizer.decode(chunk.model_extra["prompt_token_ids"]) == decoded_prompt
        else:
            assert "prompt_token_ids" not in chunk.model_dump(exclude_unset=True)
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            token_ids += chunk.choices[0].model_extra.get("token_ids") or []
    assert content and hf_tokenizer.decode(token_ids) == content
