"""`pegainfer-tiny LINE OUT_DIR`: write a small random checkpoint of an installed model line.

The checkpoint has the real layout (config.json, safetensors with Hugging Face key names, a
tokenizer with the family's special tokens and chat template, generation_config.json), so it
exercises the same code as a real download, on any machine, in seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

from pegainfer.core.plugins import model_lines


def save_sharded(tensors: dict[str, torch.Tensor], out_dir: Path, num_shards: int = 1) -> None:
    """Write `model.safetensors`, or `num_shards` files and their index, as transformers does.
    Tensors may live on any device: each file's are brought to the host as it is written."""

    def host(chunk: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: t.cpu().contiguous() for n, t in chunk.items()}

    if num_shards == 1:
        save_file(host(tensors), out_dir / "model.safetensors", metadata={"format": "pt"})
        return
    names = list(tensors)
    per_shard = math.ceil(len(names) / num_shards)
    weight_map = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        chunk = {n: tensors[n] for n in names[shard * per_shard : (shard + 1) * per_shard]}
        save_file(host(chunk), out_dir / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(chunk, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv: list[str] | None = None) -> int:
    lines = {line.name: line for line in model_lines()}
    parser = argparse.ArgumentParser(prog="pegainfer-tiny", description=__doc__.split("\n")[0])
    parser.add_argument("line", choices=sorted(lines), help="model line (installed families)")
    parser.add_argument(
        "out_dir",
        type=Path,
        help="directory to write the checkpoint into (an older one there "
        "is replaced once the new one is complete)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--num-shards", type=int, default=1, help="safetensors files to write")
    parser.add_argument(
        "--set",
        dest="overrides",
        type=_override,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config.json field (VALUE parsed as JSON), e.g. --set num_hidden_layers=4",
    )
    args = parser.parse_args(argv)
    line = lines[args.line]
    out = args.out_dir
    if (
        out.exists()
        and (not out.is_dir() or any(out.iterdir()))
        and not (out / "config.json").exists()
    ):
        print(f"pegainfer-tiny: {out} exists and holds no checkpoint; not replacing it",
              file=sys.stderr)  # fmt: skip
        return 2
    with _written_whole(args.out_dir) as staging:
        line.write_tiny_checkpoint(
            staging, seed=args.seed, num_shards=args.num_shards, **dict(args.overrides)
        )
    print(f"wrote a tiny {args.line} checkpoint to {args.out_dir}")
    return 0


@contextmanager
def _written_whole(out_dir: Path) -> Iterator[Path]:
    """A staging folder beside `out_dir` that becomes `out_dir` (replacing an older one) only
    once the block succeeds: a failed write leaves no half-written checkpoint behind."""
    out_dir = out_dir.absolute()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        yield staging
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
            out_dir.rename(old / out_dir.name)
            staging.rename(out_dir)
            shutil.rmtree(old)
        else:
            staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
