"""An engine with two tensor-parallel ranks (CPU, gloo) generates what one process does, and
a worker that dies fails the engine with a clear error instead of hanging it."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from pegainfer.core.distributed.nodes import Nodes
from pegainfer.core.distributed.tensor_parallel import (
    RankFailedError,
    TensorParallelRanks,
    WorkerSpec,
)
from pegainfer.core.errors import ConfigError
from pegainfer.core.sampling.sampling_params import SamplingParams
from tests.engine_harness import drain, generate, greedy, make_engine, submit
from tests.qwen3.hf_reference import VOCAB, write_hf_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("tp-engine"), tie=False)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 17, 40)]


def write_latent_moe(line: str, path: Path, **overrides) -> Path:
    """A tiny DeepSeek-V2 checkpoint, or a Kimi-K2 one (q LoRA, noaux_tc routing) or a GLM-5
    one for a `line` starting with "kimi_k2" or "glm5"."""
    if line.startswith("kimi_k2"):
        from tests.kimi_k2.hf_reference import write_hf_checkpoint
    elif line.startswith("glm5"):
        from tests.glm5.hf_reference import write_hf_checkpoint
    else:
        from tests.deepseek.hf_reference import write_hf_checkpoint
    return write_hf_checkpoint(path, **overrides)


@pytest.mark.parametrize(("line", "async_scheduling"), [
    ("qwen3", False), ("qwen3", True), ("qwen35", False), ("qwen35", True), ("deepseek", False),
    ("deepseek-q-lora", False), ("deepseek-expert-parallel", True), ("kimi_k2", False),
    ("kimi_k2-expert-parallel", True),
])  # fmt: skip
def test_two_ranks_generate_what_one_does(checkpoint, tmp_path, line, async_scheduling):
    """Greedy answers with chunked prefill; Qwen3.5's recurrent state slots (each rank holds
    its heads' share of the state) follow rank 0's; DeepSeek's and Kimi's experts split over
    the ranks too (each expert's width halved, with and without a q LoRA: the fused q/kv_a
    projection keeps a rank's q rows or all q_a rows; or, expert parallel, the experts
    divided); under async scheduling the decode rows' ids reach the other rank from rank 0."""
    lora = {"q_lora_rank": 24} if line == "deepseek-q-lora" else {}
    experts = {"enable_expert_parallel": line.endswith("expert-parallel")}
    if line == "qwen3":
        path = checkpoint
    elif line == "qwen35":  # imported here: with only Qwen3 installed its cases still run
        from tests.qwen35.hf_reference import write_hf_checkpoint as write_qwen35

        path = write_qwen35(tmp_path / "qwen35", tie=False)
    else:
        path = write_latent_moe(line, tmp_path / line, **lora)
    expected = generate(make_engine(path), prompts(), greedy(12))
    engine = make_engine(path, tensor_parallel_size=2, max_num_batched_tokens=24,
                         async_scheduling=async_scheduling, **experts)  # fmt: skip
    try:
        assert generate(engine, prompts(), greedy(12)) == expected
    finally:
        engine.shutdown()


def scored_outputs(engine, prompts: list[list[int]], params: SamplingParams) -> list[list]:
    """Each request's outputs in order: (tokens, logprobs, prompt logprobs)."""
    for i, prompt in enumerate(prompts):
        submit(engine, str(i), prompt, params)
    found: dict[str, list] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests:
        for out in engine.step():
            found[out.request_id].append((out.new_token_ids, out.logprobs, out.prompt_logprobs))
    return [found[str(i)] for i in range(len(prompts))]


def assert_scores_close(got: list, expected: list) -> None:
    for outputs, wanted in zip(got, expected, strict=True):
        assert [o[0] for o in outputs] == [w[0] for w in wanted]
        for (_, logprobs, prompt), (_, want_logprobs, want_prompt) in zip(
            outputs, wanted, strict=True
        ):
            for a, b in zip((logprobs or []) + (prompt or []),
                            (want_logprobs or []) + (want_prompt or []), strict=True):  # fmt: skip
                assert (a.token_id, a.rank) == (b.token_id, b.rank)
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize(("line", "lora", "async_scheduling"),
                         [("deepseek", {}, False), ("deepseek", {"q_lora_rank": 24}, False),
                          ("deepseek", {}, True), ("glm5", {}, False), ("kimi_k2", {}, True)],
                         ids=["q", "q-lora", "q-async", "glm5", "kimi_k2-async"])  # fmt: skip
