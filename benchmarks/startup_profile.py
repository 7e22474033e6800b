"""Where start-up time and idle resident memory go: the server's start, phase by phase.

    python benchmarks/startup_profile.py --model-path DIR --out startup_profile.json

Runs what `pegainfer-server` runs before it is ready (its imports, CUDA initialisation, the
engine, the frontend) in this process, and records after each phase the seconds since the
process started and the resident memory (VmRSS). The engine's construction is also profiled
(cProfile, cumulative time) into a text file beside --out.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
from pathlib import Path

from pegainfer.core.process_info import rss_bytes, since_process_start


def _phase(name: str) -> dict[str, object]:
    return {"phase": name, "s": since_process_start(), "rss_mib": rss_bytes() / 2**20}


def main() -> None:
    phases = [_phase("interpreter started")]

    def mark(name: str) -> None:
        phases.append(_phase(name))
        print(phases[-1], flush=True)

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--max-model-len", type=int, default=20480)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--revision", default=None)
    args = parser.parse_args()

    import torch

    mark("import torch")
    import flashinfer  # noqa: F401  (the attention backend imports it when the engine builds)

    mark("import flashinfer")
    from hypercorn.asyncio import serve  # noqa: F401

    from pegainfer.core.args import EngineArgs
    from pegainfer.core.engine.core import EngineCore
    from pegainfer.core.engine.frontend import Frontend
    from pegainfer.server.app import build_app  # noqa: F401
    from pegainfer.server.bench.report import git_revision

    mark("import the server's modules")
    torch.cuda.init()
    torch.empty(1, device="cuda")
    mark("CUDA context")
    profiler = cProfile.Profile()
    profiler.enable()
    engine = EngineCore(EngineArgs(model=args.model_path, max_model_len=args.max_model_len))
    profiler.disable()
    mark("engine built (weights, memory plan, KV cache, CUDA graphs)")
    Frontend(engine.config.model_dir, engine.config.tokenizer_dir)
    mark("frontend (tokenizer, chat template)")

    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
    args.out.with_suffix(".engine_cprofile.txt").write_text(text.getvalue())
    result = {
        "revision": args.revision or git_revision(),
        "model_path": args.model_path,
        "phases": phases,
        "cuda_memory_reserved_mib": torch.cuda.memory_reserved() / 2**20,
    }
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
