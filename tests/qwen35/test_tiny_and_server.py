"""The tiny Qwen3.5 checkpoint is the real layout (transformers reads it to the same logits),
and the server serves it end to end."""

from __future__ import annotations

import openai
import pytest
import torch
import transformers

from pegainfer.models.qwen35.line import Qwen35Line
from tests.paged_runner import PagedRunner
from tests.qwen35.hf_reference import load_ours
from tests.server.conftest import start_server, stop_server


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen35-tiny")
    Qwen35Line().write_tiny_checkpoint(path, seed=4, num_shards=2)
    return path


def test_transformers_reads_the_tiny_checkpoint_to_our_logits(tiny):
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    tokens = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        reference = hf(torch.tensor([tokens])).logits[0]
    ours = PagedRunner(load_ours(tiny)).step({"a": tokens})["a"]
    assert (ours - reference).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    running = start_server(tiny, tmp_path_factory.mktemp("log") / "server.log",
                           "--max-model-len", "512", "--max-num-seqs", "8")  # fmt: skip
    yield running
    stop_server(running)


def test_chat_streams_and_completes(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="none")
    messages = [{"role": "user", "content": "Say something about gated deltas."}]
    full = client.chat.completions.create(model=server.model, messages=messages, max_tokens=12,
                                          temperature=0, seed=1)  # fmt: skip
    assert full.usage.completion_tokens > 0 and full.choices[0].finish_reason in {"stop", "length"}
    chunks = client.chat.completions.create(model=server.model, messages=messages, max_tokens=12,
                                            temperature=0, seed=1, stream=True)  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content


def test_an_image_is_refused_with_a_400(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="none")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    content = [{"type": "text", "text": "what is it?"}, image]
    with pytest.raises(openai.BadRequestError, match="not images"):
        client.chat.completions.create(
            model=server.model, max_tokens=4, messages=[{"role": "user", "content": content}]
        )
