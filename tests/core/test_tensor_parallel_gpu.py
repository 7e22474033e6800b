"""Two tensor-parallel ranks on two GPUs (NCCL, decode CUDA graphs on both ranks) generate what
one GPU does (skipped without two CUDA devices).

The checkpoints follow the golden gate's recipe for peaked distributions, so greedy choices
stand far apart and the ranks' other order of bf16 sums cannot flip them. At small shapes the
tokens must be equal; at real shapes (slow) the two are held to the golden gate's tolerances."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.engine.messages import TokenLogprob
from pegainfer.core.sampling.sampling_params import SamplingParams
from tests.engine_harness import generate, greedy, submit
from tests.qwen3.golden_gate import HEAD_K, MEAN_TOL, P99_TOL, REGRET_TOL

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """Each case's engines hold up to `gpu_memory_utilization` of GPU 0 until collected; free
    them before the next case sizes its KV cache from what is left."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


def gpu_engine(path, **overrides) -> EngineCore:
    args = dict(model=str(path), device="cuda", dtype="bfloat16", max_model_len=2048,
                max_num_seqs=16, max_num_batched_tokens=256,
                gpu_memory_utilization=0.4)  # fmt: skip
    return EngineCore(EngineArgs(**(args | overrides)))


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 90, 300, 700)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.deepseek.hf_reference import SMALL as DEEPSEEK_STRUCTURE
    from tests.deepseek.test_engine_gpu import GATE_ROUTING, LITE_GEOMETRY, SMALL_LAYER_OUT
    from tests.deepseek.test_engine_gpu import write_gate_checkpoint as write_deepseek
    from tests.qwen3.golden_gate import write_gate_checkpoint as write_qwen3
    from tests.qwen3.test_engine_gpu import SMALL
    from tests.qwen3.test_engine_gpu import SMALL_LAYER_OUT as QWEN3_LAYER_OUT
    from tests.qwen35 import test_engine_gpu as qwen35

    qwen3 = tmp_path_factory.mktemp("tp-qwen3")
    write_qwen3(qwen3, SMALL, QWEN3_LAYER_OUT, seed=11)
    deepseek = tmp_path_factory.mktemp("tp-deepseek")
    write_deepseek(deepseek, DEEPSEEK_STRUCTURE | LITE_GEOMETRY | GATE_ROUTING, SMALL_LAYER_OUT,
                   seed=3)  # fmt: skip
    hybrid = tmp_path_factory.mktemp("tp-qwen35")
    qwen35.write_gate_checkpoint(hybrid, qwen35.SMALL, qwen35.SMALL_LAYER_OUT, seed=11)
    return {"qwen3": (qwen3, SMALL["vocab_size"]),
            "qwen35": (hybrid, qwen35.SMALL["vocab_size"]),
            "deepseek": (deepseek, LITE_GEOMETRY["vocab_size"])}  # fmt: skip


def one_gpu_tokens(path: Path, vocab: int) -> list[list[int]]:
    """One GPU's greedy tokens for `prompts`, its engine's memory freed after."""
    one = gpu_engine(path)
    expected = generate(one, prompts(vocab), greedy(24))
    del one
    gc.collect()
    torch.cuda.empty_cache()
    return expected


# How each case spreads the model over the two GPUs.
LAYOUTS = {
    "tensor": {"tensor_parallel_size": 2},
    "expert": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
    "data": {"data_parallel_size": 2, "enable_expert_parallel": True},
}


@pytest.mark.parametrize(("line", "layout", "async_scheduling"),
                         [("qwen3", "tensor", False), ("qwen3", "tensor", True),
                          ("qwen35", "tensor", False), ("deepseek", "tensor", False),
                          ("deepseek", "expert", False), ("deepseek", "data", False),
                          ("deepseek", "data", True)])  # fmt: skip
