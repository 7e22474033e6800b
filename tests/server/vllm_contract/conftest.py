"""What the vLLM contract modules share: an `openai` client on the session's tiny Qwen3 server
(tests/server/conftest.py: `--max-model-len 512`, prefix caching on) and the checkpoint's own
tokenizer, read with the `tokenizers` library as a client would, independent of the server."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from tokenizers import Tokenizer

MAX_MODEL_LEN = 512  # the shared server's --max-model-len


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_model: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


@pytest.fixture(scope="session")
def vocab_size(tiny_model: Path) -> int:
    """The model's vocabulary (config.json), the bound token ids are checked against."""
    return json.loads((tiny_model / "config.json").read_text())["vocab_size"]
