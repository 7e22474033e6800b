"""pegainfer: an OpenAI-compatible LLM inference server.

`pegainfer` spans several distributions (core, server, one per model family); `extend_path`
lets each contribute its subpackage (`pegainfer.server`, `pegainfer.models.qwen3`, ...) even when
they are installed from different directories, as editable installs are. The public names
below load lazily, so importing a subpackage does not pull in torch.
"""

from importlib import import_module
from pkgutil import extend_path
from typing import Any

__path__ = extend_path(__path__, __name__)

_EXPORTS = {
    "LLM": "pegainfer.core.llm",
    "EngineArgs": "pegainfer.core.args",
    "SamplingParams": "pegainfer.core.sampling.sampling_params",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pegainfer' has no attribute {name!r}")
