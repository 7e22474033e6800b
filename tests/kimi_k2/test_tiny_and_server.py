"""The tiny Kimi-K2 checkpoint (`pegainfer-tiny kimi-k2`) loads, generates offline, and is
served end to end."""

from __future__ import annotations

import openai

from pegainfer.core.llm import LLM
from pegainfer.core.sampling.sampling_params import SamplingParams
from pegainfer.core.tiny import main as tiny_main
from tests.server.conftest import start_server, stop_server


def test_tiny_checkpoint_generates_and_serves(tmp_path):
    model = tmp_path / "tiny-kimi"
    assert tiny_main(["kimi-k2", str(model), "--num-shards", "2"]) == 0
    llm = LLM(str(model), max_model_len=256)
    [out] = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=6,
                                                          ignore_eos=True))  # fmt: skip
    assert len(out.token_ids) == 6
    del llm
    server = start_server(model, tmp_path / "server.log", "--max-model-len", "256")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="none")
        reply = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
            temperature=0,
        )  # fmt: skip
        assert reply.usage.completion_tokens >= 1 and reply.choices[0].finish_reason
        assert reply.usage.prompt_tokens > 4  # the chat template's turn markers
    finally:
        stop_server(server)