def test_two_attention_ranks_generate_what_one_does(tmp_path, line, lora, async_scheduling):
    """DeepSeek (and GLM-5, whose prompts attend sparsely; and Kimi-K2: q LoRA, noaux_tc
    routing) with data-parallel attention: the three requests spread over two ranks (two on
    rank 0), prompts chunked over steps where the other rank decodes or idles (its dummy token
    still joins the experts' all-to-all), each MoE layer's tokens exchanged with the experts'
    rank; greedy tokens, their logprobs and the prompts' equal one process's. Under async
    scheduling each rank's decode rows take their ids from rank 0's broadcast."""
    path = write_latent_moe(line, tmp_path / line, **lora)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)  # fmt: skip
    expected = scored_outputs(make_engine(path), prompts(), params)
    engine = make_engine(path, data_parallel_size=2, enable_expert_parallel=True,
                         max_num_batched_tokens=24, async_scheduling=async_scheduling)  # fmt: skip
    try:
        assert_scores_close(scored_outputs(engine, prompts(), params), expected)
        # "late" on rank 0, "gone" on rank 1, aborted mid-prompt: rank 1 then idles.
        submit(engine, "late", prompts()[1], greedy(12))
        submit(engine, "gone", prompts()[2], greedy(12))
        first = engine.step()
        assert engine.stats().num_running == 2 and engine.stats().kv_cache_usage > 0
        assert [o.request_id for o in engine.abort(["gone"])] == ["gone"]
        late = [t for o in first if o.request_id == "late" for t in o.new_token_ids]
        assert late + drain(engine)["late"] == [t for o in expected[1] for t in o[0]]
        assert engine.stats().num_running == 0
    finally:
        engine.shutdown()


@pytest.mark.line("deepseek")
def test_four_attention_ranks_generate_what_one_does(tmp_path):
    """Three requests on four ranks (two experts each): one rank only ever runs dummy tokens,
    and each token's two experts may sit on two other ranks."""
    from tests.deepseek.hf_reference import write_hf_checkpoint as write_deepseek

    path = write_deepseek(tmp_path / "deepseek")
    expected = generate(make_engine(path), prompts(), greedy(6))
    engine = make_engine(path, data_parallel_size=4, enable_expert_parallel=True,
                         max_num_batched_tokens=24)  # fmt: skip
    try:
        for i, prompt in enumerate(prompts()):
            submit(engine, str(i), prompt, greedy(6))
        assert [len(rank.waiting) for rank in engine.scheduler.ranks] == [1, 1, 1, 0]
        out = drain(engine)
        assert [out[str(i)] for i in range(3)] == expected
    finally:
        engine.shutdown()


