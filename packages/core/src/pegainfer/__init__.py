"""pegainfer: an OpenAI-compatible LLM inference server.

`pegainfer` spans several distributions (core, server, one per model family); the line below
lets each contribute its subpackage (`pegainfer.server`, `pegainfer.models.qwen3`, ...) even when
they are installed from different directories, as editable installs are.
"""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

from pegainfer.core.args import EngineArgs  # noqa: E402
from pegainfer.core.llm import LLM  # noqa: E402
from pegainfer.core.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "EngineArgs", "SamplingParams"]
