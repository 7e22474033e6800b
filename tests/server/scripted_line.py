"""A test-only model line whose model writes scripted answers, installed through a real entry
point by `test_scripted_line.py`, so the server's chat features run end to end on known text.

config.json holds `scripts`: a list of [marker, answer] or [marker, answer, seconds]. At a
sequence's first step the model picks the first script whose marker's tokens occur in the prompt
(an empty marker always matches), then emits that answer's tokens one per step, then EOS; a step
that emits a token of a script with `seconds` takes at least that long (so that a test reading
the stream sees each token's output apart, not merged by a consumer that fell behind). A `§` in
an answer is one digit drawn uniformly (so seeds show). The model keeps (script, step) in its
state slot, like a recurrent line keeps its state; it has no weights.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pegainfer.core.kv.kv_cache import ArenaSpec, KVCache, StateSpec
from pegainfer.core.model import Model, ModelContext
from pegainfer.core.model_line import ModelLine, Probe, RuntimeConfig
from pegainfer.core.plugins import hookimpl
from pegainfer.core.runner.forward_batch import ForwardBatch
from pegainfer.core.text.tokenizer import Tokenizer

RANDOM_DIGIT = -1


class ScriptedModel(Model):
    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        tokenizer = Tokenizer.from_dir(ctx.model_dir)
        self._vocab = int(ctx.config["vocab_size"])
        self.eos = int(ctx.config["eos_token_id"])
        self.digits = [tokenizer.encode(str(d), add_special_tokens=False)[0] for d in range(10)]
        self.scripts = []
        self.pauses = []
        for marker, answer, *pause in ctx.config["scripts"]:
            ids: list[int] = []
            for i, piece in enumerate(answer.split("§")):
                ids += ([RANDOM_DIGIT] if i else []) + tokenizer.encode(piece, False)
            self.scripts.append((tokenizer.encode(marker, False), ids))
            self.pauses.append(float(pause[0]) if pause else 0.0)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def max_position_embeddings(self) -> int:
        return 4096

    def kv_arenas(self, block_size: int) -> list[ArenaSpec]:
        return [ArenaSpec("kv", 1, (block_size,), torch.float32)]

    def state_arenas(self) -> list[StateSpec]:
        return [StateSpec("script", 1, (2,), torch.float32)]  # (script index, step)

    def init_runtime(self, runtime: RuntimeConfig) -> None:
        pass

    def prepare(self, batch: ForwardBatch) -> None:
        pass

    def _pick(self, prompt: list[int]) -> int:
        for index, (marker, _) in enumerate(self.scripts):
            if any(prompt[i : i + len(marker)] == marker for i in range(len(prompt))):
                return index
        raise AssertionError("no script matches the prompt (give one an empty marker)")

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        state = kv_cache["script"][0]
        ids = batch.input_ids.tolist()
        bounds = batch.query_start_loc_cpu.tolist()
        sampling = set(batch.logits_indices.tolist())
        logits = torch.full((len(sampling), self._vocab), -30.0)
        row, pause = 0, 0.0
        for i, slot in enumerate(batch.state_slots_cpu):
            if batch.seq_lens_cpu[i] == batch.query_lens_cpu[i]:  # its first step
                state[slot] = torch.tensor([self._pick(ids[bounds[i] : bounds[i + 1]]), 0.0])
            if bounds[i + 1] - 1 not in sampling:
                continue
            script, step = (int(v) for v in state[slot].tolist())
            answer = self.scripts[script][1]
            token = answer[step] if step < len(answer) else self.eos
            if token == RANDOM_DIGIT:
                logits[row, self.digits] = 0.0
            else:
                logits[row, token] = 30.0
            state[slot, 1] += 1
            row += 1
            pause = max(pause, self.pauses[script])
        time.sleep(pause)
        return logits.to(batch.input_ids.device)


class ScriptedLine(ModelLine):
    name = "scripted"
    supports_prefix_caching = False  # the script's progress is not checkpointed
    reasoning_parser = "qwen3"
    tool_call_parser = "hermes"

    def probe(self, config: dict[str, Any]) -> Probe:
        if config.get("model_type") == "scripted":
            return Probe.claim()
        return Probe.reject("model_type is not 'scripted'")

    def build_model(self, ctx: ModelContext) -> Model:
        return ScriptedModel(ctx)


@hookimpl
def pegainfer_model_lines() -> list[ModelLine]:
    return [ScriptedLine()]
