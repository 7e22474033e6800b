"""A tiny tokenizer in Kimi-K2's real format, for tests and tiny checkpoints.

A byte-level BPE of a few hundred merges, trained with Kimi's split regex on core's built-in
corpus, written as `tiktoken.model`; Kimi's special tokens at their real offsets among the 256
reserved ids after it (`[BOS]` at base + 0, `<|im_end|>` at base + 2, the tool-call markers at
base + 11 .. 15, K2-Thinking's `<think>` and `</think>` at base + 22 and 23, not special);
`tokenizer_config.json` as Moonshot's names them; a chat template in Kimi-K2-Thinking's layout
(or Kimi-K2-Instruct's, which writes no thinking); and `generation_config.json`, whose end of
turn is `<|im_end|>`. No `tokenizer.json`: loading it takes the conversion real Kimi
checkpoints need.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

from pegainfer.core.text.tiktoken_bpe import byte_level_bpe_ranks, write_tiktoken_ranks
from pegainfer.core.text.tiny_tokenizer import train_tiny_bpe
from pegainfer.core.text.tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE
from pegainfer.models.kimi_k2.tokenizer import (
    NUM_RESERVED_SPECIAL_TOKENS,
    SPLIT_PATTERN,
    TIKTOKEN_FILE,
)

# Offsets from the base vocabulary (163,584 in Kimi-K2) of the tokens tokenizer_config names.
SPECIAL_OFFSETS = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|start_header_id|>": 6,
    "<|end_header_id|>": 7,
    "[EOT]": 9,
    "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11,
    "<|tool_calls_section_end|>": 12,
    "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14,
    "<|tool_call_end|>": 15,
    "<|im_middle|>": 17,
    "[UNK]": 254,
    "[PAD]": 255,
}
# Matched in text, but kept when decoding with skip_special_tokens (the reasoning parser reads
# them from the answer's text).
NOT_SPECIAL = {"<think>": 22, "</think>": 23}

# The part of the tiny template that K2-Instruct's lacks: each assistant turn's thinking.
_THINKING_PART = re.compile(r"\{#- thinking -#\}.*?\{#- /thinking -#\}\n", re.DOTALL)


def write_tiny_kimi_tokenizer(
    out_dir: Path, base_vocab_size: int = 768, thinking: bool = True
) -> int:
    """Write the tiny tokenizer's files into `out_dir` (the same bytes on every run), with
    K2-Thinking's chat template (`thinking` False: K2-Instruct's); returns the vocabulary size,
    the 256 reserved ids included (Kimi-K2's `vocab_size` counts them)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ranks = byte_level_bpe_ranks(train_tiny_bpe(SPLIT_PATTERN, base_vocab_size))
    write_tiktoken_ranks(out_dir / TIKTOKEN_FILE, ranks)
    base = len(ranks)
    decoder = {
        str(base + offset): {"content": content, "lstrip": False, "normalized": False,
                             "rstrip": False, "single_word": False, "special": special}
        for offsets, special in ((SPECIAL_OFFSETS, True), (NOT_SPECIAL, False))
        for content, offset in offsets.items()
    }  # fmt: skip
    config = {
        "added_tokens_decoder": dict(sorted(decoder.items(), key=lambda item: int(item[0]))),
        "additional_special_tokens": [
            *("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>"),
            *("<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"),
        ],
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    }
    (out_dir / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    template = resources.files("pegainfer.models.kimi_k2").joinpath("tiny_chat_template.jinja")
    source = template.read_text(encoding="utf-8")
    if not thinking:
        source = _THINKING_PART.sub("", source)
    (out_dir / CHAT_TEMPLATE_FILE).write_text(source)
    generation = {
        "bos_token_id": base + SPECIAL_OFFSETS["[BOS]"],
        "eos_token_id": base + SPECIAL_OFFSETS["<|im_end|>"],
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return base + NUM_RESERVED_SPECIAL_TOKENS