@pytest.mark.line("deepseek")
def test_two_attention_ranks_score_a_long_prompt_that_samples_nothing_for_steps(tmp_path):
    """A prompt longer than the step's budget asks for prompt logprobs: its first chunks score
    prompt positions while no row of the step samples."""
    from tests.deepseek.hf_reference import write_hf_checkpoint as write_deepseek

    path = write_deepseek(tmp_path / "deepseek")
    prompt = torch.randint(0, 300, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    expected = scored_outputs(make_engine(path, max_num_batched_tokens=24), [prompt], params)
    engine = make_engine(path, data_parallel_size=2, enable_expert_parallel=True,
                         max_num_batched_tokens=24)  # fmt: skip
    try:
        assert_scores_close(scored_outputs(engine, [prompt], params), expected)
    finally:
        engine.shutdown()


def test_workers_outlast_an_idle_spell_longer_than_the_collective_timeout(checkpoint,
                                                                        monkeypatch):  # fmt: skip
    """Workers wait for rank 0's next message as long as the server is idle: only the
    forward's collectives have a time limit (8 s here, generous for a busy host's steps; the
    idle spell outlasts it)."""
    limit = 8.0
    monkeypatch.setenv("PEGAINFER_TP_TIMEOUT_S", str(limit))
    engine = make_engine(checkpoint, tensor_parallel_size=2)
    try:
        first = generate(engine, prompts()[:1], greedy(3))
        time.sleep(limit + 2)
        assert generate(engine, prompts()[:1], greedy(3)) == first
    finally:
        engine.shutdown()


def test_an_engine_that_fails_to_start_stops_its_workers(checkpoint):
    """A failed start-up leaves no workers and no process group behind: the next engine in
    the same process starts."""
    with pytest.raises(ConfigError, match="max_model_len"):
        make_engine(checkpoint, tensor_parallel_size=2, max_model_len=10**7)
    engine = make_engine(checkpoint, tensor_parallel_size=2)
    try:
        assert generate(engine, prompts()[:1], greedy(2))
    finally:
        engine.shutdown()


class _ExitsWhenUnpickled:
    """Unpickles into a call that ends the process: a worker that dies before it joins."""

    def __reduce__(self):
        return os._exit, (3,)


def test_a_worker_that_dies_before_joining_fails_the_start_at_once(monkeypatch):
    """Rank 0 does not wait in the rendezvous (or, on GPUs, in NCCL's set-up, which has no
    time limit) for a worker that is gone."""
    monkeypatch.setenv("PEGAINFER_TP_TIMEOUT_S", "120")
    spec = WorkerSpec("qwen3", Path("."), {"x": _ExitsWhenUnpickled()}, torch.float32, "cpu")
    start = time.monotonic()
    ranks = TensorParallelRanks(Nodes(2), spec)
    with pytest.raises(RankFailedError, match=r"rank 1 exited \(code 3\) before joining"):
        ranks.join()
    assert time.monotonic() - start < 60


def test_plans_larger_than_a_pipes_default_buffer_reach_the_workers(checkpoint, monkeypatch):
    """48 prompts of 500 tokens prefilled in one step, in blocks of one token: the plan (every
    token and every row's block table) outgrows a pipe's default 64 KiB, and the ranks still
    generate what one does."""
    sizes: list[int] = []
    post = TensorParallelRanks._post

    def measured(self, message):
        sizes.append(len(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)))
        post(self, message)

    monkeypatch.setattr(TensorParallelRanks, "_post", measured)
    g = torch.Generator().manual_seed(2)
    long = [torch.randint(0, VOCAB, (500,), generator=g).tolist() for _ in range(48)]
    options = dict(block_size=1, max_num_batched_tokens=48 * 500)  # every prompt in one step
    expected = generate(make_engine(checkpoint, **options), long, greedy(3))
    engine = make_engine(checkpoint, tensor_parallel_size=2, **options)
    try:
        assert generate(engine, long, greedy(3)) == expected
        # The pipe was widened, so rank 0's write of such a plan does not wait for the worker.
        limit = int(Path("/proc/sys/fs/pipe-max-size").read_text())
        room = fcntl.fcntl(engine.ranks._outboxes[0].fileno(), fcntl.F_GETPIPE_SZ)
        assert room == min(1 << 20, limit) > 64 * 1024
    finally:
        engine.shutdown()
    assert max(sizes) > 64 * 1024


def test_workers_end_when_rank_0_is_killed(checkpoint, tmp_path):
    """A worker does not outlive a rank 0 that was killed (no stop message, no atexit)."""
    script = tmp_path / "rank0.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, signal
        from tests.engine_harness import generate, greedy, make_engine
        if __name__ == "__main__":
            engine = make_engine({str(checkpoint)!r}, tensor_parallel_size=2)
            generate(engine, [[1, 2, 3]], greedy(2))
            print(engine.ranks.workers[0].pid, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    )
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, str(script)], cwd=root, capture_output=True, text=True,
                         env=os.environ | {"PYTHONPATH": str(root)}, timeout=120)  # fmt: skip
    assert run.returncode == -signal.SIGKILL, run.stderr
    worker = int(run.stdout.split()[-1])
    deadline = time.monotonic() + 15
    while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{worker}").exists()


def test_workers_wait_for_a_rank_0_that_loads_for_longer_than_the_time_limit(
    checkpoint, monkeypatch
):
    """A worker that has loaded waits for rank 0's go however long rank 0 still loads (past
    the 4 s collective limit here): joining first, it would time out in the rendezvous."""
    from pegainfer.models.qwen3.line import Qwen3Line

    build = Qwen3Line.build_model
    limit = 4.0

    def slow(self, context):
        time.sleep(2 * limit)
        return build(self, context)

    monkeypatch.setenv("PEGAINFER_TP_TIMEOUT_S", str(limit))
    monkeypatch.setattr(Qwen3Line, "build_model", slow)
    engine = make_engine(checkpoint, tensor_parallel_size=2)
    try:
        assert generate(engine, prompts()[:1], greedy(3))
    finally:
        engine.shutdown()


def test_workers_still_loading_stop_when_rank_0_fails_to_load(checkpoint, monkeypatch):
    """Workers load their shares while rank 0 loads its own; if rank 0's load fails, they are
    stopped, not left loading or waiting to join."""
    from pegainfer.models.qwen3.line import Qwen3Line

    def unreadable(self, context):
        raise ConfigError("rank 0's weights are unreadable")

    monkeypatch.setattr(Qwen3Line, "build_model", unreadable)
    with pytest.raises(ConfigError, match="unreadable"):
        make_engine(checkpoint, tensor_parallel_size=2)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("pegainfer-tp")]


