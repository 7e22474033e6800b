"""tiktoken ranks -> tokenizers: the converter on small vocabularies, including the quirks a
ranks file that BPE did not train can have, and the inputs it refuses. The model lines' tests
hold it to tiktoken on their real vocabularies (Qwen3's, Kimi-K2's)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from pegainfer.core.text.tiktoken_bpe import (
    byte_level_bpe_ranks,
    convert_tiktoken_bpe,
    read_tiktoken_ranks,
    write_tiktoken_ranks,
)
from pegainfer.core.text.tiny_tokenizer import train_tiny_bpe
from tests.tokenizer_texts import CORPUS, random_texts

tiktoken = pytest.importorskip("tiktoken")


def _ranks_file(path: Path, tokens: list[bytes]) -> Path:
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_vocabularies_that_bpe_did_not_train(tmp_path):
    # "xyz" forms by no merge (neither "xy" nor "yz" is a token), only as a whole piece;
    # "abc" ranks below its part "ab", so rank-capped merging would never form it.
    tokens = [bytes([b]) for b in range(256)] + [b"xyz", b"abc", b"ab", b" a"]
    ranks_file = _ranks_file(tmp_path / "odd.tiktoken", tokens)
    pattern = r" ?\S+|\s+"
    specials = {"<|end|>": len(tokens)}
    ours = convert_tiktoken_bpe(
        read_tiktoken_ranks(ranks_file), pattern=pattern, special_tokens=specials, added_tokens={}
    )
    reference = tiktoken.Encoding(
        "odd", pat_str=pattern, mergeable_ranks=read_tiktoken_ranks(ranks_file),
        special_tokens=specials,
    )  # fmt: skip
    for text in ["xyz", "xyzz abcd abc ab  abab", "  xyz<|end|>abc", *random_texts(50)]:
        assert ours.encode(text).ids == reference.encode(text, allowed_special="all"), text
    assert ours.encode("xyz abcd").ids == [256, 32, 257, 100]
    assert json.loads(ours.to_str())["model"]["ignore_merges"] is True


def test_bad_inputs_are_refused(tmp_path):
    byte_ranks = {bytes([b]): b for b in range(256)}
    with pytest.raises(ValueError, match="next free id is 256"):
        convert_tiktoken_bpe(
            byte_ranks, pattern=r"\S+", special_tokens={"<s>": 300}, added_tokens={}
        )
    with pytest.raises(ValueError, match="every single byte"):
        convert_tiktoken_bpe({b"a": 0, b"b": 1}, pattern=r"\S+", special_tokens={}, added_tokens={})
    with pytest.raises(ValueError, match="the ranks must be 0..256"):
        convert_tiktoken_bpe(
            byte_ranks | {b"ab": 300}, pattern=r"\S+", special_tokens={}, added_tokens={}
        )
    (tmp_path / "bad.tiktoken").write_text("QQ== 0\nnot base64\n")
    with pytest.raises(ValueError, match=r"bad.tiktoken:2: expected"):
        read_tiktoken_ranks(tmp_path / "bad.tiktoken")


def test_a_trained_bpe_round_trips_through_a_ranks_file(tmp_path):
    """A byte-level BPE's merges, written as tiktoken ranks and converted back, encode as the
    trained tokenizer does (and as tiktoken does with the same file)."""
    pattern = r"\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+"
    trained = train_tiny_bpe(pattern, 600)
    ranks = byte_level_bpe_ranks(trained)
    assert len(ranks) == trained.get_vocab_size() == 600
    write_tiktoken_ranks(tmp_path / "tiny.tiktoken", ranks)
    assert read_tiktoken_ranks(tmp_path / "tiny.tiktoken") == ranks
    ours = convert_tiktoken_bpe(ranks, pattern=pattern, special_tokens={}, added_tokens={})
    reference = tiktoken.Encoding("tiny", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    for text in [*CORPUS, *random_texts(200)]:
        ids = reference.encode(text)
        assert ours.encode(text).ids == ids, text
        assert [trained.id_to_token(i) for i in trained.encode(text).ids] == [
            ours.id_to_token(i) for i in ids
        ], text
