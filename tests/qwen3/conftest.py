"""Fixtures: tiny Qwen3 checkpoints written by transformers, once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.qwen3.hf_reference import write_hf_checkpoint


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[bool], Path]:
    """`hf_checkpoints(tie)` → a checkpoint directory (written once per session)."""
    cache: dict[bool, Path] = {}

    def get(tie: bool) -> Path:
        if tie not in cache:
            root = tmp_path_factory.mktemp(f"qwen3-tie{int(tie)}")
            cache[tie] = write_hf_checkpoint(root, tie=tie)
        return cache[tie]

    return get