def test_the_engine_loop_stops_the_workers_when_it_ends(checkpoint):
    """The loop shuts its engine down from its own thread (graphs, then the communicator, then
    the workers), not at exit: NCCL's teardown at exit waits on the graphs still alive."""
    from pegainfer.core.engine.loop import EngineLoop

    engine = make_engine(checkpoint, tensor_parallel_size=2)
    loop = EngineLoop(engine)
    loop.start(lambda data: None)
    loop.shutdown()
    assert not loop._thread.is_alive()
    assert not any(worker.is_alive() for worker in engine.ranks.workers)


# The server's ranks: Qwen3 split by tensor parallelism, or DeepSeek's attention ranks.
SERVED = {
    "tensor": ("qwen3", ["--tensor-parallel-size", "2"]),
    "data": ("deepseek", ["--data-parallel-size", "2", "--enable-expert-parallel"]),
}


# Each layout as a parameter that skips when its line is not installed.
LAYOUTS = [
    pytest.param(name, marks=pytest.mark.line(line)) for name, (line, _) in sorted(SERVED.items())
]


def start_ranked_server(tmp_path: Path, layout: str, max_model_len: int):
    from pegainfer.core.plugins import model_lines
    from tests.server.conftest import start_server

    line, flags = SERVED[layout]
    model = tmp_path / "tiny"
    next(m for m in model_lines() if m.name == line).write_tiny_checkpoint(model)
    return start_server(model, tmp_path / "log", "--device", "cpu", "--max-model-len",
                        str(max_model_len), *flags)  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_server_serves_with_two_ranks(tmp_path, layout):
    """`pegainfer-server` with two ranks answers concurrent requests (with data-parallel
    attention, on both ranks), and its workers end with it."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from tests.server.conftest import stop_server

    server = start_ranked_server(tmp_path, layout, 256)
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="none")

        def complete(prompt: str) -> int:
            reply = client.completions.create(
                model=server.model, prompt=prompt, max_tokens=5, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return reply.usage.completion_tokens

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(complete, ["Hello", "Hi there", "Once", "A"])) == [5] * 4
        workers = _descendants(server.process.pid)
        assert workers  # the rank-1 worker (and spawn's helper)
    finally:
        stop_server(server)
    deadline = time.monotonic() + 15  # the worker, then spawn's resource tracker, wind down
    while (alive := [p for p in workers if Path(f"/proc/{p}").exists()]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert not alive, f"processes outlived the server: {alive}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_rank_dying_mid_request_ends_it_with_an_error_and_the_server_reports_unhealthy(
    tmp_path, layout
):
    """The stream in flight ends with an `engine_error` event (it never hangs), /health turns
    503, and a new request is refused."""
    import json

    import httpx

    from tests.server.conftest import stop_server

    server = start_ranked_server(tmp_path, layout, 4096)
    try:
        body = {"model": server.model, "prompt": "Hello", "max_tokens": 2000, "stream": True,
                "ignore_eos": True, "temperature": 0}  # fmt: skip
        events = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as reply:
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line.removeprefix("data: ")))
                if len(events) == 3:  # mid-request: kill the rank-1 worker
                    os.kill(_rank_worker(server.process.pid), signal.SIGKILL)
        assert "error" in events[-1] and events[-1]["error"]["code"] == "engine_error"
        assert len(events) < 2000
        health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 503
        body = {"model": server.model, "prompt": "Hi", "max_tokens": 2}
        again = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert again.status_code >= 500
    finally:
        stop_server(server)


def _rank_worker(pid: int) -> int:
    """The tensor-parallel worker below the server `pid`: spawned (spawn's entry point, not
    its resource tracker) by the engine process, which the server started."""
    below = {p: Path(f"/proc/{p}/cmdline").read_bytes() for p in _descendants(pid)}
    engines = {p for p, cmdline in below.items() if b"pegainfer.core.engine.spawn" in cmdline}
    for child, cmdline in below.items():
        if b"spawn_main" in cmdline and _parent(child) in engines:
            return child
    raise AssertionError("no worker process found")


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def test_a_dead_rank_fails_the_engine(checkpoint):
    engine = make_engine(checkpoint, tensor_parallel_size=2)
    try:
        submit(engine, "a", prompts()[1], greedy(4))
        drain(engine)
        engine.ranks.workers[0].kill()
        engine.ranks.workers[0].join()
        submit(engine, "b", prompts()[2], greedy(4))
        with pytest.raises(RankFailedError, match="rank 1 exited"):
            engine.step()
    finally:
        engine.shutdown()


def test_a_rank_dying_while_the_loop_idles_fails_it_at_once(checkpoint):
    """No request needs to run into the dead rank: the watcher wakes the idle loop, which
    reports the engine failed (the server's /health then turns 503)."""
    import queue

    from pegainfer.core.engine.loop import EngineLoop, decode_outputs

    loop = EngineLoop(make_engine(checkpoint, tensor_parallel_size=2))
    sent: queue.SimpleQueue[bytes] = queue.SimpleQueue()
    loop.start(sent.put)
    try:
        loop.engine.ranks.workers[0].kill()
        failure = decode_outputs(sent.get(timeout=60)).engine_failed
        assert failure is not None and "parallel rank 1 exited mid-run" in failure
        assert not loop.alive
    finally:
        loop.shutdown()


def test_what_tensor_parallelism_does_not_cover_yet_is_refused(checkpoint):
    with pytest.raises(ConfigError, match="--kv-offload does not work with parallel ranks"):
        make_engine(checkpoint, tensor_parallel_size=2, kv_offload=True)


def test_expert_parallelism_is_refused_for_a_line_without_experts(checkpoint):
    with pytest.raises(ConfigError, match="does not use these arguments: enable_expert_parallel"):
        make_engine(checkpoint, tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ConfigError, match="does not use these arguments: enable_expert_parallel"):
        make_engine(checkpoint, data_parallel_size=2, enable_expert_parallel=True)


@pytest.mark.line("deepseek")
def test_data_parallel_attention_is_refused_for_a_line_that_does_not_declare_it(tmp_path):
    """A line runs data-parallel attention only if it says so (its forward must exchange
    tokens and return every rank's rows on rank 0)."""
    from pegainfer.core.args import EngineArgs
    from pegainfer.core.engine.core import EngineCore
    from pegainfer.models.deepseek.line import DeepseekLine
    from tests.deepseek.hf_reference import write_hf_checkpoint as write_deepseek

    class Undeclared(DeepseekLine):
        supports_data_parallel = False

    args = EngineArgs(model=str(write_deepseek(tmp_path / "deepseek")), device="cpu",
                      data_parallel_size=2, enable_expert_parallel=True)  # fmt: skip
    with pytest.raises(ConfigError, match="'deepseek' model line does not run data-parallel"):
        EngineCore(args, lines=[Undeclared()])


@pytest.mark.parametrize(("args", "error"), [
    ({}, "needs --enable-expert-parallel"),
    ({"enable_expert_parallel": True, "tensor_parallel_size": 2}, "not supported yet"),
])  # fmt: skip
def test_what_data_parallel_attention_does_not_cover_is_refused(args, error):
    from pegainfer.core.args import EngineArgs

    with pytest.raises(ConfigError, match=error):
        EngineArgs(model="x", data_parallel_size=2, **args).validate()


@pytest.mark.parametrize(("device", "visible", "error"), [
    ("cuda", 1, "need 2 GPUs; visible: 1"),
    ("cuda:1", 4, "CUDA_VISIBLE_DEVICES"),
    ("mps", 0, "CUDA or the CPU"),
])  # fmt: skip
def test_the_gpus_for_tensor_parallelism_are_checked(monkeypatch, device, visible,
                                                                   error):  # fmt: skip
    from pegainfer.core.args import EngineArgs
    from pegainfer.core.engine.core import check_parallel

    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    args = EngineArgs(model="unused", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match=error):
        check_parallel(args, torch.device(device), 2)


def test_nvlink_multicast_stays_off_unless_the_user_says_otherwise(monkeypatch):
    from pegainfer.core.distributed.tensor_parallel import keep_multicast_off

    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")  # the user's own choice
    assert keep_multicast_off() == {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "0",
    }


@pytest.mark.parametrize("value", ["soon", "0", "-5"])
def test_a_bad_collective_time_limit_is_refused(monkeypatch, value):
    from pegainfer.core.distributed.tensor_parallel import collective_timeout

    monkeypatch.setenv("PEGAINFER_TP_TIMEOUT_S", value)
    with pytest.raises(ConfigError, match="PEGAINFER_TP_TIMEOUT_S"):
        collective_timeout()
