"""Kimi-K2's tokenizer (tiktoken.model converted at load) against tiktoken itself, run as
Kimi's remote code runs it: Kimi's split regex, the 256 reserved ids after the base vocabulary
as special tokens, every one allowed in text. On the tiny tokenizer in the real format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Regex, pre_tokenizers

from pegainfer.core.errors import ConfigError
from pegainfer.core.sampling.structured_output import Grammars, StructuredOutput
from pegainfer.core.text.tiktoken_bpe import read_tiktoken_ranks
from pegainfer.core.text.tokenizer import Tokenizer
from pegainfer.models.kimi_k2.line import KimiK2Line
from pegainfer.models.kimi_k2.tiny_tokenizer import (
    NOT_SPECIAL,
    SPECIAL_OFFSETS,
    write_tiny_kimi_tokenizer,
)
from pegainfer.models.kimi_k2.tokenizer import (
    NUM_RESERVED_SPECIAL_TOKENS,
    SPLIT_PATTERN,
    load_kimi_tokenizer,
)
from pegainfer.server import parsers
from pegainfer.server.reasoning import KimiK2ThinkSplitter
from pegainfer.server.tool_calls import KimiK2ToolCalls
from tests.tokenizer_texts import CORPUS, random_texts

tiktoken = pytest.importorskip("tiktoken")

MARKERS = [*SPECIAL_OFFSETS, *NOT_SPECIAL]
KIMI_TEXTS = [
    "北京今天天气怎么样？It's sunny, 25°C. HTTPServer JSONDecoder",
    "中文English混合Text123456 函数调用 don't WON'T I'M We'Ve",
    "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "<think>plan</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "北京"}<|tool_call_end|><|tool_calls_section_end|>',
    "<|im_end <|tool_call|> <|reserved_token_5|> [BOS][EOS]",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kimi-tokenizer")
    assert write_tiny_kimi_tokenizer(out) == 1024
    return out


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return load_kimi_tokenizer(tok_dir)


@pytest.fixture(scope="module")
def reference(tok_dir):
    """tiktoken as tokenization_kimi.py builds it: names from added_tokens_decoder, the rest
    of the reserved ids `<|reserved_token_{id}|>`."""
    ranks = read_tiktoken_ranks(tok_dir / "tiktoken.model")
    base = len(ranks)
    decoder = json.loads((tok_dir / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    names = {int(i): entry["content"] for i, entry in decoder.items()}
    specials = {
        names.get(i, f"<|reserved_token_{i}|>"): i
        for i in range(base, base + NUM_RESERVED_SPECIAL_TOKENS)
    }
    return tiktoken.Encoding("kimi-tiny", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks,
                             special_tokens=specials)  # fmt: skip


def test_encodes_like_tiktoken_and_decodes_back(tok, reference):
    texts = [*CORPUS, *KIMI_TEXTS, *random_texts(2000, MARKERS, seed=1)]
    for text in texts:
        ids = tok.encode(text)
        assert ids == reference.encode(text, allowed_special="all"), text
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_the_split_regex_is_kimis(tok):
    """Han runs are pieces of their own, a case run keeps its contraction and digits go in
    threes, where the default (cl100k-style) regex transformers falls back to would join the
    Han with the Latin letters."""
    split = pre_tokenizers.Split(Regex(SPLIT_PATTERN), "isolated")
    pieces = [piece for piece, _ in split.pre_tokenize_str("你好World's 12345")]
    assert pieces == ["你好", "World's", " ", "123", "45"]


def test_special_tokens_and_ids(tok, tok_dir):
    base = 768
    assert tok.vocab_size == base + 256
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (base, base + 1, base + 255)
    for token, offset in (SPECIAL_OFFSETS | NOT_SPECIAL).items():
        assert tok.encode(token) == [base + offset], token
        assert tok.id_to_token(base + offset) == token
    assert tok.id_to_token(base + 5) == f"<|reserved_token_{base + 5}|>"
    # Every reserved id is special except the two the config marks otherwise.
    expected = set(range(base, base + 256)) - {base + o for o in NOT_SPECIAL.values()}
    assert tok.special_token_ids == expected
    ids = tok.encode("<|im_assistant|>assistant<|im_middle|><think>hm</think>ok<|im_end|>")
    assert tok.decode(ids) == "assistant<think>hm</think>ok"
    generation = json.loads((tok_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == base + SPECIAL_OFFSETS["<|im_end|>"]


def test_chat_template_renders_kimis_format(tok):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather in Beijing?"},
        {"role": "assistant", "content": "", "reasoning_content": "need the tool",
         "tool_calls": [{"id": "functions.get_weather:0", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Beijing"}'}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "Sunny"},
    ]  # fmt: skip
    text = tok.apply_chat_template(messages, tools=tools)
    assert text == (
        '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":'
        '"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]'
        "<|im_end|>"
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI."
        "<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather in Beijing?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>need the tool</think>"
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nSunny<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    ids = tok.encode(text, add_special_tokens=False)
    markers = [tok.id_to_token(i) for i in ids if i in tok.special_token_ids or i >= 768]
    assert markers.count("<|tool_call_begin|>") == 1 and markers.count("<|im_end|>") == 5
    # Reasoning before the last user turn is dropped, as K2-Thinking's template does.
    later = [*messages, {"role": "user", "content": "And Paris?"}]
    assert "<think></think>" in tok.apply_chat_template(later, tools=tools)


def test_grammars_compile_against_it(tok):
    grammars = Grammars(lambda: tok, tok.vocab_size)
    output = StructuredOutput.choice(["北京", "Shanghai"])
    matcher = grammars.matcher(output, [tok.eos_token_id])
    assert matcher.consume_tokens(tok.encode("北京"))
    assert matcher.consume_token(tok.eos_token_id) and matcher.is_stopped()


def test_bad_checkpoints_are_refused(tok_dir, tmp_path):
    with pytest.raises(ConfigError, match="no tiktoken.model"):
        load_kimi_tokenizer(tmp_path)
    (tmp_path / "tiktoken.model").write_bytes((tok_dir / "tiktoken.model").read_bytes())
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["2000"] = {"content": "<|far|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"'<\|far\|>' has id 2000, outside the 256 reserved"):
        load_kimi_tokenizer(tmp_path)


def test_the_instruct_template_writes_no_thinking(tok, tmp_path):
    write_tiny_kimi_tokenizer(tmp_path, thinking=False)
    instruct = load_kimi_tokenizer(tmp_path)
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"},
                {"role": "user", "content": "Bye"}]  # fmt: skip
    thinking = tok.apply_chat_template(messages)
    assert "<think></think>Hello." in thinking
    assert instruct.apply_chat_template(messages) == thinking.replace("<think></think>", "")


def test_the_line_picks_parsers_by_checkpoint(tok_dir, tok, tmp_path):
    """kimi_k2 calls for every checkpoint; kimi_k2 reasoning for those that think: a chat
    template that writes thinking (K2-Thinking's), or K2.5/K2.6's model type, not K2-Instruct."""
    line = KimiK2Line()
    assert line.tokenizer_file == "tiktoken.model"
    assert line.load_tokenizer(tok_dir).encode(KIMI_TEXTS[3]) == tok.encode(KIMI_TEXTS[3])
    write_tiny_kimi_tokenizer(tmp_path, thinking=False)
    cases = [(tok_dir, "kimi_k2", KimiK2ThinkSplitter), (tmp_path, "kimi_k2", None),
             (tmp_path, "kimi_k25", KimiK2ThinkSplitter)]  # fmt: skip
    for directory, model_type, reasoning in cases:
        defaults = {"reasoning": line.reasoning_parser_for({"model_type": model_type}, directory),
                    "tool_call": line.tool_call_parser}  # fmt: skip
        chosen = parsers.resolve(parsers.registry(), {}, defaults)
        assert chosen == {"reasoning": reasoning, "tool_call": KimiK2ToolCalls}, model_type
