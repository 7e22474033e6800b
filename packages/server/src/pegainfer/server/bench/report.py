"""How benchmark results are recorded and shown: run metadata, JSON files, text and plots."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pegainfer.server.bench.client import BenchClient, Generation, RequestResult

_WIDTH = 50
_LATENCY_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def git_revision() -> str | None:
    """The commit of the pegainfer checkout this runs from: $PEGAINFER_REVISION where set (a
    copy of the tree without its .git), else git's answer; None outside a git checkout."""
    if revision := os.environ.get("PEGAINFER_REVISION"):
        return revision
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def run_metadata(server_version: str | None) -> dict[str, Any]:
    """What identifies a run: its command line, start time, code revision, server version."""
    return {
        "command": shlex.join(sys.argv),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "revision": git_revision(),
        "server_version": server_version,
    }


async def start_run(
    client: BenchClient, args: argparse.Namespace, max_tokens: int
) -> tuple[Generation, dict[str, Any]]:
    """What every run begins with: request settings from the common options (the model
    defaulting to the server's first) and the run's metadata."""
    generation = Generation(
        args.model or await client.first_model(), max_tokens, args.ignore_eos, args.temperature
    )
    return generation, run_metadata(await client.server_version())


def write_json(path: str | Path, result: Mapping[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def rate_label(rate: float) -> float | str:
    """A request rate as vLLM writes it to JSON: a number, or "inf" (JSON has no infinity)."""
    return rate if rate != float("inf") else "inf"


def block(title: str, rows: Sequence[tuple[str, Any]], result: Mapping[str, Any]) -> str:
    """A vLLM-style report: `rows` of (label, value), then the latency sections of `result`."""
    lines = [f" {title} ".center(_WIDTH, "=")]
    lines += [_row(label, value) for label, value in rows]
    for key, short, header in _LATENCY_SECTIONS:
        lines.append(header.center(_WIDTH, "-"))
        for stat, name in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            lines.append(_row(f"{name} {short} (ms):", result[f"{stat}_{key}_ms"]))
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def _row(label: str, value: Any) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40} {text:<10}"


def print_failures(what: str, results: Sequence[RequestResult]) -> None:
    """The first ten errors of failed requests, as vLLM prints them."""
    errors = [r.error for r in results if not r.success]
    if errors:
        print(f"{len(errors)} {what} request(s) failed; the first errors:")
        for i, error in enumerate(errors[:10]):
            print(f"  {i}: {error}")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def plot_sweep(results: Sequence[Mapping[str, Any]], path: str | Path, title: str) -> None:
    """Three panels against request rate: output throughput, TTFT and TPOT (mean and p99)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "the sweep plot needs matplotlib: pip install 'pegainfer-server[bench]'"
        ) from None
    matplotlib.use("Agg")
    from matplotlib import pyplot

    rates = [r["request_rate"] for r in results]
    figure, (throughput, ttft, tpot) = pyplot.subplots(1, 3, figsize=(15, 4.5))
    throughput.plot(rates, [r["output_throughput"] for r in results], marker="o")
    throughput.set_ylabel("output tokens/s")
    throughput.set_title("Output token throughput")
    for axes, key, name in ((ttft, "ttft", "TTFT"), (tpot, "tpot", "TPOT")):
        for stat in ("mean", "p99"):
            values = [r[f"{stat}_{key}_ms"] for r in results]
            axes.plot(rates, values, marker="o", label=stat)
        axes.set_ylabel("ms")
        axes.set_title(name)
        axes.legend()
    for axes in (throughput, ttft, tpot):
        axes.set_xlabel("request rate (req/s)")
        axes.set_ylim(bottom=0)
        axes.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
