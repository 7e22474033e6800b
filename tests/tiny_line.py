"""The check every model line's tiny checkpoint passes: `pegainfer-tiny LINE` writes it, the
offline API generates from it, and the server answers a chat and a streamed completion."""

from __future__ import annotations

from pathlib import Path

import openai

from pegainfer.core.llm import LLM
from pegainfer.core.sampling.sampling_params import SamplingParams
from pegainfer.core.tiny import main as tiny_main
from tests.server.conftest import start_server, stop_server


def check_tiny_checkpoint_generates_and_serves(
    tmp_path: Path, line: str, prompt: str = "Hello there", max_tokens: int = 6
) -> None:
    model = tmp_path / f"tiny-{line}"
    assert tiny_main([line, str(model), "--num-shards", "2"]) == 0
    llm = LLM(str(model), max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    [out] = llm.generate([prompt], params)
    assert len(out.token_ids) == max_tokens
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
