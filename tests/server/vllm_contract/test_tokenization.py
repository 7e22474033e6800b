"""vLLM's tests/entrypoints/openai/test_tokenization.py: /tokenize for prompts and
conversations (with tools, continue_final_message, add_generation_prompt, add_special_tokens),
return_token_strs, and /detokenize, against the checkpoint's tokenizer and chat template
rendered by transformers, as vLLM checks against its own. /tokenizer_info is not served
(README.md in this folder)."""

from __future__ import annotations

import httpx
import pytest

from tests.server.vllm_contract.conftest import MAX_MODEL_LEN

CONVERSATION = [
    {"role": "user", "content": "Hi there!"},
    {"role": "assistant", "content": "Nice to meet you!"},
    {"role": "user", "content": "Can I ask a question? vllm1"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def transformers_tokenizer(tiny_model):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tiny_model))


def post(server, path: str, **body) -> dict:
    response = httpx.post(server.url + path, json={"model": server.model, **body}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("add_special", [False, True])
def test_tokenize_completions(server, transformers_tokenizer, add_special):
    """test_tokenize_completions: tokens, count, max_model_len, token_strs null."""
    prompt = "vllm1 This is a test prompt."
    result = post(server, "/tokenize", prompt=prompt, add_special_tokens=add_special)
    tokens = transformers_tokenizer.encode(prompt, add_special_tokens=add_special)
    assert result == {"tokens": tokens, "count": len(tokens), "max_model_len": MAX_MODEL_LEN,
                      "token_strs": None}  # fmt: skip


@pytest.mark.parametrize("with_tools", [False, True], ids=["plain", "tools"])
@pytest.mark.parametrize(
    ("add_generation", "continue_final"), [(False, False), (True, False), (False, True)]
)
@pytest.mark.parametrize("add_special", [False, True])
def test_tokenize_chat(
    server, transformers_tokenizer, with_tools, add_generation, continue_final, add_special
):
    """test_tokenize_chat, test_tokenize_chat_with_tools: a conversation tokenizes as its
    template renders it, with each combination of the flags."""
    conversation = list(CONVERSATION)
    if continue_final:
        conversation.append({"role": "assistant", "content": "Sure,"})
    tools = TOOLS if with_tools else None
    prompt = transformers_tokenizer.apply_chat_template(
        conversation, tools=tools, add_generation_prompt=add_generation,
        continue_final_message=continue_final, tokenize=False,
    )  # fmt: skip
    tokens = transformers_tokenizer.encode(prompt, add_special_tokens=add_special)
    body = dict(messages=conversation, add_generation_prompt=add_generation,
                continue_final_message=continue_final, add_special_tokens=add_special)  # fmt: skip
    if with_tools:
        body["tools"] = TOOLS
    result = post(server, "/tokenize", **body)
    assert result == {"tokens": tokens, "count": len(tokens), "max_model_len": MAX_MODEL_LEN,
                      "token_strs": None}  # fmt: skip


def test_tokenize_with_return_token_strs(server, transformers_tokenizer):
    """test_tokenize_with_return_token_strs: token_strs are the tokenizer's own token strings."""
    prompt = "This is a token_strs test prompt! vllm1"
    result = post(server, "/tokenize", prompt=prompt, return_token_strs=True)
    tokens = transformers_tokenizer.encode(prompt, add_special_tokens=True)
    assert result["tokens"] == tokens and result["count"] == len(tokens)
    assert result["token_strs"] == transformers_tokenizer.convert_ids_to_tokens(tokens)


def test_detokenize(server, transformers_tokenizer):
    """test_detokenize: the text of the tokens, exactly."""
    prompt = "This is a test prompt. vllm1"
    tokens = transformers_tokenizer.encode(prompt, add_special_tokens=False)
    assert post(server, "/detokenize", tokens=tokens) == {"prompt": prompt}
