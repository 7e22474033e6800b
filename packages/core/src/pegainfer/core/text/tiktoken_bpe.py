"""Convert a tiktoken BPE ranks file into a Hugging Face `tokenizers.Tokenizer`.

Some vocabularies (Qwen's, Kimi-K2's) ship only as tiktoken ranks files, while pegainfer and
transformers load `tokenizer.json`. A ranks file lists each token's bytes (base64) and its rank;
tiktoken merges, within each regex piece, the adjacent pair whose concatenation has the lowest
rank, and takes a piece that is itself a token whole. A Hugging Face byte-level BPE does the same
given the vocabulary (bytes spelled through GPT-2's byte-to-unicode map) and one merge per token
in rank order. The merges are not in the file: this module reconstructs them. The tiktoken
package is not needed.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from pegainfer.core.text.token_bytes import bytes_to_unicode


def read_tiktoken_ranks(ranks_file: Path) -> dict[bytes, int]:
    """The token bytes -> rank table of a tiktoken ranks file (`BASE64 RANK` per line)."""
    ranks = {}
    for number, line in enumerate(Path(ranks_file).read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"{ranks_file}:{number}: expected 'BASE64 RANK', got {line!r}") from e
    return ranks


def write_tiktoken_ranks(ranks_file: Path, ranks: Mapping[bytes, int]) -> None:
    """Write `ranks` as a tiktoken ranks file, in rank order (what `read_tiktoken_ranks` reads)."""
    lines = [f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=_rank)]
    Path(ranks_file).write_text("".join(lines))


def _rank(item: tuple[bytes, int]) -> int:
    return item[1]


def convert_tiktoken_bpe(
    ranks: Mapping[bytes, int],
    *,
    pattern: str,
    special_tokens: Mapping[str, int],
    added_tokens: Mapping[str, int],
) -> Tokenizer:
    """A tokenizer that encodes exactly as tiktoken does with the same ranks, `pattern` and
    special tokens (all allowed), and decodes token ids back to the same bytes.

    The ranks become the token ids. `special_tokens` (skipped by `skip_special_tokens`) and
    `added_tokens` (matched in text like special tokens, but kept when decoding, as Qwen3 does
    with `<think>`) must take the ids right after the vocabulary, in any order between them.
    There is no normalizer: tiktoken has none (a caller adds one if its model's tokenizer does).
    """
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"the ranks must be 0..{len(ranks) - 1}, each once")
    if missing := [bytes([b]) for b in range(256) if bytes([b]) not in ranks]:
        raise ValueError(f"every single byte must be a token; missing {missing[:8]}")

    byte_to_char = bytes_to_unicode()

    def spell(token: bytes) -> str:
        return "".join(byte_to_char[b] for b in token)

    vocab = {spell(token): rank for token, rank in ranks.items()}
    merges = []
    unreachable = False
    for token in sorted(ranks, key=ranks.__getitem__):
        if len(token) == 1:
            continue
        if (pair := _last_merge(token, ranks)) is None:
            unreachable = True
        else:
            merges.append((spell(pair[0]), spell(pair[1])))

    # A token that merging never forms is still produced when a whole piece spells it, so the
    # piece must be looked up before merging (`ignore_merges`). Trained BPE vocabularies (Qwen's)
    # have none; leaving the option off for them matches the tokenizer.json files they publish.
    model = models.BPE(
        vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=unreachable
    )
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # Adds nothing (no BOS/EOS); it only maps offsets back to the text, as Qwen's files do.
    tokenizer.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    _add_tokens(tokenizer, special_tokens, added_tokens)
    return tokenizer


def byte_level_bpe_ranks(tokenizer: Tokenizer) -> dict[bytes, int]:
    """The tiktoken ranks of a trained byte-level BPE: the 256 bytes, then each merge's token
    in merge order (the inverse of `convert_tiktoken_bpe` for a vocabulary BPE trained)."""
    model = json.loads(tokenizer.to_str())["model"]
    if model["type"] != "BPE":
        raise ValueError(f"expected a BPE model, got {model['type']}")
    char_to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for merge in model["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        token = bytes(char_to_byte[c] for c in left + right)
        ranks.setdefault(token, len(ranks))  # two merges may spell one token: it ranks once
    return ranks


def _last_merge(token: bytes, ranks: Mapping[bytes, int]) -> tuple[bytes, bytes] | None:
    """The two parts tiktoken joins to form `token`, or None if it never forms by merging.

    Inside a piece, the merges within the bytes of a future `token` happen in the order they
    would for `token`'s bytes alone (each is the lowest-ranked pair anywhere, so also the lowest
    within), so `token` can only ever form from the two parts that merging its bytes alone
    reaches. Merging stops at two parts rather than at rank `ranks[token]`, which is the same
    for vocabularies trained as BPE (parts rank below their merges) and exact for any other.
    """
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, best_rank = -1, len(ranks)
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best, best_rank = i, rank
        if best < 0:
            return None  # only whole-piece lookup (`ignore_merges`) produces this token
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return parts[0], parts[1]


def _add_tokens(
    tokenizer: Tokenizer, special_tokens: Mapping[str, int], added_tokens: Mapping[str, int]
) -> None:
    """Add the tokens in id order, checking that each gets the id it was given: the tokenizers
    API assigns the next free id and cannot place a token anywhere else."""
    if overlap := special_tokens.keys() & added_tokens.keys():
        raise ValueError(f"tokens both special and not: {sorted(overlap)}")
    tokens = {t: (i, True) for t, i in special_tokens.items()}
    tokens |= {t: (i, False) for t, i in added_tokens.items()}
    for content, (token_id, special) in sorted(tokens.items(), key=lambda item: item[1][0]):
        expected = tokenizer.get_vocab_size(with_added_tokens=True)
        if token_id != expected:
            raise ValueError(
                f"added token {content!r} has id {token_id}, but the next free id is {expected}: "
                "added tokens must follow the vocabulary without gaps"
            )
        token = AddedToken(content, special=special, normalized=False)
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
