"""Which of a Qwen3.5 engine's steps may replay piecewise graphs, and the batch they are
captured with (checked on the CPU: both depend on the step's batch and the model's cache, not
on the device)."""

from __future__ import annotations

import torch

from pegainfer.core.runner.piecewise_graphs import MixedGraphs
from tests.engine_harness import greedy, make_engine, submit
from tests.qwen35.hf_reference import write_hf_checkpoint


def test_steps_that_start_states_replay_pieces(tmp_path):
    """Qwen3.5 readies the states a step starts before the pieces (`start_states`), so a new
    prompt beside decodes, the common mixed step under load, replays them; the capture batch
    holds the reserved dummy slot, which the DeltaNet plan reads while the pieces are
    captured."""
    engine = make_engine(write_hf_checkpoint(tmp_path, tie=True, seed=3), async_scheduling=False)
    model, dummy_slot = engine.model, engine.kv_cache.num_slots - 1
    assert model.supports_piecewise_graphs and model.starts_states_apart
    pieces = MixedGraphs(model, engine.kv_cache, (16, 64), engine.config.num_kv_blocks,
                         engine.config.block_size, torch.device("cpu"), dummy_slot)  # fmt: skip
    submit(engine, "old", list(range(3, 40)), greedy(4))
    engine.step()  # its prompt; it decodes from here on
    submit(engine, "new", list(range(50, 70)), greedy(4))
    step = engine.scheduler.schedule()
    batch = engine.runner.batch(engine._plans(step)[0])
    assert batch.starts_states and not batch.is_decode  # the new prompt, from position 0
    assert pieces.can_run(batch)
    engine.scheduler.advance(step)
    capture = pieces._static_batch(16)
    assert capture.state_slots_cpu == [dummy_slot] * 16
    assert capture.state_slots is not None and capture.state_slots.tolist() == [dummy_slot] * 16
