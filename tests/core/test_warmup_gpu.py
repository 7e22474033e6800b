"""After the engine's start (graph capture and the warm-up), serving a mixed load compiles no
Triton kernel: every specialization a served step needs was made before /health would say 200
(issue 21). One small model per line family at its real head geometry (CUDA; skipped
elsewhere)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.engine.messages import EngineRequest
from pegainfer.core.sampling.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


def write_qwen3(path: Path) -> None:
    from tests.qwen3.golden_gate import write_gate_checkpoint
    from tests.qwen3.test_engine_gpu import SMALL, SMALL_LAYER_OUT

    write_gate_checkpoint(path, SMALL, SMALL_LAYER_OUT, seed=1)


def write_qwen35(path: Path) -> None:
    from tests.qwen35.test_engine_gpu import SMALL, SMALL_LAYER_OUT, write_gate_checkpoint

    write_gate_checkpoint(path, SMALL, SMALL_LAYER_OUT, seed=1)


def write_deepseek(path: Path) -> None:
    from tests.deepseek.hf_reference import SMALL
    from tests.deepseek.test_engine_gpu import GATE_ROUTING, LITE_GEOMETRY, SMALL_LAYER_OUT
    from tests.latent_moe_gate import write_gate_checkpoint

    write_gate_checkpoint(path, SMALL | LITE_GEOMETRY | GATE_ROUTING, SMALL_LAYER_OUT, seed=1)


class TritonSpecializations:
    """Records each Triton specialization this process makes (compiled, or loaded from the disk
    cache): `made` those a launch made (it waited on the compiler), `warmed` those made by
    `JITFunction.warmup` (the kernel plan's, loaded by `Precompile`)."""

    def __init__(self) -> None:
        self.made: list[str] = []
        self.warmed: list[str] = []

    def __call__(self, **kwargs) -> bool:
        name = getattr(kwargs.get("fn"), "name", "?")
        made = self.warmed if kwargs.get("is_manual_warmup") else self.made
        made.append(f"{name}: {kwargs.get('repr')}")
        return False  # go on and make it

    def __enter__(self) -> TritonSpecializations:
        from triton import knobs

        if not hasattr(knobs.runtime, "jit_cache_hook"):
            pytest.skip("this Triton has no jit_cache_hook")
        self._knobs, self._before = knobs.runtime, knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self
        return self

    def __exit__(self, *exc: object) -> None:
        self._knobs.jit_cache_hook = self._before


def serve(engine: EngineCore, rng: random.Random, num_requests: int, max_len: int) -> None:
    """Random prompts (some sharing a prefix, for prefix hits), greedy and sampled, several in
    flight, to completion."""
    shared = [rng.randrange(1, 900) for _ in range(40)]
    for i in range(num_requests):
        length = rng.choice([1, 2, 7, 16, 33, 100, 255, 256, 257, 300, 511, max_len])
        prompt = [rng.randrange(1, 900) for _ in range(length)]
        if i % 3 == 0:
            prompt = shared + prompt
        params = SamplingParams(max_tokens=rng.choice([1, 3, 9]), ignore_eos=True,
                                temperature=rng.choice([0.0, 0.8]), top_k=20, top_p=0.9,
                                logprobs=rng.choice([None, 2]))  # fmt: skip
        engine.add_request(EngineRequest(request_id=str(i), prompt_token_ids=prompt,
                                         params=params, eos_token_ids=[],
                                         arrival_time=0.0))  # fmt: skip
        if i % 4 == 3:  # a few steps between arrivals: decodes mix with new prompts
            for _ in range(3):
                engine.step()
    while engine.has_unfinished_requests:
        engine.step()


WRITERS = {"qwen3": write_qwen3, "qwen35": write_qwen35, "deepseek": write_deepseek}


@pytest.mark.parametrize("line", sorted(WRITERS))  # a line not installed skips
def test_serving_after_the_warm_up_compiles_nothing(line, tmp_path):
    WRITERS[line](tmp_path)
    args = EngineArgs(model=str(tmp_path), device="cuda", dtype="bfloat16", max_model_len=1024,
                      max_num_seqs=8, max_num_batched_tokens=256,
                      gpu_memory_utilization=0.3)  # fmt: skip
    engine = EngineCore(args)
    with TritonSpecializations() as made:
        serve(engine, random.Random(0), num_requests=24, max_len=600)
    assert made.made == [], "\n".join(made.made)


class FlashInferModules:
    """Records each FlashInfer JIT module loaded (built, or read from the disk cache): a
    module's first use in a process loads it, and a build takes minutes on a cold cache."""

    def __init__(self) -> None:
        self.loaded: list[str] = []

    def __enter__(self) -> FlashInferModules:
        from flashinfer.jit import core

        self._spec, self._before = core.JitSpec, core.JitSpec.build_and_load
        before, loaded = self._before, self.loaded

        def build_and_load(spec):
            loaded.append(spec.name)
            return before(spec)

        core.JitSpec.build_and_load = build_and_load
        return self

    def __exit__(self, *exc: object) -> None:
        self._spec.build_and_load = self._before


def burst(engine: EngineCore, rng: random.Random, num_requests: int) -> None:
    """`num_requests` decoding together (a graph bucket past the decode kernels' threshold),
    a new prompt arriving beside them (an eager or piecewise step with that many decode rows),
    then fewer and fewer as they finish at different lengths."""
    for i in range(num_requests + 1):
        prompt = [rng.randrange(1, 900) for _ in range(rng.randrange(5, 60))]
        params = SamplingParams(max_tokens=4 + i, ignore_eos=True, temperature=0.0)
        engine.add_request(EngineRequest(request_id=f"b{i}", prompt_token_ids=prompt,
                                         params=params, eos_token_ids=[],
                                         arrival_time=0.0))  # fmt: skip
        if i == num_requests - 1:
            for _ in range(3):
                engine.step()
    while engine.has_unfinished_requests:
        engine.step()


@pytest.mark.parametrize(  # the GQA lines (one not installed skips)
    ("line", "tensor_cores"),
    [("qwen3", "auto"), ("qwen3", "never"), ("qwen3", "always"), ("qwen35", "auto")],
)
def test_serving_after_the_start_loads_no_flashinfer_module(line, tensor_cores, tmp_path):
    """Both decode kernels (CUDA cores below --decode-attention-tensor-cores auto's 16
    sequences, tensor cores from it), in graphs and in eager steps, were loaded at start."""
    WRITERS[line](tmp_path)
    args = EngineArgs(model=str(tmp_path), device="cuda", dtype="bfloat16", max_model_len=1024,
                      max_num_seqs=24, max_num_batched_tokens=256, gpu_memory_utilization=0.3,
                      decode_attention_tensor_cores=tensor_cores)  # fmt: skip
    engine = EngineCore(args)
    with FlashInferModules() as modules:
        burst(engine, random.Random(1), num_requests=20)
        serve(engine, random.Random(0), num_requests=12, max_len=600)
    assert modules.loaded == [], "\n".join(modules.loaded)
