"""Kimi-K2 through the engine (scheduler, latent blocks, sampler): greedy 32 tokens equal
transformers' `generate`, batched, chunked beside decodes, from the prefix cache and from the
host tier."""

from __future__ import annotations

import pytest

from tests.engine_harness import (
    EngineMatchesTransformers,
    both_schedulers,  # noqa: F401 (a fixture)
    reference_batch,
)
from tests.kimi_k2 import hf_reference

pytestmark = pytest.mark.usefixtures("both_schedulers")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kimi_k2-engine")
    return reference_batch(hf_reference, folder, lengths=(1, 6, 19, 40, 77), new_tokens=32)


class TestKimiK2ThroughTheEngine(EngineMatchesTransformers):
    HOST_TIER_ARENAS = frozenset({"ckv", "kpe"})
