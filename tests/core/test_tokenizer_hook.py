"""A model line supplies the tokenizer loader for its checkpoints (`ModelLine.load_tokenizer`,
`ModelLine.tokenizer_file`): the frontend, the grammars and `--tokenizer` all go through it;
a line that does not override it gets core's `tokenizer.json` loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.engine.frontend import Frontend
from pegainfer.core.errors import ConfigError, ModelLineError
from pegainfer.core.sampling.structured_output import StructuredOutput
from pegainfer.core.text.tiny_tokenizer import write_tiny_tokenizer
from pegainfer.core.text.tokenizer import Tokenizer
from tests.core.plugin_fixture.counting_line import CountingLine

TEXT = "Hello, tokenizer hook!"


class OwnFormatLine(CountingLine):
    """Its checkpoints keep the tokenizer in `vocab.bin`, a format core does not read."""

    name = "own-format"
    tokenizer_file = "vocab.bin"

    def __init__(self) -> None:
        self.loaded: list[Path] = []

    def load_tokenizer(self, tokenizer_dir: Path) -> Tokenizer:
        self.loaded.append(tokenizer_dir)
        backend = BackendTokenizer.from_str((tokenizer_dir / "vocab.bin").read_text()[::-1])
        return Tokenizer(backend, special_tokens={"eos_token": "<|im_end|>"})


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(out, special_tokens=["<|im_end|>"], eos_token="<|im_end|>",
                         pad_token=None, chat_template="{{ messages[0].content }}")  # fmt: skip
    return out


def checkpoint(path: Path) -> Path:
    """A counting line's checkpoint (its vocabulary covers the tiny tokenizer's)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "counting", "vocab_size": 2048}))
    return path


def test_the_default_loader_reads_tokenizer_json(tiny_tokenizer):
    ours = CountingLine().load_tokenizer(tiny_tokenizer)
    assert ours.encode(TEXT) == Tokenizer.from_dir(tiny_tokenizer).encode(TEXT)


def test_a_line_loads_its_own_format_everywhere(tiny_tokenizer, tmp_path):
    own = tmp_path / "own"
    own.mkdir()
    (own / "vocab.bin").write_text((tiny_tokenizer / "tokenizer.json").read_text()[::-1])
    line = OwnFormatLine()
    model_dir = checkpoint(tmp_path / "ckpt")
    # --tokenizer is checked for the line's file, not tokenizer.json
    engine = EngineCore(EngineArgs(model=str(model_dir), device="cpu", tokenizer=str(own)), [line])
    assert engine.config.tokenizer_dir == own.resolve()

    frontend = Frontend.for_engine(engine.config, [line])
    expected = Tokenizer.from_dir(tiny_tokenizer)
    assert frontend.tokenizer.encode(TEXT) == expected.encode(TEXT)
    assert frontend.tokenizer.eos_token_id == expected.eos_token_id
    assert line.loaded == [own.resolve()]

    # The engine's grammars load the tokenizer through the line too, on first use.
    matcher = engine.grammars.matcher(StructuredOutput.choice(["yes"]), [expected.eos_token_id])
    assert not matcher.is_error()
    assert line.loaded == [own.resolve()] * 2
    engine.shutdown()


def test_tokenizer_dir_is_checked_for_the_lines_file(tiny_tokenizer, tmp_path):
    model_dir = checkpoint(tmp_path / "ckpt")
    args = EngineArgs(model=str(model_dir), device="cpu", tokenizer=str(tiny_tokenizer))
    with pytest.raises(ConfigError, match="holds no vocab.bin"):
        EngineCore(args, [OwnFormatLine()])


def test_a_line_that_is_not_installed_is_named(tiny_tokenizer, tmp_path):
    engine = EngineCore(
        EngineArgs(model=str(checkpoint(tmp_path / "ckpt")), device="cpu",
                   tokenizer=str(tiny_tokenizer)),
        [CountingLine()],
    )  # fmt: skip
    with pytest.raises(ModelLineError, match="no model line 'counting' is installed"):
        Frontend.for_engine(engine.config, [OwnFormatLine()])
    engine.shutdown()
