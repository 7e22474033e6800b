"""DeepSeek-V2 through the engine (scheduler, latent blocks, sampler) against transformers;
the host tier stores MLA's two arenas (latent and rope key) like GQA's K/V."""

from __future__ import annotations

import pytest

from tests.deepseek import hf_reference
from tests.engine_harness import (
    EngineMatchesTransformers,
    both_schedulers,  # noqa: F401 (a fixture)
    reference_batch,
)

pytestmark = pytest.mark.usefixtures("both_schedulers")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek-engine")
    return reference_batch(hf_reference, folder, lengths=(1, 6, 19, 40, 77), new_tokens=16)


class TestDeepseekV2ThroughTheEngine(EngineMatchesTransformers):
    HOST_TIER_ARENAS = frozenset({"ckv", "kpe"})
