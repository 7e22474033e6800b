"""GLM-5 through the engine (scheduler, latent and indexer-key blocks, sampler) against
transformers: greedy continuations past index_topk, chunked, from the prefix cache and from
the host tier, which stores the indexer keys beside the latents."""

from __future__ import annotations

import pytest

from tests.engine_harness import (
    EngineMatchesTransformers,
    both_schedulers,  # noqa: F401 (a fixture)
    reference_batch,
)
from tests.glm5 import hf_reference

pytestmark = pytest.mark.usefixtures("both_schedulers")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("glm5-engine")
    return reference_batch(hf_reference, folder, lengths=(1, 6, 19, 40), new_tokens=32)


class TestGlm5ThroughTheEngine(EngineMatchesTransformers):
    HOST_TIER_ARENAS = frozenset({"ckv", "kpe", "index_k"})
