"""Tests for the tokenizer and chat templates, held to transformers as the reference."""

from __future__ import annotations

import hashlib
import json
import unicodedata
from importlib import resources
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from pegainfer.core.errors import ConfigError, InvalidRequestError
from pegainfer.core.text.tiny_tokenizer import write_tiny_tokenizer
from pegainfer.core.text.tokenizer import Tokenizer

QWEN3_TEMPLATE = (
    resources.files("pegainfer.models.qwen3").joinpath("chat_template.jinja").read_text()
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
ADDED_TOKENS += ["<think>", "</think>"]


def write_qwen_like(out_dir: Path, chat_template: str = QWEN3_TEMPLATE) -> int:
    return write_tiny_tokenizer(
        out_dir,
        special_tokens=SPECIAL_TOKENS,
        added_tokens=ADDED_TOKENS,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template,
    )


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    write_qwen_like(out)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def hf(tok_dir: Path):
    return AutoTokenizer.from_pretrained(tok_dir)


# --- encode / decode -------------------------------------------------------------------------

TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and   inner   spaces\n\n\ttabs\r\nwindows newlines  ",
    "I'LL be there; you're sure? They'd've known.",
    "Numbers 1234567890 and 3.14159, -42, 1e-9.",
    "def f(x):\n    return {'a': [x, x ** 2]}\n",
    "Où est la bibliothèque ? Ça va, Zürich, São Paulo, ñ",
    "Cafe\u0301 decomposed e + combining acute (NFC normalizes it)",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "Emoji: 😀🎉🚀 family 👨‍👩‍👧 flag 🇫🇷 heart ❤️",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nreasoning\n</think>\n\nanswer <tool_call>{}</tool_call><|endoftext|>",
    "<|im_end|><|im_end|>text<|endoftext|>",
    "\x00\x01\x7f control chars and \ufffd replacement and \u200b zero width",
]


def test_tiny_tokenizer_loads_as_qwen2_in_transformers(hf, tok: Tokenizer) -> None:
    assert type(hf).__name__ == "Qwen2Tokenizer"
    assert tok.vocab_size == len(hf)
    assert tok.bos_token_id is None and hf.bos_token_id is None
    assert tok.eos_token_id == hf.eos_token_id == hf.convert_tokens_to_ids("<|im_end|>")
    assert tok.pad_token_id == hf.pad_token_id == hf.convert_tokens_to_ids("<|endoftext|>")
    special = {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert tok.special_token_ids == frozenset(special)
    assert tok.token_to_id("<think>") not in tok.special_token_ids


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, hf, text: str) -> None:
    expected = hf(text)["input_ids"]
    assert tok.encode(text) == expected
    assert tok.encode(text, add_special_tokens=False) == expected  # Qwen adds no BOS/EOS
    for skip in (True, False):
        assert tok.decode(expected, skip_special_tokens=skip) == hf.decode(
            expected, skip_special_tokens=skip
        )


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=60))
def test_encode_matches_transformers_on_any_text(tok: Tokenizer, hf, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf(text)["input_ids"]
    # Byte-level BPE is lossless up to NFC normalization.
    assert tok.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), skip=st.booleans())
def test_decode_matches_transformers_on_any_ids(tok: Tokenizer, hf, data, skip: bool) -> None:
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=30))
    assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_token_lookup(tok: Tokenizer, hf) -> None:
    for token in [*SPECIAL_TOKENS, *ADDED_TOKENS, "a", "Ġthe"]:
        assert tok.token_to_id(token) == hf.convert_tokens_to_ids(token)
        assert tok.id_to_token(tok.token_to_id(token)) == token
    assert tok.token_to_id("no such token, surely") is None
    assert tok.id_to_token(tok.vocab_size + 10) is None


def test_multibyte_characters_are_split_across_tokens(tok: Tokenizer) -> None:
    # The detokenizer tests rely on the tiny vocabulary splitting some characters into bytes.
    ids = tok.encode("😀🦀")
    assert any("\ufffd" in tok.decode([i]) for i in ids)


# --- tiny tokenizer files --------------------------------------------------------------------


def test_write_tiny_tokenizer_is_deterministic(tmp_path: Path) -> None:
    sizes = [write_qwen_like(tmp_path / name) for name in ("a", "b")]
    assert sizes[0] == sizes[1] == 1024 + len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        digests = {hashlib.sha256((tmp_path / d / name).read_bytes()).digest() for d in "ab"}
        assert len(digests) == 1, name


def test_write_tiny_tokenizer_puts_added_tokens_last(tmp_path: Path) -> None:
    total = write_qwen_like(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    added = [*SPECIAL_TOKENS, *ADDED_TOKENS]
    assert [tok.token_to_id(t) for t in added] == list(range(total - len(added), total))


def test_write_tiny_tokenizer_rejects_eos_outside_special_tokens(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="special_tokens"):
        write_tiny_tokenizer(
            tmp_path, special_tokens=["<a>"], eos_token="<b>", pad_token=None, chat_template=""
        )


# --- loading ---------------------------------------------------------------------------------


def test_missing_tokenizer_json_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_malformed_tokenizer_config_is_a_config_error(tmp_path: Path) -> None:
    write_qwen_like(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="tokenizer_config"):
        Tokenizer.from_dir(tmp_path)


def _edit_config(directory: Path, **changes: object) -> None:
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def test_special_tokens_may_be_added_token_dicts(tmp_path: Path) -> None:
    write_qwen_like(tmp_path)
    _edit_config(tmp_path, eos_token={"content": "<|endoftext|>", "special": True})
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_id == tok.token_to_id("<|endoftext|>")


def test_without_a_chat_template_chat_requests_are_refused(tmp_path: Path) -> None:
    write_qwen_like(tmp_path)
    _edit_config(tmp_path, chat_template=None)
    tok = Tokenizer.from_dir(tmp_path)
    assert not tok.has_chat_template
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_file_takes_precedence(tmp_path: Path) -> None:
    write_qwen_like(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content | upper }}")
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "HI"
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "HI"


