"""What a set of engine arguments serves: the checkpoint directory, its config, the model line
that claims it and the tokenizer directory. Resolved the same way by the engine and, ahead of
it, by the server, which loads the tokenizer and chat template while the engine process loads
the model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pegainfer.core.args import EngineArgs
from pegainfer.core.loading.model_files import read_config, resolve_model_dir
from pegainfer.core.model_line import ModelLine
from pegainfer.core.plugins import detect_model_line, model_lines


@dataclass(frozen=True)
class ModelSource:
    model_dir: Path
    config: dict[str, Any]
    line: ModelLine
    tokenizer_dir: Path


def resolve_model_source(args: EngineArgs, lines: list[ModelLine] | None = None) -> ModelSource:
    """Find (or download) the checkpoint and tokenizer `args` name and the line among `lines`
    (default: the installed ones) that claims the checkpoint."""
    model_dir = resolve_model_dir(args.model, args.revision)
    config = read_config(model_dir)
    line = detect_model_line(config, model_lines() if lines is None else lines)
    tokenizer_dir = model_dir
    if args.tokenizer is not None:
        tokenizer_dir = resolve_model_dir(args.tokenizer, args.revision, line.tokenizer_file)
    return ModelSource(model_dir, config, line, tokenizer_dir)
