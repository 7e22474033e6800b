"""Which of the engine's own steps may replay CUDA graphs (checked on the CPU: eligibility is
a function of the step's batch and the model's cache, not of the device)."""

from __future__ import annotations

import torch

from pegainfer.core.runner.piecewise_graphs import MixedGraphs
from tests.engine_harness import greedy, make_engine, submit


def test_a_prompts_first_chunk_replays_pieces_for_a_model_without_state(hf_checkpoints):
    """The engine gives every sequence a slot, so a prompt starting at position 0 "starts" a
    state: that must keep only recurrent models' steps eager, not Qwen3's (it kept every step
    with a new prompt eager, the common mixed step under load)."""
    engine = make_engine(hf_checkpoints(True), async_scheduling=False)
    pieces = MixedGraphs(engine.model, engine.kv_cache, (16, 64), engine.config.num_kv_blocks,
                         engine.config.block_size, torch.device("cpu"))  # fmt: skip
    submit(engine, "old", list(range(3, 40)), greedy(4))
    engine.step()  # its prompt; it decodes from here on
    submit(engine, "new", list(range(50, 70)), greedy(4))
    step = engine.scheduler.schedule()
    batch = engine.runner.batch(engine._plans(step)[0])
    assert batch.starts_states and not batch.is_decode  # the new prompt, from position 0
    assert pieces.can_run(batch)
    engine.scheduler.advance(step)