def test_named_chat_templates(tmp_path: Path) -> None:
    write_qwen_like(tmp_path)
    templates = [
        {"name": "default", "template": "plain:{{ messages[0].content }}"},
        {"name": "tool_use", "template": "tools:{{ tools | length }}"},
    ]
    _edit_config(tmp_path, chat_template=templates)
    tok = Tokenizer.from_dir(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    for tools in (None, [{"type": "function", "function": {"name": "f"}}]):
        expected = hf.apply_chat_template(messages, tools=tools, tokenize=False)
        assert tok.apply_chat_template(messages, tools=tools) == expected
    assert tok.apply_chat_template(messages) == "plain:hi"


def test_invalid_template_is_a_config_error(tmp_path: Path) -> None:
    write_qwen_like(tmp_path, chat_template="{% if %}")
    with pytest.raises(ConfigError, match="not valid Jinja"):
        Tokenizer.from_dir(tmp_path)


# --- chat template rendering -----------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city. Unicode: °C, 東京 <b>&</b>",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}

CHATS = {
    "user": [{"role": "user", "content": "What is 2+2?"}],
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
    ],
    "multi_turn": [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
    "assistant_last": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ],
    "reasoning_in_content": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "<think>\nAgain.\n</think>\n\n6"},
    ],
    "reasoning_field": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
    ],
    "reasoning_alias": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning": "Add them."},
    ],
    "tool_calls": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18°C, sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "25°C, humid"},
        {"role": "assistant", "content": "Paris: 18°C; Tokyo: 25°C."},
        {"role": "user", "content": "Thanks!"},
    ],
    "tool_call_with_content": [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
        },
        {"role": "tool", "content": "-3°C"},
    ],
}


@pytest.mark.parametrize("name", sorted(CHATS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize(
    "template_kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}]
)
def test_qwen3_template_matches_transformers(
    tok: Tokenizer, hf, name: str, add_generation_prompt: bool, with_tools: bool, template_kwargs
) -> None:
    messages = CHATS[name]
    tools = [WEATHER_TOOL] if with_tools else None
    expected = hf.apply_chat_template(
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **template_kwargs,
    )
    got = tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs
    )
    assert got == expected
    assert (
        tok.encode(got, add_special_tokens=False) == hf(got, add_special_tokens=False)["input_ids"]
    )


def test_qwen3_template_renders_the_documented_format(tok: Tokenizer) -> None:
    # Pins the template text itself, independently of transformers: reasoning of earlier turns
    # is dropped, the last turn's is kept, and enable_thinking=False pre-fills an empty block.
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2", "reasoning_content": "R2"},
    ]
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nS<|im_end|>\n"
        "<|im_start|>user\nQ1<|im_end|>\n"
        "<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nR2\n</think>\n\nA2<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(messages[:2], enable_thinking=False)
    assert prompt.endswith(
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    tools_prompt = tok.apply_chat_template(messages[:2], tools=[WEATHER_TOOL])
    assert tools_prompt.startswith("<|im_start|>system\nS\n\n# Tools\n")
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in tools_prompt
    assert (
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        in tools_prompt
    )


def test_raise_exception_is_an_invalid_request(tmp_path: Path) -> None:
    template = (
        "{% if messages[0].role != 'user' %}"
        "{{ raise_exception('first must be user') }}{% endif %}ok"
    )
    write_qwen_like(tmp_path, chat_template=template)
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(InvalidRequestError, match="first must be user") as info:
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    assert info.value.param == "messages"


def test_malformed_messages_are_invalid_requests(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError):
        tok.apply_chat_template([])
    with pytest.raises(InvalidRequestError):
        tok.apply_chat_template(["not a dict"])  # type: ignore[list-item]
    with pytest.raises(InvalidRequestError):
        # The Qwen3 template concatenates a system message's content without checking it.
        tok.apply_chat_template(
            [{"role": "system", "content": 3}, {"role": "user", "content": "hi"}]
        )


def test_template_helpers_match_transformers(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token is defined }}|"
        "{{ documents is none }}|{{ messages[0] | tojson }}|"
        "{{ messages[0] | tojson(indent=2, sort_keys=true) }}|"
        "{{ messages[0] | tojson(separators=(',', ':'), ensure_ascii=true) }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m.role }}{% endfor %}|"
        "{% generation %}{{ messages[-1].content }}{% endgeneration %}|"
        "{{ messages[-1].thinking }}/{{ messages[-1].reasoning_content }}|"
        "{{ strftime_now('%Y') | length }}|{{ extra }}"
    )
    write_qwen_like(tmp_path, chat_template=template)
    _edit_config(tmp_path, bos_token="<|endoftext|>")
    tok = Tokenizer.from_dir(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    messages = [
        {"role": "user", "content": "Grüße <b>&'\"</b> 東京", "name": None},
        {"role": "assistant", "content": "x", "thinking": "deep"},
    ]
    expected = hf.apply_chat_template(messages, tokenize=False, extra="E")
    assert tok.apply_chat_template(messages, add_generation_prompt=False, extra="E") == expected
