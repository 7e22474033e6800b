"""What the vLLM contract modules share: one tiny Qwen3 server for the folder, an `openai` client
on it, and the checkpoint's own tokenizer, read with the `tokenizers` library as a client would,
independent of the server.

The server is the other server tests' (tests/server/conftest.py) with a longer context: the
tiny tokenizer spells the chat template's tool preamble in about 800 tokens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from tokenizers import Tokenizer

from tests.server.conftest import Server, start_server, stop_server

MAX_MODEL_LEN = 2048


@pytest.fixture(scope="package")
def server(tiny_model, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("vllm-contract-log") / "server.log"
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    running = start_server(
        tiny_model, log, "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "64",
        "--block-size", "8", env=env,
    )  # fmt: skip
    yield running
    stop_server(running)


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