def test_two_gpus_generate_what_one_does(checkpoints, line, layout, async_scheduling):
    """DeepSeek with each routed expert's width split, the experts divided between the GPUs
    (expert parallel), or attention data-parallel (each GPU its own requests, tokens sent to
    their experts' GPU by all-to-all)."""
    path, vocab = checkpoints[line]
    expected = one_gpu_tokens(path, vocab)
    two = gpu_engine(path, async_scheduling=async_scheduling, **LAYOUTS[layout])
    try:
        assert two.runner.graphs is not None  # decode steps replay graphs on both ranks
        assert generate(two, prompts(vocab), greedy(24)) == expected
    finally:
        two.shutdown()


@pytest.mark.parametrize(("line", "layout"), [("qwen3", "tensor"), ("deepseek", "data")])
def test_two_gpus_as_two_hosts_generate_what_one_does(checkpoints, line, layout, tmp_path):
    """The several-hosts path on one machine: rank 0 here on GPU 0 (node 0, in this process),
    rank 1 in `pegainfer-server --node-rank 1` seeing only GPU 1 (its local GPU 0), meeting at
    127.0.0.1 over NCCL and the remote ranks' TCP link. Node 1 exits 0 once rank 0 stops."""
    import subprocess
    import sys

    from tests.server.conftest import free_port

    path, vocab = checkpoints[line]
    expected = one_gpu_tokens(path, vocab)
    layout_flags = {"tensor": ["--tensor-parallel-size", "2"],
                    "data": ["--data-parallel-size", "2", "--enable-expert-parallel"]}  # fmt: skip
    port = free_port()
    hosts = dict(nnodes=2, master_addr="127.0.0.1", master_port=port, rendezvous_timeout=120)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0,1").split(",")
    log = tmp_path / "node1.log"
    with open(log, "w") as handle:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "pegainfer.server.cli", "--model-path", str(path),
             "--device", "cuda", "--dtype", "bfloat16", *layout_flags[layout], "--nnodes", "2",
             "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
             "--rendezvous-timeout", "120"],
            stdout=handle, stderr=subprocess.STDOUT,
            env=os.environ | {"CUDA_VISIBLE_DEVICES": visible[1]},
        )  # fmt: skip
    try:
        two = gpu_engine(path, **LAYOUTS[layout], **hosts)
        try:
            assert two.runner.graphs is not None
            assert generate(two, prompts(vocab), greedy(24)) == expected
        finally:
            two.shutdown()
        assert node1.wait(60) == 0, log.read_text()
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def real_shape_checkpoint(line: str, tmp_path_factory) -> Path:
    """Qwen3-8B's or DeepSeek-V2-Lite's shapes with the gate's random weights (written by
    transformers), or the directory in QWEN3_8B_GATE_DIR / DEEPSEEK_GATE_DIR. The Qwen3 writer
    ties the LM head to the embedding (its recipe for peaked distributions needs that); every
    other tensor has Qwen3-8B's shape."""
    from pegainfer.server.bench.make_checkpoint import SHAPES

    if line == "qwen3-8b":
        from tests.qwen3 import golden_gate as gate
        from tests.qwen3 import test_engine_gpu as qwen3

        drop = ("tie_word_embeddings", "rope_theta")
        config = qwen3.QWEN3_4B | {k: v for k, v in SHAPES[line].items() if k not in drop}
        layer_out, env = qwen3.QWEN3_4B_LAYER_OUT, "QWEN3_8B_GATE_DIR"
        write = gate.write_gate_checkpoint
    else:
        from tests.deepseek import test_engine_gpu as deepseek

        config, layer_out, env = deepseek.V2_LITE, deepseek.V2_LITE_LAYER_OUT, "DEEPSEEK_GATE_DIR"
        write = deepseek.write_gate_checkpoint
    path = Path(os.environ.get(env) or tmp_path_factory.mktemp(line))
    if not (path / "config.json").exists():
        write(path, config, layer_out, seed=0)
        gc.collect()
        torch.cuda.empty_cache()
    return path


