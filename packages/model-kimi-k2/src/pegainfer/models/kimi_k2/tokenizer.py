"""Kimi-K2's tokenizer: a tiktoken ranks file, converted at load into core's `Tokenizer`.

Kimi's checkpoints ship `tiktoken.model` (base64 token, rank per line), `tokenizer_config.json`
and a chat template, and no `tokenizer.json`; their remote code (`tokenization_kimi.py`) runs
tiktoken with Kimi's split regex and 256 reserved special ids after the base vocabulary, named
from `added_tokens_decoder` (else `<|reserved_token_{id}|>`), every one of them matched in text.
Converting the ranks with that regex and those tokens gives a `tokenizers` tokenizer that encodes
exactly as tiktoken does (tests/kimi_k2/test_tokenizer.py). transformers' own loader for such a
directory uses its default regex instead, which splits Han text and letter cases differently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pegainfer.core.errors import ConfigError
from pegainfer.core.loading.model_files import read_json_object
from pegainfer.core.text.tiktoken_bpe import convert_tiktoken_bpe, read_tiktoken_ranks
from pegainfer.core.text.tokenizer import TOKENIZER_CONFIG_FILE, Tokenizer

TIKTOKEN_FILE = "tiktoken.model"

# Kimi's pre-tokenization regex (`pat_str` of tokenization_kimi.py): Han runs alone; words keep
# their case runs and English contractions; digits in threes. `&&` is a character-class
# intersection (Oniguruma and tiktoken's Rust regex both read it).
SPLIT_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
NUM_RESERVED_SPECIAL_TOKENS = 256


def load_kimi_tokenizer(tokenizer_dir: Path) -> Tokenizer:
    """The tokenizer of a Kimi-K2 checkpoint directory (`tiktoken.model` and
    `tokenizer_config.json`), with its chat template."""
    tokenizer_dir = Path(tokenizer_dir)
    ranks_file = tokenizer_dir / TIKTOKEN_FILE
    if not ranks_file.is_file():
        raise ConfigError(f"no {TIKTOKEN_FILE} in {tokenizer_dir}: not a Kimi-K2 tokenizer")
    config = read_json_object(tokenizer_dir / TOKENIZER_CONFIG_FILE)
    try:
        ranks = read_tiktoken_ranks(ranks_file)
        special, added = reserved_tokens(config, len(ranks))
        backend = convert_tiktoken_bpe(
            ranks, pattern=SPLIT_PATTERN, special_tokens=special, added_tokens=added
        )
    except ValueError as e:
        raise ConfigError(f"cannot load Kimi's tokenizer from {tokenizer_dir}: {e}") from e
    return Tokenizer.with_checkpoint_config(backend, tokenizer_dir)


def reserved_tokens(config: dict[str, Any], base: int) -> tuple[dict[str, int], dict[str, int]]:
    """The reserved ids `base .. base + 255`, named from `added_tokens_decoder`, split into the
    special ones (skipped when decoding with `skip_special_tokens`) and the others (an entry
    marked `"special": false`, such as K2-Thinking's `<think>`, stays in decoded text)."""
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise ValueError("added_tokens_decoder must be an object of id -> token")
    reserved = range(base, base + NUM_RESERVED_SPECIAL_TOKENS)
    named: dict[int, tuple[str, bool]] = {}
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not (key.isdigit() and isinstance(content, str)):
            raise ValueError(f"added_tokens_decoder[{key!r}] must be a token with its content")
        if int(key) not in reserved:
            raise ValueError(
                f"added token {content!r} has id {key}, outside the "
                f"{NUM_RESERVED_SPECIAL_TOKENS} reserved ids {base}..{reserved[-1]} that follow "
                f"the {base} tokens of {TIKTOKEN_FILE}"
            )
        named[int(key)] = (content, bool(entry.get("special", True)))
    special, added = {}, {}
    for token_id in reserved:
        content, is_special = named.get(token_id, (f"<|reserved_token_{token_id}|>", True))
        (special if is_special else added)[content] = token_id
    return special, added
