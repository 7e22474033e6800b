"""What the engine resolved from its arguments, the model and the machine: what the frontend
(the HTTP server, the offline API) needs to know of the engine it talks to.

Plain data, no torch: the engine process sends it to the server, which never imports torch.
The engine keeps its `torch.device` and `torch.dtype`; here they are names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EngineConfig:
    """The arguments resolved against the model and the machine."""

    model_dir: Path
    tokenizer_dir: Path
    model_config: dict[str, Any]
    line: str
    #: The device the model runs on, as torch names it ("cpu", "cuda:0").
    device: str
    #: The compute dtype's name ("bfloat16", "float16", "float32").
    dtype: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    vocab_size: int
    # The line's default chat answer parsers (registered names).
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
