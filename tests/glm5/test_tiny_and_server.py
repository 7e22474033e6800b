"""The tiny GLM-5 checkpoint (`pegainfer-tiny glm5`) loads, generates offline past its
index_topk, and is served end to end."""

from __future__ import annotations

import openai

from pegainfer.core.llm import LLM
from pegainfer.core.sampling.sampling_params import SamplingParams
from pegainfer.core.tiny import main as tiny_main
from tests.server.conftest import start_server, stop_server


def test_tiny_checkpoint_generates_and_serves(tmp_path):
    model = tmp_path / "tiny-glm5"
    assert tiny_main(["glm5", str(model), "--num-shards", "2"]) == 0
    llm = LLM(str(model), max_model_len=256)
    prompt = "Once upon a time there was a tiny model that attended to a few keys only"
    [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert len(out.token_ids) == 24
    del llm
    server = start_server(model, tmp_path / "server.log", "--max-model-len", "256")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="none")
        reply = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
            temperature=0,
        )  # fmt: skip
        assert reply.usage.completion_tokens >= 1 and reply.choices[0].finish_reason
        chunks = list(client.completions.create(model=server.model, prompt="Once", max_tokens=4,
                                                stream=True, temperature=0))  # fmt: skip
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert reasons[-1] in ("length", "stop") and len(reasons) >= 2
    finally:
        stop_server(server)
