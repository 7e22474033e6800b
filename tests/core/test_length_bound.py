"""A text's token count is bounded from below by its length, without tokenizing it, only where
the tokenizer's pipeline keeps every character; elsewhere no bound is claimed."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from pegainfer.core.text.length_bound import max_chars_per_token
from pegainfer.core.text.tiny_tokenizer import write_tiny_tokenizer
from pegainfer.core.text.tokenizer import Tokenizer

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Texts that a careless bound gets wrong: long runs a single token might swallow, characters
# that Unicode normalization folds together (Hangul jamo, stacked combining marks), special
# tokens written out, and bytes outside the trained vocabulary.
ADVERSARIAL = [
    " " * 5000,
    "\n" * 3000 + "\t" * 3000,
    "\u1100\u1161\u11a8" * 2000,  # Hangul jamo L V T: NFC makes each triple one syllable
    "\u03b1\u0313\u0300\u0345" * 1000,  # α with three marks: NFC folds 4 code points into 1
    "<|im_start|>" * 500 + "<|endoftext|>" * 500,
    "0123456789" * 500,
    "aaaaaaaa" * 1000,
    "😀🇫🇷👨‍👩‍👧" * 300,
    "hello world " * 800,
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out: Path = tmp_path_factory.mktemp("length-bound")
    write_tiny_tokenizer(out, special_tokens=SPECIAL, eos_token="<|im_end|>",
                         pad_token="<|endoftext|>", chat_template="")  # fmt: skip
    return Tokenizer.from_dir(out)


def test_the_byte_level_bpe_tokenizer_has_a_bound(tok: Tokenizer):
    # NFC (4x) times the longest token, added tokens included ("<|endoftext|>": 13).
    assert tok.max_chars_per_token == 4 * 13


@pytest.mark.parametrize("text", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_the_bound_never_exceeds_the_real_count_on_adversarial_texts(tok: Tokenizer, text: str):
    bound = tok.min_tokens(text)
    assert 0 < bound <= len(tok.encode(text, add_special_tokens=False))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(min_size=1, max_size=400))
def test_the_bound_never_exceeds_the_real_count(tok: Tokenizer, text: str):
    assert tok.min_tokens(text) <= len(tok.encode(text, add_special_tokens=False))


def _bpe(**kw) -> BackendTokenizer:
    vocab = {"a": 0, "b": 1, "[UNK]": 2, "ab": 3}
    return BackendTokenizer(models.BPE(vocab, [("a", "b")], unk_token="[UNK]", **kw))


def test_pipelines_that_keep_every_character_are_bounded():
    backend = _bpe()
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace("  ", "_"), normalizers.Lowercase()]
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(),
                                                     pre_tokenizers.Digits()])  # fmt: skip
    # "[UNK]" is the longest token; "  " -> "_" halves a text at most.
    assert max_chars_per_token(backend) == 5 * 2


UNBOUNDED = ["strip", "regex-replace", "deleting-replace", "bert", "whitespace", "removed-split",
             "lstrip-added-token", "fused-unk", "wordpiece", "wordlevel"]  # fmt: skip


def _with(setup) -> BackendTokenizer:
    backend = _bpe()
    setup(backend)
    return backend


@pytest.mark.parametrize(
    "backend",
    [
        _with(lambda t: setattr(t, "normalizer", normalizers.Strip())),
        _with(lambda t: setattr(t, "normalizer", normalizers.Replace(Regex(r"\s+"), " "))),
        _with(lambda t: setattr(t, "normalizer", normalizers.Replace("x", ""))),
        _with(lambda t: setattr(t, "normalizer", normalizers.BertNormalizer())),
        _with(lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Whitespace())),
        _with(lambda t: setattr(t, "pre_tokenizer", pre_tokenizers.Split(" ", "removed"))),
        _with(lambda t: t.add_tokens([AddedToken("<mask>", lstrip=True)])),
        _bpe(fuse_unk=True),
        BackendTokenizer(models.WordPiece({"a": 0, "[UNK]": 1}, unk_token="[UNK]")),
        BackendTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")),
    ],
    ids=UNBOUNDED,
)
def test_pipelines_that_can_fold_a_run_into_one_token_claim_no_bound(backend):
    assert max_chars_per_token(backend) is None


def test_without_a_bound_a_text_has_at_least_zero_tokens(tok: Tokenizer, monkeypatch):
    monkeypatch.setitem(tok.__dict__, "max_chars_per_token", None)
    assert tok.min_tokens("x" * 10_000) == 0


def test_the_bound_is_read_when_the_tokenizer_is_built_not_on_a_request(tmp_path, monkeypatch):
    """Read on first use it held a fresh server's first requests ~0.8 s each (Qwen3's
    151k-token vocabulary), every concurrent one computing it again."""
    import pegainfer.core.text.tokenizer as tokenizer_module

    calls = []
    real = tokenizer_module.max_chars_per_token
    monkeypatch.setattr(tokenizer_module, "max_chars_per_token",
                        lambda backend: calls.append(1) or real(backend))  # fmt: skip
    write_tiny_tokenizer(tmp_path, special_tokens=SPECIAL, eos_token="<|im_end|>",
                         pad_token="<|endoftext|>", chat_template="")  # fmt: skip
    built = Tokenizer.from_dir(tmp_path)
    assert len(calls) == 1
    assert [built.min_tokens("x" * n) for n in (1, 100, 10_000)] == [1, 2, 193]
    assert len(calls) == 1
