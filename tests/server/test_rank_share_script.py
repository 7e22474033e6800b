"""`benchmarks/rank_share.sh` on the CPU, with `nvidia-smi` and the server stood in for: the
sizes come first, a share past the GPU is refused before anything starts, and a run that
reaches the server records its ready time and GPU memory in one archive under $OUT."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "benchmarks" / "rank_share.sh"
pytestmark = [pytest.mark.line("kimi_k2"), pytest.mark.slow]

FAKE_SMI = '#!/bin/sh\necho "1234, ${FAKE_GPU_MIB:-143771}"\n'  # MiB used and total: an H200
# Answers /health (and everything else) with 200 once started; says it was started.
FAKE_SERVER = f"""#!{sys.executable}
import http.server, pathlib, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
pathlib.Path(sys.argv[0]).with_name("started").write_text(" ".join(sys.argv[1:]))
print("GPU memory: 139.8 GiB total; weights 88.01 GiB", flush=True)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(
    tmp_path: Path, share: str, gpu_mib: int = 143771
) -> tuple[subprocess.CompletedProcess, Path]:
    shims = tmp_path / "bin"
    shims.mkdir()
    for name, text in (("nvidia-smi", FAKE_SMI), ("pegainfer-server", FAKE_SERVER)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    out = tmp_path / "out"
    env = os.environ | {"PATH": f"{shims}:{Path(sys.executable).parent}:{os.environ['PATH']}",
                        "OUT": str(out), "SHARE": share, "PORT": str(free_port()),
                        "BUDGET_S": "120", "FAKE_GPU_MIB": str(gpu_mib),
                        "MODEL_DIR": str(tmp_path / "share")}  # fmt: skip
    run = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    return run, out


def archived(out: Path, shape: str) -> dict[str, str]:
    with tarfile.open(out / f"rank_share_{shape}.tgz") as tar:
        return {Path(m.name).name: tar.extractfile(m).read().decode()
                for m in tar.getmembers() if m.isfile()}  # fmt: skip


def test_a_share_past_the_gpu_is_refused_before_anything_starts(tmp_path):
    run, out = run_script(tmp_path, "kimi-k2-int4:61:48", gpu_mib=81559)  # 94.5 GB on 80 GB
    assert run.returncode == 1, run.stdout + run.stderr
    assert "(94.500 GB) pass 90% of this GPU's 81559 MiB: not run" in run.stdout
    assert not (tmp_path / "bin" / "started").exists()
    sizes = archived(out, "kimi-k2-int4")["sizes.txt"]
    assert "kimi-k2-int4 (61 layers, 48 experts), one GPU: bytes per GPU" in sizes
    assert "DP8 + EP8" in sizes


def test_a_share_that_fits_is_served_and_measured(tmp_path):
    run, out = run_script(tmp_path, "kimi-k2-int4:61:48")
    assert run.returncode == 0, run.stdout + run.stderr
    started = (tmp_path / "bin" / "started").read_text()
    assert "--load-format dummy" in started and "--max-num-seqs 64" in started
    logs = archived(out, "kimi-k2-int4")
    ready = json.loads(logs["ready.json"])
    assert (ready["layers"], ready["experts"]) == (61, 48) and ready["http_ready_s"] >= 0
    config = json.loads((tmp_path / "share" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["n_routed_experts"]) == (61, 48)
    assert logs["gpu_memory_idle.csv"].strip() == "1234, 143771"
    assert "GPU memory: 139.8 GiB total" in run.stdout
    assert {"serve_1k128_c64.log", "serve_4k64_c1.log", "model_step.log"} <= logs.keys()
