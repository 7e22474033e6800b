"""Tests for incremental detokenization and stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pegainfer.core.text.detokenizer import IncrementalDetokenizer
from pegainfer.core.text.tiny_tokenizer import write_tiny_tokenizer
from pegainfer.core.text.tokenizer import Tokenizer

FIXTURE_SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out: Path = tmp_path_factory.mktemp("tiny-tokenizer")
    write_tiny_tokenizer(
        out,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        added_tokens=["<think>", "</think>"],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template="",
    )
    return Tokenizer.from_dir(out)


def chunked(ids: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """Split `ids` into consecutive chunks of the given sizes (cycled), including empty ones."""
    chunks, i, k = [], 0, 0
    while i < len(ids):
        size = sizes[k % len(sizes)] if any(sizes) else 1
        chunks.append(list(ids[i : i + size]))
        i += size
        k += 1
    return chunks


def stream(
    detok: IncrementalDetokenizer, chunks: Sequence[Sequence[int]]
) -> tuple[list[str], bool]:
    """Push all chunks (flushing at the end unless a stop string ended the output).

    Checks on the way that `output_text` is always the concatenation of what was emitted.
    """
    deltas: list[str] = []
    for chunk in chunks:
        delta = detok.push(chunk)
        deltas.append(delta.text)
        assert detok.output_text == "".join(deltas)
        if delta.finished:
            return deltas, True
    deltas.append(detok.flush())
    assert detok.output_text == "".join(deltas)
    return deltas, False


# Text from a small alphabet (with multi-byte characters the tiny vocabulary splits into bytes) so
# that random stop strings actually occur in it.
ALPHABET = "ab c\n日本😀é"
texts = st.text(alphabet=ALPHABET, max_size=40)
chunk_sizes = st.lists(st.integers(0, 4), min_size=1, max_size=8)


@FIXTURE_SETTINGS
@given(data=st.data(), sizes=chunk_sizes, skip=st.booleans())
def test_streaming_random_ids_equals_full_decode(tok: Tokenizer, data, sizes, skip: bool) -> None:
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
    prompt = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=8))
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas, stopped = stream(detok, chunked(ids, sizes))
    assert not stopped
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


@FIXTURE_SETTINGS
@given(text=st.text(max_size=40), prompt=texts, sizes=chunk_sizes)
def test_clean_text_never_emits_replacement_chars(
    tok: Tokenizer, text: str, prompt: str, sizes
) -> None:
    ids = tok.encode(text)
    full = tok.decode(ids)
    detok = IncrementalDetokenizer(tok, tok.encode(prompt))
    deltas, _ = stream(detok, chunked(ids, sizes))
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


def test_characters_split_across_tokens_are_held_back(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) > 1, "the tiny vocabulary should split this emoji"
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.push([i]).text for i in ids] == [""] * (len(ids) - 1) + ["😀"]
    assert detok.flush() == ""


def test_flush_emits_an_incomplete_character_as_decode_does(tok: Tokenizer) -> None:
    ids = tok.encode("a😀")[:-1]
    detok = IncrementalDetokenizer(tok, [])
    assert detok.push(ids).text == "a"
    assert detok.flush() == "\ufffd"
    assert detok.output_text == tok.decode(ids)


def test_chunking_does_not_change_the_result(tok: Tokenizer) -> None:
    ids = tok.encode("The end 日本 is near 😀 the end")
    # The first "end" completes before min_tokens, so it does not count.
    min_tokens = len(tok.encode("The end")) + 1
    results = set()
    for sizes in ([1], [2], [3, 1], [len(ids)]):
        detok = IncrementalDetokenizer(tok, [], stop=["end", "near"], min_tokens=min_tokens)
        stream(detok, chunked(ids, sizes))
        results.add((detok.output_text, detok.stop_reason))
    assert results == {("The end 日本 is ", "near")}


def first_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """Reference: the text before the stop string that is completed first, as read char by char."""
    for end in range(1, len(text) + 1):
        matches = [s for s in stops if text[:end].endswith(s)]
        if matches:
            s = max(matches, key=len)
            return text[: end - len(s)], s
    return text, None


@FIXTURE_SETTINGS
@given(
    text=texts,
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    sizes=chunk_sizes,
)
def test_stop_strings_cut_the_output_and_are_never_emitted(
    tok: Tokenizer, text: str, stops: list[str], sizes
) -> None:
    ids = tok.encode(text)
    expected, reason = first_stop(tok.decode(ids), stops)
    detok = IncrementalDetokenizer(tok, [], stop=stops)
    deltas, stopped = stream(detok, chunked(ids, sizes))
    # Emitted text is never taken back: every prefix of the stream is a prefix of the result.
    assert "".join(deltas) == expected
    assert detok.stop_reason == reason
    assert stopped == (reason is not None)


def test_stop_string_spanning_tokens(tok: Tokenizer) -> None:
    text = "Hello world, the answer is 42. More text follows."
    ids = tok.encode(text)
    stop = "answer is 42"
    # The stop string is spread over several tokens.
    assert not any(stop in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, tok.encode("Question:"), stop=[stop])
    deltas = []
    for i in ids:
        delta = detok.push([i])
        deltas.append(delta.text)
        # Nothing that could be the start of the stop string leaves early.
        assert not any("".join(deltas).endswith(stop[:n]) for n in range(1, len(stop)))
        if delta.finished:
            break
    assert delta.finished
    assert "".join(deltas) == detok.output_text == "Hello world, the "
    assert detok.stop_reason == stop
    # Further tokens and the final flush add nothing.
    assert detok.push(tok.encode(" more")).text == ""
    assert detok.push([]).finished
    assert detok.flush() == ""


def test_include_stop_str_in_output_keeps_the_matched_stop(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world, the answer is 42. More text follows.")
    for stops, expected in ((["answer is 42"], "Hello world, the answer is 42"),
                            (["42", "the answer"], "Hello world, the answer")):  # fmt: skip
        detok = IncrementalDetokenizer(tok, [], stop=stops, include_stop=True)
        deltas = [detok.push([i]).text for i in ids] + [detok.flush()]
        assert "".join(deltas) == detok.output_text == expected


def test_held_back_stop_prefix_is_released_when_disproved_or_flushed(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    assert detok.push(tok.encode("abc ST")).text == "abc "
    assert detok.push(tok.encode("ay")).text == "STay"
    assert detok.push(tok.encode(" STO")).text == " "
    assert detok.flush() == "STO"
    assert detok.stop_reason is None
    assert detok.output_text == "abc STay STO"


def test_stop_strings_are_ignored_before_min_tokens(tok: Tokenizer) -> None:
    pieces = ["x", " STOP", " y", " STOP", " z"]
    ids = [i for p in pieces for i in tok.encode(p)]
    n_first = len(tok.encode("x")) + len(tok.encode(" STOP"))
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"], min_tokens=n_first + 1)
    deltas, stopped = stream(detok, [[i] for i in ids])
    assert stopped
    assert "".join(deltas) == "x STOP y "
    # With min_tokens reached exactly when the first stop string completes, it counts.
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"], min_tokens=n_first)
    stream(detok, [ids])
    assert detok.output_text == "x "


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok: Tokenizer, skip: bool) -> None:
    ids = [
        *tok.encode("<think>\nhmm\n</think>\n\nHi"),
        tok.token_to_id("<|im_end|>"),
        *tok.encode("!"),
    ]
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
    deltas, _ = stream(detok, [[i] for i in ids])
    expected = "<think>\nhmm\n</think>\n\nHi" + ("" if skip else "<|im_end|>") + "!"
    assert "".join(deltas) == expected == tok.decode(ids, skip_special_tokens=skip)


def test_stop_string_matching_a_special_token_needs_it_decoded(tok: Tokenizer) -> None:
    ids = [*tok.encode("Hi"), tok.token_to_id("<|im_end|>"), *tok.encode("more")]
    detok = IncrementalDetokenizer(tok, [], stop=["<|im_end|>"], skip_special_tokens=False)
    stream(detok, [[i] for i in ids])
    assert (detok.output_text, detok.stop_reason) == ("Hi", "<|im_end|>")
    detok = IncrementalDetokenizer(tok, [], stop=["<|im_end|>"], skip_special_tokens=True)
    stream(detok, [[i] for i in ids])
    assert (detok.output_text, detok.stop_reason) == ("Himore", None)
