"""What each token spells, as grammars read it (`token_bytes`), and the tokenizer llguidance
works from (`GrammarVocabulary`), for byte-level and SentencePiece-style byte-fallback
vocabularies."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as BackendTokenizer

from pegainfer.core.errors import InvalidRequestError
from pegainfer.core.sampling.structured_output import Grammars, StructuredOutput
from pegainfer.core.text.tiny_tokenizer import write_tiny_tokenizer
from pegainfer.core.text.token_bytes import token_bytes
from pegainfer.core.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory) -> Tokenizer:
    out = tmp_path_factory.mktemp("byte-level")
    write_tiny_tokenizer(out, special_tokens=["<|im_end|>"], eos_token="<|im_end|>",
                         pad_token=None, chat_template="{{ messages[0].content }}")  # fmt: skip
    return Tokenizer.from_dir(out)


def byte_fallback() -> Tokenizer:
    """A SentencePiece-style BPE (Llama 2's pipeline): `▁` for spaces, prepended to the
    text; bytes it has no token for as `<0xNN>`; an added `<think>` that is not special."""
    vocab = {"<unk>": 0, "</s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    for piece in ["▁", "h", "i", "t", "e", "r", "a", "hi", "▁hi", "er", "▁t", "▁th", "h"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("h", "i"), ("▁", "hi"), ("e", "r"), ("▁", "t"), ("▁t", "h")]
    backend = BackendTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.pre_tokenizer = None
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    backend.add_special_tokens([AddedToken("</s>", special=True)])
    backend.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    return Tokenizer(backend, special_tokens={"eos_token": "</s>"})


def test_byte_level_tokens_spell_what_they_decode_to(byte_level):
    table = token_bytes(BackendTokenizer.from_str(byte_level.to_json()))
    assert len(table) == byte_level.vocab_size
    im_end = byte_level.token_to_id("<|im_end|>")
    assert table[im_end] == b"<|im_end|>"
    for token_id, spelled in enumerate(table):
        if token_id != im_end and (text := spelled.decode(errors="ignore")).encode() == spelled:
            assert byte_level.decode([token_id]) == text, token_id


def test_byte_fallback_tokens_spell_bytes_and_spaces():
    tokenizer = byte_fallback()
    table = token_bytes(BackendTokenizer.from_str(tokenizer.to_json()))
    assert table[2 + 0x0A] == b"\n" and table[2 + 0xE2] == b"\xe2"
    assert table[tokenizer.token_to_id("▁hi")] == b" hi"
    assert table[tokenizer.token_to_id("<think>")] == b"<think>"
    assert table[tokenizer.token_to_id("</s>")] == b"</s>"


def test_a_tokenizer_of_unknown_spelling_is_refused():
    """Its grammars are refused as requests (the engine serving them crashed on the error)."""
    backend = BackendTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    backend.decoder = decoders.WordPiece()
    with pytest.raises(ValueError, match=r"decoder \(WordPiece\) is neither"):
        token_bytes(backend)
    tokenizer = Tokenizer(backend, special_tokens={"unk_token": "[UNK]"})
    with pytest.raises(InvalidRequestError, match="structured output is not available: cannot"):
        Grammars(lambda: tokenizer, 8).matcher(StructuredOutput.choice(["a"]), [0])


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(byte_level):
    grammars = Grammars(lambda: byte_level, byte_level.vocab_size - 1)
    with pytest.raises(InvalidRequestError, match="more than the model's vocabulary"):
        grammars.matcher(StructuredOutput.choice(["a"]), [0])


def test_forced_text_gets_no_leading_space_from_a_sentencepiece_tokenizer():
    """The tokenizer prepends `▁` to a text it encodes; text a grammar forces continues an
    answer, so its tokens must not start with a space the grammar does not allow."""
    tokenizer = byte_fallback()
    eos = [tokenizer.token_to_id("</s>")]
    assert tokenizer.encode("hi there", add_special_tokens=False)[0] == tokenizer.token_to_id("▁hi")
    grammars = Grammars(lambda: tokenizer, tokenizer.vocab_size + 6)
    for spec, text in [("hi there", "hi there"), ("<think>hi", "<think>hi")]:
        matcher = grammars.matcher(StructuredOutput(kind="regex", spec=spec), eos)
        tokens = grammars.tokenizer(eos).tokenize_str(text)
        assert tokens[0] != tokenizer.token_to_id("▁hi")
        assert matcher.consume_tokens(tokens) and matcher.is_accepting(), matcher.get_error()
        assert tokenizer.decode(tokens) == text
