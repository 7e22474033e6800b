"""Finding a checkpoint: a local directory, or a Hugging Face repo id fetched to the local cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pegainfer.core.errors import ConfigError

_CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


def resolve_model_dir(model: str, revision: str | None = None, marker: str = "config.json") -> Path:
    """The local directory holding `model`'s files, downloading them if `model` is a repo id.

    `marker` is the file that makes a directory the right kind (a checkpoint's config.json,
    a tokenizer's tokenizer.json).
    """
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / marker).is_file():
            raise ConfigError(f"{path} is a directory but holds no {marker}")
        return path.resolve()
    if path.exists():
        raise ConfigError(f"{path} is a file; pass its directory")
    if model.count("/") != 1 or model.startswith(("/", ".", "~")):
        raise ConfigError(f"{model!r} is neither a local directory nor a Hugging Face repo id")
    return _download(model, revision)


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(
            snapshot_download(repo_id, revision=revision, allow_patterns=_CHECKPOINT_PATTERNS)
        )
    except LocalEntryNotFoundError as exc:
        raise ConfigError(
            f"cannot fetch {repo_id!r}: the Hugging Face hub is unreachable and the repo is not "
            "in the local cache; download it elsewhere and pass its directory"
        ) from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ConfigError(f"cannot fetch {repo_id!r} from the Hugging Face hub: {exc}") from exc


def read_json_object(path: Path, *, required: bool = True) -> dict[str, Any]:
    """The JSON object in `path`; `{}` for an absent optional file; `ConfigError` otherwise."""
    if not path.is_file():
        if required:
            raise ConfigError(f"{path.parent} holds no {path.name}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def read_config(model_dir: Path) -> dict[str, Any]:
    return read_json_object(model_dir / "config.json")
