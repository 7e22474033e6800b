"""The tiny GLM-5 checkpoint's tokenizer and chat template: GLM-5's layout (tools in a first
system part, thinking and calls in the assistant turns, tool results after one observation,
`enable_thinking` and `clear_thinking`), rendered by core's tokenizer as transformers renders
it; the tags are single tokens that decoding keeps; an answer parsed by the line's parsers goes
back into the history as the model wrote it."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pegainfer.core.loading.generation_config import GenerationDefaults
from pegainfer.core.text.tokenizer import Tokenizer
from pegainfer.models.glm5.line import Glm5Line
from pegainfer.models.glm5.tiny import END_OF_TURN, TAG_TOKENS, write_tiny_glm5
from pegainfer.server import parsers
from pegainfer.server.chat import AnswerParser, template_call
from pegainfer.server.reasoning import GlmThinkSplitter
from pegainfer.server.tool_calls import GlmToolCalls, whole_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}]  # fmt: skip
WEATHER_CALL = {"id": "call_1", "type": "function", "function": {
    "name": "get_weather", "arguments": {"city": "巴黎", "days": 2}}}  # fmt: skip
HEADER = (
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TOOLS[0], ensure_ascii=False)
    + "\n</tools>\n\nFor each function call, output the function name and arguments within the "
    "following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>"
    "{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>"
    "...</tool_call>"
)
CHATS = {
    "plain": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "tool_round_trip": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "\nI need the tool.\n",
         "tool_calls": [WEATHER_CALL, WEATHER_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ],
    "reasoning_history": [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "<think>Add them.</think>2"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Again."},
    ],
}  # fmt: skip


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-glm5-tokenizer")
    write_tiny_glm5(out, weights=False)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


@pytest.mark.parametrize("name", sorted(CHATS))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize(
    "kwargs", [{}, {"enable_thinking": False}, {"clear_thinking": False}], ids=str
)
def test_renders_as_transformers_does(tok_dir, tok, name, with_tools, kwargs):
    hf = AutoTokenizer.from_pretrained(tok_dir)
    tools = TOOLS if with_tools else None
    expected = hf.apply_chat_template(CHATS[name], tools=tools, add_generation_prompt=True,
                                      tokenize=False, **kwargs)  # fmt: skip
    got = tok.apply_chat_template(CHATS[name], tools=tools, **kwargs)
    assert got == expected
    assert (
        tok.encode(got, add_special_tokens=False) == hf(got, add_special_tokens=False)["input_ids"]
    )


def test_renders_glm5s_layout(tok):
    text = tok.apply_chat_template(CHATS["tool_round_trip"], tools=TOOLS)
    call = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>巴黎</arg_value>" \
           "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"  # fmt: skip
    assert text == (
        "[gMASK]<sop>" + HEADER + "<|user|>Weather in Paris?"
        "<|assistant|><think>I need the tool.</think>Checking."
        + call
        + call
        + "<|observation|><tool_response>sunny</tool_response><tool_response>rain</tool_response>"
        "<|assistant|><think>"
    )
    off = tok.apply_chat_template(CHATS["plain"], enable_thinking=False)
    assert off == "[gMASK]<sop><|system|>Be brief.<|user|>Hi<|assistant|></think>"
    # Thinking before the last user turn is dropped, unless clear_thinking is false.
    history = tok.apply_chat_template(CHATS["reasoning_history"], add_generation_prompt=False)
    assert history == ("[gMASK]<sop><|user|>1+1?<|assistant|></think>2<|user|>2+2?"
                       "<|assistant|><think>Again.</think>4")  # fmt: skip
    kept = tok.apply_chat_template(CHATS["reasoning_history"], clear_thinking=False)
    assert "<|assistant|><think>Add them.</think>2" in kept


def test_tags_are_single_tokens_kept_by_decoding(tok, tok_dir):
    for tag in [*TAG_TOKENS, "[gMASK]", "<sop>", "<|observation|>"]:
        assert len(tok.encode(tag, add_special_tokens=False)) == 1, tag
    answer = "<think>hm</think>ok<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value>" \
             "</tool_call><|observation|>"  # fmt: skip
    ids = tok.encode(answer, add_special_tokens=False)
    assert tok.decode(ids) == answer.removesuffix("<|observation|>")
    eos = GenerationDefaults.from_dir(tok_dir, tok.eos_token_id).eos_token_ids
    assert eos == tuple(tok.token_to_id(t) for t in END_OF_TURN)


@pytest.mark.parametrize("thinking", [True, False])
def test_a_parsed_answer_goes_back_as_it_was_written(tok, thinking):
    """The answer the model writes after the generation prompt, read by the line's parsers and
    sent back as the assistant turn of the next request, renders as the model wrote it."""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = tok.apply_chat_template(messages, tools=TOOLS, enable_thinking=thinking)
    answer = (("I need the tool.</think>" if thinking else "") + "Checking."
              "<tool_call>get_weather<arg_key>city</arg_key><arg_value> 巴黎\n</arg_value>"
              "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>")  # fmt: skip
    kwargs = {"enable_thinking": thinking}
    parser = AnswerParser(partial(GlmThinkSplitter.for_request, kwargs),
                          partial(GlmToolCalls.for_request, TOOLS))  # fmt: skip
    reasoning, content, pieces = parser.feed(answer, last=True)
    calls = [call.as_openai() for call in whole_calls(pieces)]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": " 巴黎\n", "days": 2}
    turn = {"role": "assistant", "content": content, "reasoning_content": reasoning or None,
            "tool_calls": [template_call(c, "call") for c in calls]}  # fmt: skip
    history = tok.apply_chat_template([*messages, turn], tools=TOOLS, add_generation_prompt=False,
                                      **kwargs)  # fmt: skip
    assert history == prompt + answer


def test_the_line_names_glms_parsers():
    line = Glm5Line()
    defaults = {"reasoning": line.reasoning_parser, "tool_call": line.tool_call_parser}
    chosen = parsers.resolve(parsers.registry(), {}, defaults)
    assert chosen == {"reasoning": GlmThinkSplitter, "tool_call": GlmToolCalls}