def scored(engine: EngineCore, prompts: list[list[int]], params: SamplingParams):
    """Each request's generated tokens, and its scored positions in order: the prompt's
    (teacher-forced) then the generated tokens'."""
    for i, prompt in enumerate(prompts):
        submit(engine, str(i), prompt, params)
    tokens: dict[str, list[int]] = {}
    scores: dict[str, list[TokenLogprob]] = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            assert out.error is None, out.error
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            scores.setdefault(out.request_id, []).extend(
                (out.prompt_logprobs or []) + (out.logprobs or [])
            )
    return [(tokens[str(i)], scores[str(i)]) for i in range(len(prompts))]


def deltas(one: TokenLogprob, two: TokenLogprob) -> tuple[list[float], float]:
    """|Δ logprob| over two's top tokens that one also ranks in its top (the scored token's
    always), and one's regret for two's choice (inf when one does not rank it at all)."""
    ranked = dict(one.top) | {one.token_id: one.logprob}
    found = [abs(lp - ranked[t]) for t, lp in two.top if t in ranked]
    if two.token_id == one.token_id:
        found.append(abs(two.logprob - one.logprob))
    choice = two.top[0][0]
    regret = one.top[0][1] - ranked[choice] if choice in ranked else float("inf")
    return found, regret


@pytest.mark.slow
@pytest.mark.parametrize(("line", "layout"), [
    ("qwen3-8b", "tensor"), ("deepseek-v2-lite", "tensor"), ("deepseek-v2-lite", "expert"),
    ("deepseek-v2-lite", "data"),
])  # fmt: skip
def test_two_gpus_at_real_shapes_score_what_one_does(line, layout, tmp_path_factory):
    """Qwen3 split by tensor parallelism and DeepSeek with each routed expert's width split,
    the experts divided, or attention data-parallel (`LAYOUTS`): prompts of 20-700 tokens and
    one of 2,000 (chunked prefill), each scored at every prompt position and over 24 greedy tokens
    (decode graphs), by one GPU and by two. Where the two scored the same tokens, the gate's
    tolerances hold for |Δ logprob| over the top 8 and for the regret of two's choice under
    one's distribution; the generations may part only at a near tie (regret within
    tolerance), after which they are not compared."""
    path = real_shape_checkpoint(line, tmp_path_factory)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 100_000, (n,), generator=g).tolist()
               for n in (20, 77, 150, 301, 480, 700, 2000)]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                            logprobs=HEAD_K, prompt_logprobs=HEAD_K)  # fmt: skip
    options = dict(max_model_len=4096, max_num_batched_tokens=1024, gpu_memory_utilization=0.5)
    one = gpu_engine(path, **options)
    expected = scored(one, prompts, params)
    del one
    gc.collect()
    torch.cuda.empty_cache()
    two = gpu_engine(path, **LAYOUTS[layout], **options)
    try:
        assert two.runner.graphs is not None
        got = scored(two, prompts, params)
    finally:
        two.shutdown()
    found: list[float] = []
    regrets: list[float] = []
    identical = 0
    for (tokens1, scores1), (tokens2, scores2), prompt in zip(expected, got, prompts, strict=True):
        assert len(scores1) == len(scores2) == len(prompt) - 1 + len(tokens1)
        pairs = enumerate(zip(tokens1, tokens2, strict=True))
        parted = next((i for i, (a, b) in pairs if a != b), None)
        identical += parted is None
        compared = len(prompt) - 1 + (len(tokens1) if parted is None else parted + 1)
        for s1, s2 in zip(scores1[:compared], scores2[:compared], strict=True):
            d, regret = deltas(s1, s2)
            found += d
            regrets.append(regret)
    found_t = torch.tensor(found)
    summary = {"positions": len(regrets), "identical_generations": identical,
               "max_regret": max(regrets), "mean_abs_delta": found_t.mean().item(),
               "p99_abs_delta": found_t.quantile(0.99).item()}  # fmt: skip
    print(line, layout, summary)
    assert summary["max_regret"] <= REGRET_TOL, summary
    assert summary["mean_abs_delta"] <= MEAN_TOL, summary
    assert summary["p99_abs_delta"] <= P99_TOL, summary
